"""One engine call per hook event: the adapters (the FSDP1 wrapper's unit
runtime, fully_shard's groups) connect torch's hooks to the C engine
(csrc/engine/) and call it once for each event, counted here by wrapping each
unit's `_C` object in a proxy that records every method call."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from flatshard import FSDP, ModuleWrapPolicy, fully_shard


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


class Net(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Counting:
    """Forwards everything to the engine object; records each method call."""

    def __init__(self, inner, log):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            self._log.append(name)
            return value(*map(_inner, args), **kwargs)
        return call

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


def _inner(arg):
    """Engine objects inside an argument passed on as themselves."""
    if isinstance(arg, Counting):
        return arg._inner
    if type(arg) is tuple:
        return tuple(map(_inner, arg))
    return arg


def _fsdp1_calls(strategy, bucket_bytes):
    import os
    from flatshard import ShardingStrategy
    torch.manual_seed(0)
    model = FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 sharding_strategy=ShardingStrategy[strategy])
    x = torch.randn(4, 6)
    # a reduction bucket (on shm none by default), read at the root's lazy init
    os.environ["FLATSHARD_REDUCE_BUCKET_BYTES"] = bucket_bytes
    try:
        model(x).sum().backward()  # lazy init, first step
    finally:
        del os.environ["FLATSHARD_REDUCE_BUCKET_BYTES"]
    logs, counts = {}, {}
    for m in model.modules():
        unit = getattr(m, "_unit", None)
        if unit is not None and not isinstance(unit.c, Counting):
            logs[unit.name] = []
            counts[unit.name] = dict(unit.c.counts)
            unit.c = Counting(unit.c, logs[unit.name])
    for p in model.parameters():
        p.grad = None
    model(x).sum().backward()
    steps = {}
    for m in model.modules():
        unit = getattr(m, "_unit", None)
        if unit is not None:
            now, before = unit.c._inner.counts, counts[unit.name]
            steps[unit.name] = {k: now[k] - before[k] for k in ("all_gather", "reduce")}
    return logs, steps


# The gathers a block makes in one step: in forward and again in backward
# (FULL_SHARD), in forward only (SHARD_GRAD_OP keeps it for backward), none
# (SHARD_OPTIM keeps the whole parameters).
_GATHERS = {"FULL_SHARD": 2, "SHARD_GRAD_OP": 1, "SHARD_OPTIM": 0}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM"])
def test_fsdp1_one_engine_call_per_hook_event(dist_pool, strategy):
    """A 1 MiB reduction bucket, so each post-backward is Python's (the
    plain one has no bucket): pre_forward, post_forward, post_backward (one
    per gradient group: the blocks have one, the root none of its own) and
    finalize are each one event() call through Python, and released() after
    a reshard. The pre-backward takes the engine unit's plain path
    ([Note: unit plain events] in csrc/hooks/unit_events.c): no call
    through Python, and its gather (and the BACKWARD_PRE prefetch of the
    unit before) shows in the engine's counts."""
    for logs, steps in dist_pool(2).run(_fsdp1_calls, strategy, str(1 << 20)):
        assert len(logs) == 4  # three blocks and the root
        for name, calls in logs.items():
            assert calls.count("event") == (3 if name == "<root>" else 4), (name, calls)
            others = [c for c in calls if c not in ("event", "flush_bucket", "released")]
            assert others == [], (name, calls)
            if name != "<root>":
                assert steps[name] == {"all_gather": _GATHERS[strategy], "reduce": 1}, \
                    (name, steps)
        # the reduction bucket holds the three blocks' reduce-scatters
        # until the end of backward: one flush, through the first (the last
        # block's); SHARD_OPTIM all-reduces whole gradients at once
        flushes = [name for name, calls in logs.items() for c in calls if c == "flush_bucket"]
        assert flushes == ([] if strategy == "SHARD_OPTIM" else ["blocks.2"]), logs


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp1_plain_backward_calls_no_python(dist_pool, strategy):
    """No bucket (shm's default): both backward events of every unit take
    the engine unit's plain path, so nothing reaches the engine through
    Python after the forward, and the engine counts each block's gathers
    and its one reduction."""
    for logs, steps in dist_pool(2).run(_fsdp1_calls, strategy, "0"):
        for name, calls in logs.items():
            assert calls == ["event", "event", "event"], (name, calls)  # forward, finalize
            if name != "<root>":
                assert steps[name] == {"all_gather": _GATHERS[strategy], "reduce": 1}, \
                    (name, steps)


def _sharded_net():
    """Net with fully_shard on each block and the root, and an input."""
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.randn(4, 6)


def _fully_shard_calls(bucket_bytes):
    import os
    os.environ["FLATSHARD_REDUCE_BUCKET_BYTES"] = bucket_bytes  # read at the root's lazy init
    model, x = _sharded_net()
    try:
        model(x).sum().backward()
    finally:
        del os.environ["FLATSHARD_REDUCE_BUCKET_BYTES"]
    logs, counts = {}, {}
    for m in model.modules():
        st = m._fsdp_state() if hasattr(m, "_fsdp_state") else None
        if st is not None and st.group is not None:
            logs[id(st.group)] = log = []
            counts[id(st.group)] = before = dict(st.group.c.counts)
            st.group.c = Counting(st.group.c, log)
    for p in model.parameters():
        p.grad = None
    model(x).sum().backward()
    steps = {}
    for m in model.modules():
        st = m._fsdp_state() if hasattr(m, "_fsdp_state") else None
        if st is not None and st.group is not None:
            now, before = st.group.c._inner.counts, counts[id(st.group)]
            steps[id(st.group)] = {k: now[k] - before[k] for k in ("all_gather", "reduce")}
    return [(logs[k], steps[k]) for k in logs]


# The same object's registration of the parameters on the modules (C over
# torch objects, not engine: csrc/hooks/params.h), one call each where an
# event swaps them.
REGISTRATION = {"registration_changed", "register_unsharded", "register_sharded",
                "set_unsharded", "take_unhooked", "set_params"}


def _engine(calls):
    return [c for c in calls if c not in REGISTRATION]


def test_fully_shard_engine_calls_per_hook_event(dist_pool):
    """Every event of the blocks takes its plain path in C ([Note: plain
    events] in csrc/hooks/shard_events.c): torch calls the _C.Event and
    _C.Arrival hooks, which call the engine group directly, so no call of
    the group's reaches it through Python (the proxy records none); the
    engine counts one all-gather for the pre-forward, one for the
    pre-backward and one reduction (resharding in the same call)."""
    for logs in dist_pool(2).run(_fully_shard_calls, "0"):
        assert len(logs) == 3  # the root holds no parameters of its own
        for calls, step in logs:
            assert calls == [], calls
            assert step == {"all_gather": 2, "reduce": 1}, step


def test_fully_shard_engine_calls_with_a_reduction_bucket(dist_pool):
    """A 1 MiB bucket: each post_backward's reduce joins it, and the end
    of backward flushes all three groups' in one call, through the group
    whose gradients came first (the last block's). The gathers and frees
    stay plain (in C); the post-backward is Python's: the arrivals' C
    finds the plain one does not apply and calls it, and Python does not
    ask again (no post_backward() call of its own)."""
    for logs in dist_pool(2).run(_fully_shard_calls, str(1 << 20)):
        flushes = [calls for calls, _ in logs if "flush_bucket" in calls]
        assert len(flushes) == 1, logs
        for calls, step in logs:
            assert "post_backward" not in calls, calls
            rest = [c for c in _engine(calls) if c != "flush_bucket"]
            # after the flush, each group's new gradients set (finish_reduce)
            assert rest == ["reduce_grads", "finish_reduce"], calls
            assert step == {"all_gather": 2, "reduce": 1}, (calls, step)
        assert flushes[0][-2:] == ["flush_bucket", "finish_reduce"] and \
            flushes[0] is logs[-1][0], logs


def _python_frames_of_blocks():
    """Python frames of flatshard's own code during step 1 whose `self` is
    a block's FSDPState or its ParamGroup (the root's run in Python)."""
    import sys
    from flatshard.fsdp2.param import ParamGroup
    from flatshard.fsdp2.state import FSDPState
    model, x = _sharded_net()
    model(x).sum().backward()
    blocks = {id(b._fsdp_state()) for b in model.blocks}
    blocks |= {id(b._fsdp_state().group) for b in model.blocks}
    seen, root_calls = [], []

    def profile(frame, event, arg):
        if event != "call" or "flatshard" not in frame.f_code.co_filename:
            return
        me = frame.f_locals.get("self")
        if isinstance(me, (FSDPState, ParamGroup)):
            (seen if id(me) in blocks else root_calls).append(frame.f_code.co_name)
    sys.setprofile(profile)
    try:
        model(x).sum().backward()
    finally:
        sys.setprofile(None)
    return seen, root_calls


def test_fully_shard_plain_events_run_no_python_frame(dist_pool):
    """After step 0 every event of the blocks (pre-forward, post-forward,
    pre-backward, each gradient's arrival and the post-backward, the end of
    backward) runs without a Python frame of their states or groups: each
    event's sequence is C's ([Note: event sequences] in
    csrc/hooks/shard_events.c). The root's own events call their Python
    steps (its lazy init, the forward's start and end, the end of
    backward), which the probe sees, so it is not blind."""
    for seen, root_calls in dist_pool(2).run(_python_frames_of_blocks):
        assert seen == [], seen
        assert {"_begin_forward", "_end_forward", "_finalize"} <= set(root_calls), root_calls


def _fsdp1_python_frames():
    """Names of the Python frames whose `self` is an FSDP1 unit runtime
    during step 1 (shm, no bucket: the default)."""
    import sys
    from flatshard.fsdp.unit import UnitRuntime
    torch.manual_seed(0)
    model = FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    x = torch.randn(4, 6)
    model(x).sum().backward()
    seen = []

    def profile(frame, event, arg):
        if event == "call" and isinstance(frame.f_locals.get("self"), UnitRuntime):
            seen.append(frame.f_code.co_name)
    sys.setprofile(profile)
    try:
        model(x).sum().backward()
    finally:
        sys.setprofile(None)
    return seen


def test_fsdp1_plain_backward_runs_no_python_frame(dist_pool):
    """After step 0 the units' pre-backward and post-backward run without a
    Python frame of theirs: their one plain implementation is C ([Note:
    unit plain events] in csrc/hooks/unit_events.c). The forward's events
    and the end of backward are Python's, which the probe sees."""
    for seen in dist_pool(2).run(_fsdp1_python_frames):
        assert "_pre_backward" not in seen and "_post_backward" not in seen, seen
        assert "pre_forward" in seen and "finalize" in seen, seen
