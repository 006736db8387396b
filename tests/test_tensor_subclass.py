"""A tensor subclass reaching flatshard is refused with an error naming it,
on every entry point, instead of its (null or foreign) data pointer
reaching the C core. Ranks run in the pool, so a crash fails the test
instead of killing pytest; the C core's own null-pointer guard is checked
directly."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.two_tensor import TwoTensor

import flatshard
from flatshard import _C, FSDP, NotBuiltError, ShardingStrategy, fully_shard

TIMEOUT = 240


class Storageful(torch.Tensor):
    """A plain-Python subclass over a real storage: its data pointer is valid,
    but flatshard cannot know the subclass's meaning of the data."""


def _model(kind, where="param"):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    w = m[0].weight.detach().clone()
    if kind == "two":
        sub = TwoTensor(w, w.clone())
    else:
        sub = w.as_subclass(Storageful)
    if where == "param":
        m[0].weight = nn.Parameter(sub)
    else:
        m[0].register_buffer("scale", sub)
    return m


def _wrap(api, kind, where="param"):
    """-> the message of the error raised on this rank (None: no error)."""
    m = _model(kind, where)
    try:
        if api == "fully_shard":
            fully_shard(m[0])
            fully_shard(m)
        elif api.startswith("FSDP"):
            strategy = api.split(":")[1]
            m = FSDP(m, device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy[strategy],
                     sync_module_states=where == "buffer")
        m(torch.randn(2, 4)).sum().backward()
    except NotBuiltError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["two", "storageful"])
@pytest.mark.parametrize("api", ["fully_shard", "FSDP:FULL_SHARD", "FSDP:SHARD_GRAD_OP",
                                 "FSDP:NO_SHARD", "FSDP:SHARD_OPTIM"])
def test_subclass_parameter_is_refused_by_name(dist_pool, api, kind):
    msgs = dist_pool(2).run(_wrap, api, kind, timeout=TIMEOUT)
    for msg in msgs:
        assert msg is not None, f"{api} accepted a {kind} tensor-subclass parameter"
        assert "0.weight" in msg or "parameter weight" in msg
        assert "subclass" in msg
        assert ("fully_shard" if api == "fully_shard" else "FullyShardedDataParallel") in msg


def test_subclass_buffer_broadcast_is_refused_by_name(dist_pool):
    msgs = dist_pool(2).run(_wrap, "FSDP:FULL_SHARD", "two", "buffer", timeout=TIMEOUT)
    for msg in msgs:
        assert msg is not None and "buffer 0.scale" in msg and "sync_module_states" in msg


def test_plain_parameters_still_train(dist_pool):
    ref = _plain_loss("reference")
    for api in ("fully_shard", "FSDP"):
        for loss in dist_pool(2).run(_plain_loss, api, timeout=TIMEOUT):
            assert abs(loss - ref) < 1e-6, (api, loss, ref)


def _plain_loss(api):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    if api == "fully_shard":
        fully_shard(m[0])
        fully_shard(m)
    elif api == "FSDP":
        m = FSDP(m, device_id=torch.device("cpu"))
    x = torch.arange(8.0).reshape(2, 4) / 8
    return m(x).square().sum().item()


@pytest.mark.parametrize("call,args", [
    ("cast", lambda: (0, _C.F32, 0, _C.F32, 10)),
    ("scale_accumulate", lambda: (0, _C.F32, 0, _C.F32, 10, 1.0, True)),
    ("gather_pieces", lambda: (0, _C.F32, 8, [])),
    ("gather_pieces", lambda: (torch.zeros(8).data_ptr(), _C.F32, 8, [(0, _C.F32, 0, 0, 4)])),
    ("dim0_copy_in", lambda: (0, _C.F32, 0, _C.F32, (4, 4, 2, 2, 0, 2))),
    ("dim0_copy_out", lambda: (0, _C.F32, 0, _C.F32, 2, 8, (4, 4, 2, 2, 0, 2))),
    ("reduce_sum", lambda: (0, _C.F32, [0], 4, 1.0)),
    ("norm_partial", lambda: ([(0, _C.F32, 5)], False)),
])
def test_core_refuses_null_data_pointers(call, args):
    """What a wrapper subclass's data_ptr() gives (0) is an error in C, not a
    write through a null or null-plus-offset pointer."""
    assert TwoTensor(torch.ones(2), torch.ones(2)).data_ptr() == 0
    with pytest.raises(_C.CoreError, match="invalid argument"):
        getattr(_C, call)(*args())


def test_zero_length_null_pointers_stay_legal():
    _C.cast(0, _C.F32, 0, _C.F32, 0)
    _C.gather_pieces(0, _C.F32, 0, [])


def _comm_calls(backend):
    """Each collective of flatshard.runtime.comm handed a subclass tensor: the error
    message of each, by call."""
    from flatshard.runtime import comm
    c = comm.comm_for(dist.group.WORLD, backend)
    sub = TwoTensor(torch.ones(4), torch.ones(4))
    plain = torch.zeros(8)
    calls = {
        "broadcast_": lambda: comm.broadcast_(c, sub),
        "all_reduce_": lambda: comm.all_reduce_(c, sub),
        "all_gather_into": lambda: comm.all_gather_into(c, plain, sub),
        "reduce_scatter_into": lambda: comm.reduce_scatter_into(c, sub, plain),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except NotBuiltError as e:
            out[name] = str(e)
    comm.all_reduce_(c, plain)  # the Comm is still in step on every rank
    return out


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_collectives_refuse_subclass_tensors(dist_pool, backend):
    for out in dist_pool(2).run(_comm_calls, backend, timeout=TIMEOUT):
        for name, msg in out.items():
            assert msg is not None and "subclass" in msg and "TwoTensor" in msg, (name, msg)


@pytest.mark.parametrize("opt", ["AdamW", "Adam", "SGD"])
def test_fused_optimizers_refuse_subclass_parameters(opt):
    from flatshard import optim
    p = nn.Parameter(TwoTensor(torch.ones(4), torch.ones(4)))
    p.grad = TwoTensor(torch.ones(4), torch.ones(4))
    o = getattr(optim, opt)([p], lr=0.1)
    with pytest.raises(NotBuiltError, match=r"group 0 parameter 0 is a .*TwoTensor"):
        o.step()


def test_fused_step_function_refuses_subclass_buffers():
    from flatshard import optim
    plain = [torch.zeros(4) for _ in range(4)]
    sub = TwoTensor(torch.ones(4), torch.ones(4))
    for i in range(4):
        args = list(plain)
        args[i] = sub
        with pytest.raises(NotBuiltError, match="subclass"):
            optim.adamw_step_(*args, 1, lr=0.1)
