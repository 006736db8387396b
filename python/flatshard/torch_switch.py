"""flatshard in place of torch's FSDP for the whole process:
use_for_torch_fsdp() puts flatshard's classes and functions wherever torch's
FSDP APIs are reached, so frameworks that import them from torch (their
fully_shard calls, their isinstance(m, FSDPModule) checks) run on flatshard;
restore_torch_fsdp(), or the returned handle's restore(), puts torch's back.

What is replaced, name by name, in torch's FSDP namespaces (_NAMESPACES:
torch.distributed.fsdp, .api, .wrap, .fully_sharded_data_parallel,
._fully_shard, ._fully_shard._fully_shard, torch.distributed._composable.fsdp
and its fully_shard module): each name for which flatshard's counterpart path
(flatshard, flatshard.api, ...) holds an object of its own. Names where
flatshard takes torch's object as it is (the FSDP2 policies, FlatParameter,
enable_wrap) stay. Then any other module already imported that holds one of
torch's replaced objects as a global (a framework that did `from
torch.distributed.fsdp import fully_shard` at import) gets flatshard's too,
except torch's own FSDP implementation modules and
torch.distributed.checkpoint.state_dict, whose FSDP1 path reads torch's
private unit state: it keeps torch's class, and is imported first so that a
later import cannot bind flatshard's.

Refused (ConfigError) while a module wrapped by torch's own FSDP1 class or
fully_shard is alive: those would keep running torch's hooks beside
flatshard's. Found without any registry of torch's: the classes are torch's
FullyShardedDataParallel and the FSDPModule subclasses torch's fully_shard
made (FSDPModule.__subclasses__), and one pass over the garbage collector's
objects looks for their instances; only if it finds some does a collection
run, so that a model already dropped does not count.

Above the rest of the package (it imports fsdp/, fsdp2/ and the path
modules); imported by __init__.py and __main__.py only.
"""
import gc
import importlib
import os
import sys
import types
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as _TorchFSDP

from . import _fully_shard, api, fully_sharded_data_parallel, wrap
from ._fully_shard import _fully_shard as _fully_shard_module
from .errors import ConfigError, bad_type

# torch's path -> flatshard's path with the same names (None: the package).
_NAMESPACES = {
    "torch.distributed.fsdp": None,
    "torch.distributed.fsdp.api": api,
    "torch.distributed.fsdp.wrap": wrap,
    "torch.distributed.fsdp.fully_sharded_data_parallel": fully_sharded_data_parallel,
    "torch.distributed.fsdp._fully_shard": _fully_shard,
    "torch.distributed.fsdp._fully_shard._fully_shard": _fully_shard_module,
    "torch.distributed._composable.fsdp": _fully_shard,
    "torch.distributed._composable.fsdp.fully_shard": _fully_shard,
}
# Modules that keep torch's objects: flatshard (which builds on some of
# them), torch's FSDP implementation, and torch's state-dict helpers (see the
# header). The last is imported before anything is replaced.
_KEEP_PREFIXES = ("flatshard.", "torch.distributed.fsdp.", "torch.distributed._composable.")
_KEEPS_TORCH = "torch.distributed.checkpoint.state_dict"


@dataclass
class TorchFSDPSwitch:
    """What use_for_torch_fsdp() did.

    replaced  (module, name, torch's object, flatshard's), one per global
              replaced
    active    True until restore(), which puts torch's objects back wherever
              flatshard's still are (a second restore() does nothing)"""
    replaced: list = field(default_factory=list)
    active: bool = True

    def restore(self):
        global _ACTIVE
        if not self.active:
            return
        for module, name, theirs, ours in reversed(self.replaced):
            if vars(module).get(name) is ours:
                setattr(module, name, theirs)
        self.active = False
        if _ACTIVE is self:
            _ACTIVE = None

    def summary(self):
        """One line: what now runs on flatshard, and where."""
        names = sorted({f"{m.__name__}.{n}" for m, n, _, _ in self.replaced
                        if m.__name__ in _NAMESPACES})
        short = sorted({n.rsplit(".", 1)[1] for n in names})
        others = sorted({m.__name__ for m, _, _, _ in self.replaced
                         if m.__name__ not in _NAMESPACES})
        line = (f"flatshard: torch's FSDP APIs now run on flatshard: {len(short)} names "
                f"({', '.join(short)}) replaced in {len({n.rsplit('.', 1)[0] for n in names})} "
                f"torch modules")
        if others:
            line += f" and {len(others)} already-imported modules ({', '.join(others)})"
        return line


_ACTIVE = None


def _counterpart(path):
    ours = _NAMESPACES[path]
    return sys.modules[__package__] if ours is None else ours


def _torch_classes():
    """torch's FSDP1 class and every class torch's fully_shard made, with
    their subclasses."""
    out, todo = set(), [_TorchFSDP, _TorchFSDPModule]
    while todo:
        cls = todo.pop()
        if cls not in out:
            out.add(cls)
            todo.extend(cls.__subclasses__())
    out.discard(_TorchFSDPModule)  # only its subclasses have instances
    return out


def _torch_wrapped():
    """Live modules wrapped by torch's FSDP (class names, at most 3), and how many."""
    classes = _torch_classes()
    found = [o for o in gc.get_objects() if type(o) in classes]
    if found:
        del found
        gc.collect()  # a model already dropped but still in a reference cycle
        found = [o for o in gc.get_objects() if type(o) in classes]
    return [type(o).__name__ for o in found[:3]], len(found)


def _is_rank_0():
    """Rank 0 of the job, before the process group may exist: torchrun sets
    RANK; launchers that start the other ranks themselves (Lightning's) set
    only LOCAL_RANK and NODE_RANK in them."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    env = os.environ
    if "RANK" in env:
        return env["RANK"] == "0"
    return env.get("LOCAL_RANK", "0") == "0" and env.get("NODE_RANK", "0") == "0"


def use_for_torch_fsdp(announce=True):
    """Make every user of torch's FSDP APIs in this process run on flatshard:
    torch.distributed.fsdp's FullyShardedDataParallel and its options,
    fully_shard, FSDPModule, register_fsdp_forward_method and the wrap
    policies, at every module path torch has them (see the module's header).
    Call it before any model is wrapped, in every rank; `python -m flatshard
    run SCRIPT` does it for a script. Returns a TorchFSDPSwitch whose
    restore() undoes it (as restore_torch_fsdp() does); calling it again
    while it is on returns the same one. With `announce`, rank 0 writes one
    line to stderr saying what was replaced.

    Raises ConfigError while a module wrapped by torch's own FSDP is alive."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    if not isinstance(announce, bool):
        raise bad_type("announce", announce, "True or False")
    names, count = _torch_wrapped()
    if count:
        raise ConfigError(
            f"flatshard: use_for_torch_fsdp(): torch's own FSDP already wraps {count} live "
            f"module(s) in this process ({', '.join(names)}{', ...' if count > 3 else ''}); "
            f"they would keep running torch's hooks beside flatshard's. Call it before any "
            f"model is wrapped (at the top of the script, or launch with "
            f"`python -m flatshard run SCRIPT`), or drop those models first")
    importlib.import_module(_KEEPS_TORCH)
    switch = TorchFSDPSwitch()
    theirs_to_ours = {}
    for path in _NAMESPACES:
        module, ours_ns = importlib.import_module(path), _counterpart(path)
        for name, theirs in list(vars(module).items()):
            ours = getattr(ours_ns, name, None)
            if name.startswith("_") or ours is None or ours is theirs or \
                    isinstance(ours, types.ModuleType):
                continue
            theirs_to_ours[id(theirs)] = (theirs, ours)
            switch.replaced.append((module, name, theirs, ours))
    for module in [m for n, m in list(sys.modules.items())
                   if not (n in _NAMESPACES or n == _KEEPS_TORCH or n == __package__ or
                           n.startswith(_KEEP_PREFIXES))]:
        space = getattr(module, "__dict__", None)
        if not isinstance(space, dict):
            continue
        for name, value in list(space.items()):
            hit = theirs_to_ours.get(id(value))
            if hit is not None and hit[0] is value:
                switch.replaced.append((module, name, value, hit[1]))
    for module, name, _, ours in switch.replaced:
        setattr(module, name, ours)
    _ACTIVE = switch
    if announce and _is_rank_0():
        print(switch.summary(), file=sys.stderr, flush=True)
    return switch


def restore_torch_fsdp():
    """Undo use_for_torch_fsdp(): torch's objects back wherever flatshard's
    were put. Modules already wrapped by flatshard stay flatshard's. Does
    nothing when the switch is off."""
    if _ACTIVE is not None:
        _ACTIVE.restore()


def torch_fsdp_switch():
    """The TorchFSDPSwitch in effect, or None."""
    return _ACTIVE
