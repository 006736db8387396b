"""What torch's debugging tools see of the collectives flatshard issues itself.

The shm and NCCL backends run their collectives in C, below c10d: a
torch.profiler trace shows no FSDP region around them, and torch's
CommDebugMode (a TorchDispatchMode that counts the c10d ops dispatched while
it is active) counts none. Two helpers make them visible as with torch's
fully_shard:

  span(*parts)      torch's record_function range named "".join(parts)
                    while a profiler runs (the name is built only then).
                    Otherwise a shared no-op context after one check: the
                    hooks that open ranges are on the hot path.
  issued(read, obj, comm)
                    a context that adds to the active CommDebugMode what an
                    engine object issued inside it (read(obj): how many of
                    each kind so far, in KINDS' order), under the op torch's
                    own collective dispatches (c10d._allgather_base_, ...),
                    in its totals and in its per-module table. Without a
                    CommDebugMode: the shared no-op context after one check.
  counted_span(read, obj, comm, *parts)
                    both around one engine call that issues collectives,
                    after a single check while nothing watches.

The torch backend issues its collectives through c10d already (comm.py's
_torch_collective), where CommDebugMode counts them: a Comm of that backend
is not counted again here (counts_itself).

Imports: torch only (its private parts guarded, torch 2.11 to 2.13); nothing
of fsdp/ or fsdp2/.
"""
import contextlib
from collections import defaultdict

import torch
from torch.profiler import record_function

from .. import torch_facts

# The profiler's own cheap test (what record_function's callers check too).
profiling = torch._C._autograd._profiler_enabled

# What an engine object's read() returns, in this order.
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# The c10d op each kind dispatches when torch's fully_shard issues it on a
# process group (all_gather_single/all_gather_into_tensor,
# reduce_scatter_single/reduce_scatter_tensor, all_reduce): the keys of
# CommDebugMode.get_comm_counts().
_C10D_OPS = {"all_gather": "_allgather_base_", "reduce_scatter": "_reduce_scatter_base_",
             "all_reduce": "allreduce_"}


class _Nothing:
    """The context used when there is nothing to record (shared, stateless)."""
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


NOTHING = _Nothing()


def span(*parts):
    """record_function("".join(parts)) while a profiler runs; NOTHING
    otherwise."""
    if not profiling():
        return NOTHING
    return record_function("".join(parts))


# ----------------------------------------------------------------------
# CommDebugMode

def _comm_debug_mode_class():
    try:
        from torch.distributed.tensor.debug import CommDebugMode
    except ImportError:  # a build of torch without distributed
        return None
    return CommDebugMode


_stack_len, _stack_at = torch_facts.dispatch_stack() or (None, None)
_MODE_CLASS = []  # [CommDebugMode or None], found at the first use


def comm_debug_mode():
    """The innermost CommDebugMode on this thread's dispatch mode stack, or
    None. One check when the stack is empty (no mode of any kind)."""
    if _stack_len is None or _stack_at is None or not _stack_len():
        return None
    if not _MODE_CLASS:
        _MODE_CLASS.append(_comm_debug_mode_class())
    cls = _MODE_CLASS[0]
    if cls is None:
        return None
    for i in reversed(range(_stack_len())):
        mode = _stack_at(i)
        if isinstance(mode, cls):
            return mode
    return None


def counts_itself(comm):
    """Whether the Comm's collectives reach c10d (the torch backend), where
    CommDebugMode counts them without help."""
    return comm.backend == "torch"


def add_counts(mode, kind, n):
    """Count n collectives of `kind` in CommDebugMode `mode`, as its own
    __torch_dispatch__ does for a c10d op: in comm_counts, and in
    comm_module_counts for the module its tracker is in (forward or
    backward) and that module's parents. The per-module part is skipped
    when the mode has no such tracker (another torch version)."""
    if n <= 0:
        return
    op = getattr(torch.ops.c10d, _C10D_OPS[kind])
    mode.comm_counts[op] += n
    tracker = getattr(mode, "advanced_module_tracker", None)
    table = getattr(mode, "comm_module_counts", None)
    if tracker is None or table is None:
        return
    name = tracker.name
    where = "backward" if tracker.is_bw else "forward"
    parents = getattr(tracker, "module_parents_dict", {}).get(name, ())
    for module in {name, *parents}:
        per = table.setdefault(module, {"forward": defaultdict(int),
                                        "backward": defaultdict(int)})
        per[where][op] += n


class _Issued:
    __slots__ = ("mode", "read", "obj", "before")

    def __init__(self, mode, read, obj):
        self.mode, self.read, self.obj = mode, read, obj

    def __enter__(self):
        self.before = self.read(self.obj)

    def __exit__(self, *exc):
        after = self.read(self.obj)
        for kind, b, a in zip(KINDS, self.before, after):
            add_counts(self.mode, kind, a - b)
        return False


# the number of dispatch modes active (0 where torch has no probe)
dispatch_depth = _stack_len if _stack_len is not None else (lambda: 0)


def watching():
    """Whether span() or issued() could record anything now: a profiler
    runs, or a dispatch mode (a CommDebugMode among them) is active. (The
    events' lean checks test the two builtins directly, with no frame.)"""
    return profiling() or dispatch_depth() > 0


@contextlib.contextmanager
def _counted(read, obj, comm, parts):
    with span(*parts), issued(read, obj, comm):
        yield


def counted_span(read, obj, comm, *parts):
    """span(*parts) around issued(read, obj, comm), as one context: the
    shared no-op one after a single check while nothing watches (the
    engine calls of every hook)."""
    return _counted(read, obj, comm, parts) if watching() else NOTHING


def issued(read, obj, comm):
    """A context that counts, in the active CommDebugMode, the collectives
    `obj` issues inside it (read(obj): a tuple of counts in KINDS' order,
    each only growing); NOTHING when no CommDebugMode is active or `comm`
    counts itself. A collective that failed is not counted (the engine
    counts only those that completed)."""
    if _stack_len is None or not _stack_len():
        return NOTHING
    mode = comm_debug_mode()
    if mode is None or counts_itself(comm):
        return NOTHING
    return _Issued(mode, read, obj)
