"""What the installed torch has and does, where that differs between the torch
versions flatshard is tested on (2.13 and 2.15): the one place such facts are
read, so that the APIs, the doctor (`python -m flatshard doctor`) and the
surface tests agree, and no torch version check is scattered elsewhere.

Each fact is read from torch itself, by the presence of a name on torch's
own module or class, never by its version string, except where a rule
changed with no name to see it by (fully_shard's reduce dtype, below).
Nothing is read when this module is imported: each fact is a function,
cached, since the torch of a process cannot change while it runs.

  fsdp_names()              public names of torch.distributed.fsdp
  fsdp_module_methods()     public methods of torch's FSDPModule
  mp_policy_fields()        MixedPrecisionPolicy's fields
  reduce_dtype_rule()       fully_shard's reduce dtype with reduce_dtype=None
  post_backward_accumulate_range()  whether torch opens that profiler range
  torch_has(where, name)    whether the installed torch has a name
  provided()                torch 2.15's names flatshard has with this torch
  pending()                 torch names flatshard does not provide yet
  flat_collectives()        torch.distributed's flat all-gather / reduce-scatter
  data_parallel_mesh_dims() torch's DataParallelMeshDims class, or None
  autograd_tls(), dispatch_stack()  torch._C's private helpers flatshard uses
  has_grad_dtype_override(p)        whether p.grad_dtype was set (torch 2.15)
  report()                  the rule and names, one line each (the doctor's)

Imports: torch only (a leaf, as errors.py is).
"""
import functools
import re

import torch

# ----------------------------------------------------------------------
# FSDP2 (fully_shard): the names torch's surface has


def _torch_fsdp():
    import torch.distributed.fsdp as tfsdp
    return tfsdp


@functools.cache
def fsdp_names():
    """Public names of torch.distributed.fsdp (its __all__)."""
    return frozenset(_torch_fsdp().__all__)


@functools.cache
def fsdp_module_methods():
    """Public methods and properties torch's FSDPModule defines itself."""
    cls = _torch_fsdp().FSDPModule
    return frozenset(n for n in vars(cls) if not n.startswith("_"))


@functools.cache
def mp_policy_fields():
    """MixedPrecisionPolicy's field names, in torch's order."""
    import dataclasses
    return tuple(f.name for f in dataclasses.fields(_torch_fsdp().MixedPrecisionPolicy))


# [Note: reduce dtype rule] fully_shard with MixedPrecisionPolicy(reduce_dtype=None):
#   "param_dtype"  torch <= 2.14: gradients are reduced (and accumulated without
#                  sync) in param_dtype, the compute dtype, when it is set;
#   "grad_dtype"   torch >= 2.15: they follow the parameter's grad_dtype (unset:
#                  the parameter's own dtype, so fp32 for fp32 parameters under
#                  param_dtype=bf16); param_dtype no longer decides.
# FSDP1's MixedPrecision is unchanged (reduce_dtype=None: param_dtype). The
# change has no new name of its own (Tensor.grad_dtype predates it; the code
# that follows it is private), so this one fact is read from the version.
# The rule itself is csrc/core/reduce_rule.c's (its [Note: reduce dtype
# rule]), which both APIs call through flatshard.tensors.reduce_dtype.
REDUCE_DTYPE_RULES = ("param_dtype", "grad_dtype")


def _release(version):
    """'2.15.0+cu132' or '2.16.0a0+git...' -> (2, 15): the release a build
    belongs to, pre-releases included."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@functools.cache
def reduce_dtype_rule():
    """fully_shard's reduce dtype when reduce_dtype is None ([Note: reduce
    dtype rule]): "param_dtype" or "grad_dtype"."""
    return "grad_dtype" if _release(torch.__version__) >= (2, 15) else "param_dtype"


@functools.cache
def post_backward_accumulate_range():
    """Whether torch's fully_shard opens "FSDP::post_backward_accumulate" in
    each post-backward: around FSDPParam.accumulate_unsharded_grad_if_needed
    up to 2.14; from 2.15, where autograd accumulates the unsharded gradients
    (in their grad_dtype), that method is gone and so is the range."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    return hasattr(FSDPParam, "accumulate_unsharded_grad_if_needed")


# ----------------------------------------------------------------------
# names flatshard provides only where the installed torch has them

# torch 2.15's FSDP2 additions, (where, name): flatshard has each exactly
# where the installed torch does (fsdp2/module.py, fsdp2/finalize.py and
# the exports read torch_has), so a script sees the surface of the torch it
# runs with; under torch 2.13 and 2.14 each is absent, as in torch (an
# AttributeError; MixedPrecisionPolicy is torch's own class, so its field
# comes and goes with torch).
VERSIONED = (
    ("torch.distributed.fsdp", "GradientReductionHandle"),
    ("FSDPModule", "finalize_backward"),
    ("FSDPModule", "set_manual_backward_finalization"),
    ("FSDPModule", "set_keep_unsharded_storage"),
    ("MixedPrecisionPolicy", "param_dtype_override_fn"),
)


def torch_has(where, name):
    """Whether the installed torch has `name` at `where`
    ("torch.distributed.fsdp", "FSDPModule", "MixedPrecisionPolicy", or
    "rule" with "reduce_dtype_rule=<rule>")."""
    if where == "torch.distributed.fsdp":
        return name in fsdp_names()
    if where == "FSDPModule":
        return name in fsdp_module_methods()
    if where == "MixedPrecisionPolicy":
        return name in mp_policy_fields()
    if where == "rule":
        return name == f"reduce_dtype_rule={reduce_dtype_rule()}"
    raise ValueError(f"unknown place {where!r}")


def provided():
    """VERSIONED's names that flatshard provides with the installed torch."""
    return [(where, name) for where, name in VERSIONED if torch_has(where, name)]


# ----------------------------------------------------------------------
# what flatshard does not provide yet

# What torch has and flatshard lacks, for now: (where, name). Each is
# reported by pending() where the installed torch has it, and by
# tests/test_public_names.py, which fails on any other name torch has and
# flatshard lacks, and on a name listed here that flatshard has come to
# provide (then drop it here). flatshard refuses what it cannot honour,
# never ignores it. "rule": a torch rule flatshard does not follow yet, as
# ("rule", "reduce_dtype_rule=<rule>"). None now, under torch 2.13 to 2.15:
# fully_shard follows reduce_dtype_rule() ([Note: reduce dtype rule]) and
# has torch 2.15's names (VERSIONED).
PENDING = ()


def pending():
    """PENDING's names that the installed torch has: what a script written
    for this torch may reach for and flatshard does not offer yet."""
    return [(where, name) for where, name in PENDING if torch_has(where, name)]


# ----------------------------------------------------------------------
# torch.distributed names that differ between versions


@functools.cache
def flat_collectives():
    """(all_gather, reduce_scatter) on flat tensors: torch 2.13 names them
    all_gather_single / reduce_scatter_single, earlier ones
    all_gather_into_tensor / reduce_scatter_tensor."""
    import torch.distributed as dist
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor,
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)


@functools.cache
def data_parallel_mesh_dims():
    """torch's DataParallelMeshDims (torch 2.13 on), or None."""
    return getattr(_torch_fsdp(), "DataParallelMeshDims", None)


# ----------------------------------------------------------------------
# torch internals flatshard reaches for (private; present in 2.13 and 2.15)


@functools.cache
def autograd_tls():
    """torch._C's thread-local object stash, as (has, get, remove, stash),
    or None where one is missing (then nothing is stashed to step around)."""
    names = ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls")
    fns = tuple(getattr(torch._C, n, None) for n in names)
    return fns if all(fns) else None


@functools.cache
def dispatch_stack():
    """torch._C's dispatch mode stack readers (length, item at), or None."""
    fns = (getattr(torch._C, "_len_torch_dispatch_stack", None),
           getattr(torch._C, "_get_dispatch_stack_at", None))
    return fns if all(fns) else None


def has_grad_dtype_override(param):
    """Whether param.grad_dtype was set by hand (torch 2.15's
    Tensor._has_grad_dtype_override, which fully_shard's grad_dtype rule
    reads); False where torch does not tell (2.13, whose fully_shard ignores
    grad_dtype)."""
    return bool(getattr(param, "_has_grad_dtype_override", False))


# ----------------------------------------------------------------------


def report():
    """The facts, one line each: what `python -m flatshard doctor` prints."""
    rule = reduce_dtype_rule()
    why = {"param_dtype": "param_dtype when set", "grad_dtype": "the parameter's grad_dtype: "
           "fp32 for fp32 parameters under param_dtype=bf16"}
    missing = pending()
    have = provided()
    ours = "param_dtype" if ("rule", f"reduce_dtype_rule={rule}") in missing else rule
    names = [n if w == "torch.distributed.fsdp" else f"{w}.{n}" for w, n in missing
             if w != "rule"]
    return [
        f"torch {torch.__version__}: fully_shard with reduce_dtype=None reduces in {why[rule]} "
        f"(rule {rule!r}); flatshard's fully_shard follows {ours!r}" +
        ("" if ours == rule else " (the torch rule is not built yet)") +
        "; FSDP1's MixedPrecision: param_dtype under every torch",
        f"torch's FSDP2: MixedPrecisionPolicy fields {', '.join(mp_policy_fields())}; "
        f"FSDPModule methods: {len(fsdp_module_methods())}",
        "torch names flatshard does not provide yet: " + (", ".join(names) or "none"),
        "torch 2.15's FSDP2 names, present as in this torch: " + ", ".join(
            (n if w == "torch.distributed.fsdp" else f"{w}.{n}") +
            (" (present)" if (w, n) in have else " (absent)") for w, n in VERSIONED),
    ]
