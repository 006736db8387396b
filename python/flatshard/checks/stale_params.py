"""Item: an optimizer built before its model was wrapped.

FSDP1 (use_orig_params=False) replaces a unit's parameters by its flat
shard, and fully_shard replaces each parameter by a sharded DTensor one
(both as torch's do). An optimizer built before holds the originals: its
steps run and change nothing the model uses, with no error in torch. Each
original a wrap takes out is recorded here, weakly (id -> weakref and its
name), and an optimizer's first step() looks its parameters up: any found
is a StaleOptimizerError naming them. Raised rather than warned: such an
optimizer trains nothing of what it holds, which no script means.
Later steps cost one set lookup (hooks.py)."""
import weakref

from .. import envvars
from ..errors import StaleOptimizerError
from . import text

ENV = "FLATSHARD_CHECK_OPTIMIZER"
ENTRY = "An optimizer built before wrapping"
_REPLACED = {}  # id(param) -> (weakref to it, name source, its index there, name, wrapper)


def _forget(key):
    def drop(ref):
        e = _REPLACED.get(key)
        if e is not None and e[0] is ref:
            del _REPLACED[key]
    return drop


def record(params, names, wrapper, owner=None):
    """params: the originals a wrap took out of their modules; names: each
    one's name as the wrap knows it; owner: an object whose `param_fqns`
    (once set: fully_shard's lazy init) names them in the whole model."""
    ref_owner = weakref.ref(owner) if owner is not None else None
    for i, (p, name) in enumerate(zip(params, names)):
        _REPLACED[id(p)] = (weakref.ref(p, _forget(id(p))), ref_owner, i, name, wrapper)


def _name(entry):
    _, ref_owner, i, name, _ = entry
    owner = ref_owner() if ref_owner is not None else None
    fqns = getattr(owner, "param_fqns", None)
    return fqns[i] if fqns else name


def check(optimizer):
    """At `optimizer`'s first step: raise if it holds replaced parameters."""
    if not _REPLACED or not envvars.read_flag(ENV, True):
        return
    found, total = [], 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            total += 1
            e = _REPLACED.get(id(p))
            if e is not None and e[0]() is p:
                found.append(e)
    if not found:
        return
    wrappers = " and ".join(dict.fromkeys(e[4] for e in found))
    share = "all" if len(found) == total else f"{len(found)} of the {total}"
    raise StaleOptimizerError(
        f"flatshard: rank {text.this_rank()}: {type(optimizer).__name__}.step() would update "
        f"{share} parameters it holds that {wrappers} replaced when it wrapped their module "
        f"({text.names(_name(e) for e in found)}): the model no longer uses them, so training "
        "would change nothing of it. The optimizer was built before wrapping: build it after, "
        "from the wrapped model's parameters (e.g. torch.optim.AdamW(model.parameters()) after "
        f"FSDP(model) or fully_shard(model)). {text.guide(ENTRY, ENV)}")
