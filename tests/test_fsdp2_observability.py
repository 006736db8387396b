"""What torch's debugging tools see of flatshard's fully_shard, compared with
torch's own fully_shard in the same run (2 ranks; torch on gloo, flatshard on
its default shm backend and on its torch backend):

  CommDebugMode counts the same all-gathers and reduce-scatters for one
  forward and backward (totals, forward and backward, and per module where
  both gather at the same point), with reshard_after_forward True and False;
  a torch.profiler trace of one step holds torch's "FSDP::" ranges;
  without a profiler no range is opened, and without a CommDebugMode nothing
  is counted (runtime/observe.py's one check)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.profiler import ProfilerActivity, profile

from flatshard import fully_shard
from flatshard.runtime import observe
from test_fully_shard_torch_flows import Net as FlowsNet

TIMEOUT = 240
BOTH = (("torch", torch_fully_shard), ("ours", fully_shard))


@pytest.fixture(scope="module", autouse=True)
def _fresh_ranks_after(dist_pool):
    """A backward under CommDebugMode leaves its sharded model alive in the
    ranks, torch's fully_shard's as flatshard's (gc.collect does not free it;
    a plain module's is freed), and a later test that counts live modules
    would find them: tests/test_torch_switch.py, whose use_for_torch_fsdp()
    refuses while a module torch sharded is alive. So the ranks this file
    used are shut down after it, and the next test starts fresh ones."""
    yield
    dist_pool(2).shutdown()


class Net(FlowsNet):
    """The flows' net with three blocks."""

    def __init__(self, d=7):
        super().__init__(d, depth=3)


def _model(fn, prefetch=False, **kw):
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        fn(b, **kw)
    fn(model, **kw)
    if prefetch:  # explicit lists: both prefetch the same modules
        blocks = list(model.blocks)
        for i, b in enumerate(blocks):
            b.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
            b.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])
        model.set_modules_to_backward_prefetch(blocks[-1:])
    return model


def _step(model, opt):
    g = torch.Generator().manual_seed(11 + dist.get_rank())
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def _opt(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# ----------------------------------------------------------------------
# CommDebugMode


def _plain(counts):
    return {str(op): n for op, n in counts.items() if n}


def _comm_counts(raf, backend, prefetch, bucket="0"):
    """Per implementation: CommDebugMode's counts of one step after a first
    one, and its per-module forward/backward counts. bucket: flatshard's
    FLATSHARD_REDUCE_BUCKET_BYTES (0: none, each group reduces on its own
    as torch's do). No module is gathered ahead (FLATSHARD_GATHER_AHEAD_BYTES
    0; test_coalesced_collectives.py): each gathers as torch's do."""
    out = {}
    saved = os.environ.get("FLATSHARD_COMM_BACKEND")
    os.environ["FLATSHARD_COMM_BACKEND"] = backend
    os.environ["FLATSHARD_REDUCE_BUCKET_BYTES"] = bucket
    os.environ["FLATSHARD_GATHER_AHEAD_BYTES"] = "0"
    try:
        for name, fn in BOTH:
            model = _model(fn, prefetch, reshard_after_forward=raf)
            opt = _opt(model)
            _step(model, opt)
            with CommDebugMode() as mode:
                _step(model, opt)
            ag = mode.get_comm_counts()[torch.ops.c10d._allgather_base_]
            rs = mode.get_comm_counts()[torch.ops.c10d._reduce_scatter_base_]
            modules = {m: {k: _plain(v) for k, v in per.items()}
                       for m, per in mode.comm_module_counts.items()}
            out[name] = (ag, rs, _plain(mode.get_comm_counts()), mode.get_total_counts(),
                         modules)
    finally:
        del os.environ["FLATSHARD_REDUCE_BUCKET_BYTES"]
        del os.environ["FLATSHARD_GATHER_AHEAD_BYTES"]
        if saved is None:
            os.environ.pop("FLATSHARD_COMM_BACKEND")
        else:
            os.environ["FLATSHARD_COMM_BACKEND"] = saved
    return out


@pytest.mark.parametrize("prefetch", [False, True], ids=["implicit", "explicit-prefetch"])
@pytest.mark.parametrize("backend", ["shm", "torch"])
@pytest.mark.parametrize("raf", [True, False])
def test_comm_debug_mode_counts_as_for_torch(dist_pool, raf, backend, prefetch):
    """shm: counted by flatshard; torch: counted by CommDebugMode itself as
    the backend's c10d calls are dispatched (and not counted twice)."""
    for out in dist_pool(2).run(_comm_counts, raf, backend, prefetch, timeout=TIMEOUT):
        ours, theirs = out["ours"], out["torch"]
        assert theirs[0] > 0 and theirs[1] > 0, theirs
        # 4 groups (3 blocks, the root): one reduce-scatter each; one
        # all-gather each in forward, and again in backward if resharded
        assert theirs[:2] == ((8, 4) if raf else (4, 4)), theirs
        if backend == "torch" and prefetch:
            # a block's own gather and the prefetch of the next one go in one
            # all-gather on the host (block 0's in forward, block 2's in
            # backward): CommDebugMode sees the collectives issued
            assert ours[:2] == ((6, 4) if raf else (3, 4)), out
            continue
        assert ours[:4] == theirs[:4], out
        assert ours[4]["Global"] == theirs[4]["Global"], out
        if prefetch:
            assert ours[4] == theirs[4], out
        else:
            # torch's default backward prefetch gathers a block in the
            # backward of the module after it, where CommDebugMode's module
            # tracker counts it; flatshard gathers each at its own
            # pre-backward (no implicit prefetch on the host)
            moved = {"FSDPNet.blocks.0", "FSDPNet.blocks.1"} if raf else set()
            assert {m: c for m, c in ours[4].items() if m not in moved} == \
                {m: c for m, c in theirs[4].items() if m not in moved}, out


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_comm_debug_mode_counts_with_a_reduction_bucket(dist_pool, backend):
    """The default bucket holds all four groups' reductions: through the torch
    backend CommDebugMode sees the one reduce-scatter that is issued; on shm
    flatshard counts each group's reduction, as torch's fully_shard issues
    them. The all-gathers are not bucketed."""
    for out in dist_pool(2).run(_comm_counts, True, backend, False, str(1 << 20),
                                timeout=TIMEOUT):
        ours, theirs = out["ours"], out["torch"]
        assert theirs[:2] == (8, 4), theirs
        assert ours[:2] == ((8, 1) if backend == "torch" else (8, 4)), out


# ----------------------------------------------------------------------
# torch.profiler

# On the host flatshard's all-gather does its copy-out in the same engine
# call, inside "FSDP::all_gather": "FSDP::all_gather_copy_out" is opened only
# for a deferred gather (a device's prefetch or async_op). Host collectives
# are synchronous, so flatshard prefetches on the host only what the user
# listed (set_modules_to_*_prefetch); torch's default backward prefetch
# ("FSDP::backward_prefetch for ...") has no counterpart there.
HOST_ONLY_TORCH = ("FSDP::all_gather_copy_out", "FSDP::backward_prefetch for ")


def _fsdp_names(prof):
    return {e.name for e in prof.events() if e.name.startswith("FSDP::")}


def _profiled(prefetch):
    out = {}
    for name, fn in BOTH:
        model = _model(fn, prefetch=prefetch)
        opt = _opt(model)
        _step(model, opt)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(model, opt)
        out[name] = _fsdp_names(prof)
    return out


@pytest.mark.parametrize("prefetch", [False, True], ids=["implicit", "explicit-prefetch"])
def test_profiler_trace_has_torchs_fsdp_ranges(dist_pool, prefetch):
    for out in dist_pool(2).run(_profiled, prefetch, timeout=TIMEOUT):
        ours, theirs = out["ours"], out["torch"]
        assert {"FSDP::root_pre_forward", "FSDP::pre_forward (blocks.0)",
                "FSDP::all_gather (blocks.2)", "FSDP::post_backward_reduce",
                "FSDP::root_post_backward_callback"} <= theirs, theirs
        missing = {n for n in theirs - ours if not n.startswith(HOST_ONLY_TORCH)}
        assert not missing, (missing, ours, theirs)
        assert ours <= theirs, (ours - theirs, theirs)
        if prefetch:
            assert "FSDP::backward_prefetch for blocks.0" in ours, ours
            assert "FSDP::forward_prefetch for blocks.2" in ours, ours


# ----------------------------------------------------------------------
# nothing when nothing looks


class _Counting:
    """Stands in for record_function: counts the ranges opened."""

    def __init__(self, real):
        self.real, self.names = real, []

    def __call__(self, name):
        self.names.append(name)
        return self.real(name)


def _idle_hooks():
    """A step without profiler nor CommDebugMode opens no range and reads no
    engine counter; the same step under a profiler opens them."""
    model = _model(fully_shard)
    opt = _opt(model)
    _step(model, opt)
    counting = _Counting(observe.record_function)
    reads = []
    real_issued = observe._Issued.__init__

    def spy(self, *args):
        reads.append(args)
        real_issued(self, *args)

    observe.record_function, observe._Issued.__init__ = counting, spy
    try:
        _step(model, opt)
        idle = (len(counting.names), len(reads))
        with profile(activities=[ProfilerActivity.CPU]):
            _step(model, opt)
        profiled = len(counting.names)
        with CommDebugMode():
            _step(model, opt)
        counted = len(reads)
    finally:
        observe.record_function, observe._Issued.__init__ = counting.real, real_issued
    return idle, profiled, counted


def test_no_profiler_no_ranges_no_mode_no_counting(dist_pool):
    for idle, profiled, counted in dist_pool(2).run(_idle_hooks, timeout=TIMEOUT):
        assert idle == (0, 0)
        assert profiled > 0
        assert counted == 4 + 3 + 4  # gathers in forward and backward, reductions


def test_one_check_when_nothing_looks():
    assert observe.span("FSDP::pre_forward", " (x)") is observe.NOTHING
    assert observe.issued(None, None, None) is observe.NOTHING
    assert observe.comm_debug_mode() is None
    with profile(activities=[ProfilerActivity.CPU]):
        assert observe.span("FSDP::pre_forward") is not observe.NOTHING
    with CommDebugMode() as mode:
        assert observe.comm_debug_mode() is mode
