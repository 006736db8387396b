"""torch's private state accessors on fully_shard modules
(fsdp2/torch_state.py), read the way frameworks and torch's own tests read
them, on flatshard's fully_shard and torch's in the same run (2 ranks):
fully_shard.state(module), FSDPModule._get_fsdp_state(), the state's
_fsdp_param_group (fsdp_params: sharded_param, unsharded_param, sizes;
mesh_info.mesh; post_backward() called by hand after a backward without
gradient sync, as torch's pipelining does), _is_root and
_state_ctx.all_states."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from flatshard import fully_shard

TIMEOUT = 240


def _net():
    torch.manual_seed(0)
    # 7 rows: uneven shards (4 and 3); the ReLU is a module without parameters
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.Linear(7, 3))


def _shard(fn):
    m = _net()
    fn(m[0])
    fn(m[1])  # no parameters of its own: no group
    fn(m[2])
    return fn(m)


def _describe(fn):
    """What the accessors show, as plain data, before and after a step whose
    reduction is run by hand through post_backward()."""
    m = _shard(fn)
    mods = [m[0], m[1], m[2], m]
    out = {"state_is_get": [fn.state(x) is x._get_fsdp_state() for x in mods],
           "state_of_plain": fn.state(nn.Linear(2, 2)) is None,
           "is_root_before": [fn.state(x)._is_root for x in mods]}
    params = {}
    for k, x in enumerate(mods):
        g = fn.state(x)._fsdp_param_group
        if g is None:
            params[k] = None
            continue
        registered = list(x.parameters(recurse=False)) if x is not m else \
            list(m[3].parameters())
        params[k] = {
            "same_objects": [p.sharded_param is q for p, q in zip(g.fsdp_params, registered)],
            "sizes": [(tuple(p.sharded_size), tuple(p.padded_sharded_param_size))
                      for p in g.fsdp_params],
            "mesh": g.mesh_info.mesh.size(),
            "groups": len(fn.state(x)._fsdp_param_groups),
        }
    out["params"] = params
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    m.set_requires_gradient_sync(False)
    m(torch.randn(4, 5, generator=g)).square().mean().backward()
    out["grads_before"] = [p.grad is None for p in m.parameters()]
    out["is_root_after"] = [fn.state(x)._is_root for x in mods]
    states = fn.state(m)._state_ctx.all_states
    out["all_states"] = [any(s is fn.state(x) for s in states) for x in mods]
    out["root_first"] = states[0] is fn.state(m)
    m.set_requires_gradient_sync(True)
    for s in states:
        if s._fsdp_param_group is not None:
            s._fsdp_param_group.post_backward()
    out["grads"] = [p.grad._local_tensor.clone() for p in m.parameters()]
    out["unsharded_kept"] = [p.unsharded_param is not None
                             for p in fn.state(m[0])._fsdp_param_group.fsdp_params]
    return out


def _both():
    return _describe(fully_shard), _describe(torch_fully_shard)


def test_private_state_accessors_read_as_torch(dist_pool):
    for ours, theirs in dist_pool(2).run(_both, timeout=TIMEOUT):
        grads, tgrads = ours.pop("grads"), theirs.pop("grads")
        assert ours == theirs
        assert ours["state_is_get"] == [True] * 4 and ours["params"][1] is None
        for k in (0, 2, 3):
            assert ours["params"][k]["same_objects"] == [True, True]
            assert ours["params"][k]["groups"] == 1
        assert ours["all_states"] == [True] * 4 and ours["root_first"]
        assert ours["is_root_before"] == [None] * 4
        assert ours["is_root_after"] == [False, False, False, True]
        assert ours["grads_before"] == [True] * 6  # nothing reduced without sync
        for a, b in zip(grads, tgrads):
            assert torch.equal(a, b)
