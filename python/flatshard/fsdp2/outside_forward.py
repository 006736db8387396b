"""A fully_shard module's parameters read outside its forward. Between its
forward and backward (resharded after forward) and before its first
forward, a module's registered parameters are its sharded DTensors, as in
torch. A method other than forward (model.generate, an embed_only helper)
that reads them directly runs no gather, and torch's DTensor stops it with
"aten.mm.default got mixed torch.Tensor and DTensor", which names neither
the module nor the fix. torch raises it in C++, where nothing of flatshard
is on the stack, so the method is the place to catch it.

guarded_methods(cls) gives FSDP<cls> (api.py's class for modules of class
cls) a wrapper of each public method the model's own classes define (not
forward, not nn.Module's or FSDPModule's, nothing starting with "_"): it
calls the method, and where that raises torch's error, raises an
OutsideForwardError (a RuntimeError, as torch's) that names the module,
the method and the fix. Forward and the private helpers it calls are left
alone: the cost is one Python call around each call of a public method of
the model's classes (benchmarks/results/mistakes2.md), nothing on the
hooks' plain path.

Imports: errors, noop (a module's class name).
"""
import functools
import inspect

import torch.nn as nn

from ..errors import OutsideForwardError
from ..noop import class_name

MIXED = "got mixed torch.Tensor and DTensor"


def guarded_methods(cls, base):
    """{name: wrapper} for FSDP<cls>'s namespace: the public functions of
    cls's own classes (up to nn.Module) that `base` (FSDPModule) and
    nn.Module do not have."""
    out = {}
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            break
        for name, fn in vars(klass).items():
            if name.startswith("_") or name == "forward" or name in out or \
                    not inspect.isfunction(fn) or hasattr(nn.Module, name) or \
                    hasattr(base, name):
                continue
            out[name] = _guard(fn, name)
    return out


def _guard(fn, name):
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except RuntimeError as e:
            if isinstance(e, OutsideForwardError) or MIXED not in str(e):
                raise
            raise OutsideForwardError(_message(self, name, e)) from e
    return method


def _message(module, name, err):
    own = class_name(module)
    return (f"flatshard: {own}.{name}() read the parameters of a fully_shard module outside "
            "its forward, while they are resharded: they hold this rank's shards (DTensors), "
            f"and nothing gathered them. Run {name} with the gathers forward has: call "
            f"register_fsdp_forward_method(model, {name!r}) on this module (the model whose "
            f"{name} it is), and inside {name} call submodules (self.layer(x)) rather than "
            "reading their parameters; or gather first (module.unshard(), then "
            f"module.reshard()). (torch's words: {str(err).splitlines()[0]})")
