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
from toy_models import MLP

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


# ----------------------------------------------------------------------
# the group's _module_fqn and is_unsharded, each parameter's _module_info
# and _param_fqn (torch's test_fully_shard_module_and_param_fqns reads them)




class _Tied(nn.Module):
    """A parameter registered twice (b.weight is a.weight) and a module
    registered twice (c is a)."""

    def __init__(self, d=8):
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, d, bias=False)
        self.b.weight = self.a.weight
        self.c = self.a

    def forward(self, x):
        return self.b(self.a(x)) + self.c(x)


def _fqn_tree(fn):
    """FSDP(model(0: MLP(FSDP(in_proj), FSDP(out_proj)), 1: MLP, 2: _Tied)):
    the root's group holds model[1]'s and model[2]'s parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), MLP(), _Tied())
    fn(model[0].in_proj)
    fn(model[0].out_proj)
    fn(model)
    return model


def _read_names(fn, model):
    """Each state's group: (_module_fqn, [(_param_fqn, _module_info as
    names)]) in the order of the states given."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for x in (model, model[0].in_proj, model[0].out_proj):
        g = fn.state(x)._fsdp_param_group
        params = []
        for p in g.fsdp_params:
            info = p._module_info
            params.append((p._param_fqn, names[id(info.module)], info.param_name,
                           [names[id(m)] for m in info.shared_modules],
                           list(info.shared_param_names)))
        out.append((g._module_fqn, params))
    return out


def _unsharded(fn, model):
    return [fn.state(x)._fsdp_param_group.is_unsharded
            for x in (model, model[0].in_proj, model[0].out_proj)]


def _group_names(fn):
    model = _fqn_tree(fn)
    out = {"before": _read_names(fn, model), "unsharded_before": _unsharded(fn, model)}
    fn.state(model)._lazy_init()
    out["after"] = _read_names(fn, model)
    out["is_root"] = [fn.state(x)._is_root for x in (model, model[0].in_proj)]
    inner = model[0].in_proj
    inner.unshard()
    out["unshard"] = _unsharded(fn, model)
    inner.reshard()
    out["reshard"] = _unsharded(fn, model)
    handle = inner.unshard(async_op=True)
    out["unshard_async"] = _unsharded(fn, model)
    handle.wait()
    out["unshard_async_waited"] = _unsharded(fn, model)
    inner.reshard()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    loss = model(x).sum()
    out["after_forward"] = _unsharded(fn, model)  # the root keeps its parameters gathered
    loss.backward()
    out["after_backward"] = _unsharded(fn, model)
    inner.set_reshard_after_forward(False)
    model(x).sum().backward()
    model(x)
    out["kept_after_forward"] = _unsharded(fn, model)
    out["names_after_steps"] = _read_names(fn, model)
    return out


def _group_names_both():
    return _group_names(fully_shard), _group_names(torch_fully_shard)


def test_group_and_param_names_and_is_unsharded_read_as_torch(dist_pool):
    for ours, theirs in dist_pool(2).run(_group_names_both, timeout=TIMEOUT):
        # unshard(async_op=True) before its wait(): torch's group says False
        # until the wait copies out; flatshard's host gather has completed
        # in the call (on CPU nothing is left for wait() to do), so True
        assert theirs.pop("unshard_async") == [False] * 3
        assert ours.pop("unshard_async") == [False, True, False]
        assert ours == theirs
        none = [(None, [(None,) + p[1:] for p in ps]) for _, ps in ours["after"]]
        assert ours["before"] == none  # named at lazy init, as torch names them
        root, in_proj, out_proj = ours["after"]
        assert root == ("", [("1.in_proj.weight", "1.in_proj", "weight", [], []),
                             ("1.in_proj.bias", "1.in_proj", "bias", [], []),
                             ("1.out_proj.weight", "1.out_proj", "weight", [], []),
                             ("1.out_proj.bias", "1.out_proj", "bias", [], []),
                             ("2.a.weight", "2.a", "weight", ["2.b", "2.a"],
                              ["weight", "weight"])])
        assert in_proj == ("0.in_proj", [("0.in_proj.weight", "0.in_proj", "weight", [], []),
                                         ("0.in_proj.bias", "0.in_proj", "bias", [], [])])
        assert out_proj[0] == "0.out_proj"
        assert ours["names_after_steps"] == ours["after"]
        assert ours["is_root"] == [True, False]
        assert ours["unsharded_before"] == ours["reshard"] == [False] * 3
        assert ours["unshard"] == ours["unshard_async_waited"] == [False, True, False]
        assert ours["after_forward"] == [True, False, False]
        assert ours["after_backward"] == [False] * 3
        assert ours["kept_after_forward"] == [True, True, False]
