"""Flows written for torch 2.13's FSDP2, run unchanged on flatshard's
fully_shard and on torch's own fully_shard in the same run (2 ranks; torch on
gloo, flatshard on its default backend), comparing losses step by step:

  meta-device init, then weights loaded without to_empty/reset_parameters
  (load_state_dict(assign=True) of distribute_tensor'd values;
  set_model_state_dict / set_optimizer_state_dict from rank 0's full state
  dicts; to_empty and a later load);
  the registered parameters: plain unsharded nn.Parameters from unshard to
  reshard (reshard_after_forward=False, the root), DTensor shards otherwise;
  model.to(dtype) after fully_shard;
  a parameter tied across two fully_shard groups (torch's ValueError);
  unshard(async_op=True) and FSDPModule._set_unshard_async_op;
  modules taking and returning dataclass objects (with mixed precision:
  their tensors cast too);
  a frozen layer read before a trained one in the same group, also with a
  forward whose graph is dropped, two forwards before their backwards, a
  retained graph and a backward that fails.

Where both run the same arithmetic (fp32 or fp64 compute, gradients summed
over the 2 ranks and halved) losses and shards are compared bit for bit."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from flatshard import ConfigError, FSDPModule, MixedPrecisionPolicy, fully_shard

TIMEOUT = 240
BOTH = (("torch", torch_fully_shard), ("ours", fully_shard))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.lin(x)))


class Net(nn.Module):
    """7 rows in most weights: uneven shards (4 and 3 rows) on 2 ranks.
    (test_fsdp2_observability.py and test_compile.py use these too.)"""

    def __init__(self, d=7, depth=2):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _net():
    torch.manual_seed(0)
    return Net()


def _shard(fn, model, **kw):
    for b in model.blocks:
        fn(b, **kw)
    return fn(model, **kw)


def _batches(steps, dtype=torch.float32):
    """This rank's own batch per step."""
    g = torch.Generator().manual_seed(11 + dist.get_rank())
    return [(torch.randn(4, 5, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype))
            for _ in range(steps)]


def _train(model, steps=3, opt=None, dtype=torch.float32):
    """Losses of `steps` SGD (or `opt`) steps on this rank's batches."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in _batches(steps, dtype):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _locals(model):
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def _same_locals(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------
# 1. meta-device init, then a checkpoint


def _meta_assign():
    """Built on meta, sharded, then load_state_dict(strict=False,
    assign=True) of values distributed to the meta state dict's mesh and
    placements; no to_empty, no reset_parameters."""
    full = _net().state_dict()
    out = {}
    for name, fn in BOTH:
        with torch.device("meta"):
            model = Net()
        _shard(fn, model)
        meta_sd = model.state_dict()
        sd = {k: distribute_tensor(full[k], v.device_mesh, v.placements)
              for k, v in meta_sd.items()}
        model.load_state_dict(sd, strict=False, assign=True)
        w = model.blocks[0].lin.weight
        assert isinstance(w, DTensor) and isinstance(w, nn.Parameter) and not w.is_meta, name
        losses = _train(model)
        out[name] = (losses, _locals(model))
    return out


def test_meta_init_then_load_state_dict_assign(dist_pool):
    for out in dist_pool(2).run(_meta_assign, timeout=TIMEOUT):
        assert out["ours"][0] == out["torch"][0], out
        assert _same_locals(out["ours"][1], out["torch"][1])


def _reference_checkpoint():
    """Full model and AdamW state dicts of the plain model after one step
    (every rank makes them; the flow below reads rank 0's only)."""
    ref = _net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(99)
    ref(torch.randn(8, 5, generator=g)).square().mean().backward()
    opt.step()
    opts = StateDictOptions(full_state_dict=True)
    return get_model_state_dict(ref, options=opts), get_optimizer_state_dict(ref, opt, options=opts)


def _meta_set_state_dict():
    """torch.distributed.checkpoint's flow: meta model, fully_shard, then
    set_model_state_dict / set_optimizer_state_dict with full state dicts
    broadcast from rank 0."""
    rank0 = dist.get_rank() == 0
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    out = {}
    for name, fn in BOTH:
        # a fresh checkpoint each time: the setters fill the dicts they are given
        full_sd, full_osd = _reference_checkpoint()
        with torch.device("meta"):
            model = Net()
        _shard(fn, model)
        set_model_state_dict(model, full_sd if rank0 else {}, options=opts)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        set_optimizer_state_dict(model, opt, full_osd if rank0 else {}, options=opts)
        state = {n: opt.state[p]["exp_avg"].to_local().clone()
                 for n, p in model.named_parameters()}
        losses = _train(model, opt=opt)
        out[name] = (losses, _locals(model), state)
    return out


def test_meta_init_then_set_model_and_optimizer_state_dict(dist_pool):
    for out in dist_pool(2).run(_meta_set_state_dict, timeout=TIMEOUT):
        assert _same_locals(out["ours"][2], out["torch"][2])   # the loaded AdamW state
        assert out["ours"][0] == out["torch"][0], out
        assert _same_locals(out["ours"][1], out["torch"][1])


def _to_empty_then_load():
    """to_empty on the sharded meta model, then a later load (in place, no
    assign), and an assign=True after training started: all adopted."""
    full = _net().state_dict()
    later = {k: v * 0.5 for k, v in full.items()}
    out = {}
    for name, fn in BOTH:
        with torch.device("meta"):
            model = Net()
        _shard(fn, model)
        model.to_empty(device="cpu")
        set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True))
        losses = _train(model, 2)
        sd = {k: distribute_tensor(later[k], v.device_mesh, v.placements)
              for k, v in model.state_dict().items()}
        model.load_state_dict(sd, assign=True)
        losses += _train(model, 2)
        out[name] = (losses, _locals(model))
    return out


def test_to_empty_and_later_loads_are_adopted(dist_pool):
    for out in dist_pool(2).run(_to_empty_then_load, timeout=TIMEOUT):
        assert out["ours"][0] == out["torch"][0], out
        assert _same_locals(out["ours"][1], out["torch"][1])


def _bad_assignments():
    """What cannot be a shard is refused by name at the next forward, and so
    is a parameter a strict=False load left on the meta device (torch: a
    RuntimeError naming it; flatshard: a ConfigError naming it)."""
    got = []
    for bad in ("plain", "placement", "missing", "part cast"):
        if bad == "missing":
            with torch.device("meta"):
                model = Net()
            _shard(fully_shard, model)
            full = _net().state_dict()
            sd = {k: distribute_tensor(full[k], v.device_mesh, v.placements)
                  for k, v in model.state_dict().items() if k != "blocks.1.norm.bias"}
            model.load_state_dict(sd, strict=False, assign=True)
        else:
            model = _shard(fully_shard, _net())
        w = model.blocks[1].lin.weight
        if bad == "plain":
            model.blocks[1].lin.weight = nn.Parameter(w.full_tensor().detach())
        elif bad == "placement":
            from torch.distributed.tensor import Replicate
            model.blocks[1].lin.weight = nn.Parameter(
                distribute_tensor(w.full_tensor().detach(), w.device_mesh, [Replicate()]))
        elif bad == "part cast":   # a submodule inside the group, not the FSDP module
            model.blocks[1].lin.double()
        try:
            model(torch.randn(2, 5))
            got.append(None)
        except ConfigError as e:
            got.append(str(e))
            # torch raises RuntimeError for parameters left on meta: so does this
            assert isinstance(e, RuntimeError) == (bad == "missing"), bad
    return got


def test_assignments_that_are_not_shards_are_refused(dist_pool):
    for plain, placement, missing, cast in dist_pool(2).run(_bad_assignments, timeout=TIMEOUT):
        assert "parameter lin.weight" in plain and "replaced by a Parameter" in plain
        assert "parameter lin.weight" in placement and "Replicate" in placement
        assert "meta device (norm.bias)" in missing and "assign=True" in missing
        assert "several dtypes" in cast and "lin.weight: torch.float64" in cast


# ----------------------------------------------------------------------
# 2. what the modules hold


def _kinds(model):
    return [(n, type(p).__name__, tuple(p.shape), p.requires_grad)
            for n, p in model.named_parameters()]


def _registered(raf):
    """reshard_after_forward=False (and the root by default): the modules
    hold plain unsharded nn.Parameters after forward; state_dict() and
    backward put the DTensor shards back; explicit unshard/reshard too."""
    out = {}
    for name, fn in BOTH:
        model = _net()
        model.blocks[0].norm.bias.requires_grad_(False)
        _shard(fn, model, reshard_after_forward=raf)
        seen = {"init": _kinds(model)}
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        losses = []
        for step, (x, y) in enumerate(_batches(3)):
            loss = ((model(x) - y) ** 2).mean()
            if step == 0:
                seen["forward"] = _kinds(model)
                w = model.blocks[1].lin.weight
                seen["plain"] = type(w) is nn.Parameter and not isinstance(w, DTensor)
                assert type(model.out.weight) is nn.Parameter, name
                seen["state_dict"] = [type(v).__name__ for v in model.state_dict().values()]
                seen["after state_dict"] = _kinds(model)
            loss.backward()
            if step == 0:
                seen["backward"] = _kinds(model)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():  # an evaluation: resharded by reshard_after_forward alone
            losses.append(((model(x) - y) ** 2).mean().item())
        seen["no_grad forward"] = _kinds(model)
        losses.append(((model(x) - y) ** 2).mean().item())  # and training goes on
        seen["forward after"] = _kinds(model)
        model.blocks[0].unshard()
        seen["unshard"] = _kinds(model.blocks[0])
        model.blocks[0].reshard()
        seen["reshard"] = _kinds(model.blocks[0])
        out[name] = (losses, seen)
    return out


@pytest.mark.parametrize("raf", [False, None, 1])
def test_registered_parameters_follow_torch(dist_pool, raf):
    for out in dist_pool(2).run(_registered, raf, timeout=TIMEOUT):
        (ours, seen), (theirs, want) = out["ours"], out["torch"]
        assert ours == theirs
        assert seen == want
        after_forward = {n.split(".")[0]: k for n, k, _, _ in seen["forward"]}
        assert after_forward["inp"] == after_forward["out"] == "Parameter"   # the root's
        whole = raf is False or raf == 1  # 1: the post-forward mesh of one rank holds all
        assert after_forward["blocks"] == ("Parameter" if whole else "DTensor")
        assert seen["plain"] == whole
        # a no_grad forward leaves the root whole, as torch does
        assert {n.split(".")[0]: k for n, k, _, _ in seen["no_grad forward"]}["out"] == \
            "Parameter"
        assert {k for _, k, _, _ in seen["backward"]} == {"DTensor"}
        assert set(seen["state_dict"]) == {"DTensor"}


# ----------------------------------------------------------------------
# 3. casts after fully_shard


def _cast(dtype, mp):
    out = {}
    for name, fn in BOTH:
        kw = {}
        if mp:
            kw["mp_policy"] = (TorchMP if name == "torch" else MixedPrecisionPolicy)(
                param_dtype=torch.bfloat16)
        model = _shard(fn, _net(), **kw)
        model.to(dtype)
        losses = _train(model, dtype=dtype)
        w = model.blocks[0].lin.weight
        out[name] = (losses, _locals(model), w.dtype, w.grad is None)
    return out


@pytest.mark.parametrize("dtype,mp", [(torch.float64, False), (torch.bfloat16, False),
                                      (torch.float64, True)])
def test_cast_after_fully_shard(dist_pool, dtype, mp):
    for out in dist_pool(2).run(_cast, dtype, mp, timeout=TIMEOUT):
        assert out["ours"][2] == out["torch"][2] == dtype
        assert out["ours"][0] == out["torch"][0], out
        assert _same_locals(out["ours"][1], out["torch"][1])


def _cast_after_training():
    """torch's fully_shard cannot cast once it has run (its lazy init fixed
    the dtypes: 'Expected out tensor to have dtype double'); flatshard can.
    Checked against plain torch on the whole batch."""
    try:
        model = _shard(torch_fully_shard, _net())
        _train(model, 1)
        model.to(torch.float64)
        _train(model, 1, dtype=torch.float64)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, ref = _shard(fully_shard, _net()), _net()
    o = torch.optim.SGD(ours.parameters(), lr=0.1)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        if step == 1:
            ours.to(torch.float64)
            ref.to(torch.float64)
            o = torch.optim.SGD(ours.parameters(), lr=0.1)
            o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        dtype = torch.float32 if step == 0 else torch.float64
        x, y = torch.randn(4 * world, 5, generator=g), torch.randn(4 * world, 3, generator=g)
        x, y = x.to(dtype), y.to(dtype)
        mine = slice(4 * rank, 4 * rank + 4)
        ((ours(x[mine]) - y[mine]) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        for opt in (o, o_ref):
            opt.step()
            opt.zero_grad()
    worst = max(((p.full_tensor() - q).abs().max() / q.abs().max()).item()
                for p, q in zip(ours.parameters(), ref.parameters()))
    return refused, ours.inp.weight.dtype, worst


def test_cast_after_training_started(dist_pool):
    for refused, dtype, worst in dist_pool(2).run(_cast_after_training, timeout=TIMEOUT):
        assert refused is not None and "dtype" in refused   # torch's own limit
        assert dtype == torch.float64
        # the first step in float32: sums over 2 ranks vs the whole batch's
        assert worst < 1e-6, worst


# ----------------------------------------------------------------------
# 4. a parameter tied across groups


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.emb(x))))


def _tied():
    out = {}
    for name, fn in BOTH:
        got = {}
        for order in ("emb_out", "out_emb", "emb_root", "list"):
            m = Tied()
            if order == "emb_out":
                fn(m.emb), fn(m.out), fn(m)
            elif order == "out_emb":
                fn(m.out), fn(m.emb), fn(m)
            elif order == "emb_root":
                fn(m.emb), fn(m)
            else:
                fn([m.emb, m.out]), fn(m)
            try:
                losses = _train_tied(m)
                got[order] = ("ok", losses, [n for n, _ in m.named_parameters()])
            except Exception as e:  # noqa: BLE001 - the type is what is compared
                got[order] = (type(e), str(e))
        out[name] = got
    return out


def _train_tied(m, steps=3):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3 + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = m(torch.randint(0, 6, (4, 3), generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_parameter_tied_across_groups_is_refused_as_torch_does(dist_pool):
    for out in dist_pool(2).run(_tied, timeout=TIMEOUT):
        ours, theirs = out["ours"], out["torch"]
        for order, param in (("emb_out", "out.weight"), ("out_emb", "out.weight"),
                             ("emb_root", "emb.weight")):
            (ot, om), (tt, tm) = ours[order], theirs[order]
            assert tt is ValueError and issubclass(ot, ValueError) and issubclass(ot, ConfigError)
            assert f"Parameter '{param}' is shared" in tm
            assert tm in om, (om, tm)   # torch's words, after flatshard's prefix
        assert ours["list"][0] == "ok" and ours["list"] == theirs["list"]


# ----------------------------------------------------------------------
# 5. unshard(async_op=True), _set_unshard_async_op


def _async_op():
    out = {}
    for name, fn in BOTH:
        model = _shard(fn, _net())
        h = model.blocks[0].unshard(async_op=True)
        kinds = {"handle": isinstance(h, TorchUnshardHandle), "wait": h.wait(),
                 "unsharded": _kinds(model.blocks[0])}
        model.blocks[0].reshard()
        kinds["sync"] = model.blocks[1].unshard()
        model.blocks[1].reshard()
        model._set_unshard_async_op(True)
        losses = _train(model)
        out[name] = (losses, kinds, _locals(model))
    return out


def test_unshard_async_op_and_set_unshard_async_op(dist_pool):
    for out in dist_pool(2).run(_async_op, timeout=TIMEOUT):
        (ours, k, lo), (theirs, want, lt) = out["ours"], out["torch"]
        assert k == want and k["handle"] and k["wait"] is None and k["sync"] is None
        assert {t for _, t, _, _ in k["unsharded"]} == {"Parameter"}
        assert ours == theirs
        assert _same_locals(lo, lt)


def test_fsdp_module_has_torchs_private_switch():
    assert callable(FSDPModule._set_unshard_async_op)


# ----------------------------------------------------------------------
# 6. dataclass objects in and out of a module


@dataclasses.dataclass
class _Hidden:
    h: torch.Tensor
    note: str = "kept"


class _ToHidden(nn.Module):
    def __init__(self, d=7):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return _Hidden(torch.tanh(self.lin(x)))


class _FromHidden(nn.Module):
    def __init__(self, d=7):
        super().__init__()
        self.lin = nn.Linear(d, 3)

    def forward(self, hidden):
        assert hidden.note == "kept"
        return self.lin(hidden.h)


class _DataclassNet(nn.Module):
    """`a` returns a dataclass object and its input requires grad (so its
    weight is needed again in backward: the pre-backward gather must find
    the tensor inside); `b` takes one."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.a, self.b = _ToHidden(), _FromHidden()
        self.seen = None

    def forward(self, x):
        hidden = self.a(self.inp(x))
        self.seen = hidden.h.dtype  # output_dtype reaches inside
        return self.b(_Hidden(hidden.h.float()))  # float32 in, cast by b's policy


def _dataclass_flow(mixed):
    out = {}
    for name, fn in BOTH:
        torch.manual_seed(0)
        model = _DataclassNet()
        kw = {}
        if mixed:
            mp_cls = TorchMP if name == "torch" else MixedPrecisionPolicy
            kw["mp_policy"] = mp_cls(param_dtype=torch.bfloat16, output_dtype=torch.float32)
        fn(model.a, **kw)
        fn(model.b, **kw)
        fn(model)
        out[name] = (_train(model), _locals(model), str(model.seen))
    return out


@pytest.mark.parametrize("mixed", [False, True])
def test_dataclass_inputs_and_outputs(dist_pool, mixed):
    for out in dist_pool(2).run(_dataclass_flow, mixed, timeout=TIMEOUT):
        (ours, lo, seen), (theirs, lt, want) = out["ours"], out["torch"]
        assert seen == want == "torch.float32"
        assert ours == theirs
        assert _same_locals(lo, lt)


# ----------------------------------------------------------------------
# 7. a frozen layer before a trained one in one group


def _frozen_first(when):
    """blocks[i].lin frozen, blocks[i].norm trained: in backward lin's weight
    is read for its input's gradient after norm's gradients have arrived
    ([Note: frozen parameters] in fsdp2/state.py)."""
    out = {}
    for name, fn in BOTH:
        model = _net()

        def freeze():
            for b in model.blocks:
                b.lin.requires_grad_(False)
        if when == "before":
            freeze()
        _shard(fn, model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step, (x, y) in enumerate(_batches(3)):
            if when == "between" and step == 1:
                freeze()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = (losses, _locals(model))
    return out


@pytest.mark.parametrize("when", ["before", "between"])
def test_frozen_layer_before_a_trained_one(dist_pool, when):
    for out in dist_pool(2).run(_frozen_first, when, timeout=TIMEOUT):
        (ours, lo), (theirs, lt) = out["ours"], out["torch"]
        assert ours == theirs
        assert _same_locals(lo, lt)


def _unsharded_blocks(model):
    """How many blocks of flatshard's model hold their unsharded parameters."""
    return sum(b._fsdp_state().group.c.is_unsharded for b in model.blocks)


def _frozen_flow(flow):
    """blocks[i].lin frozen as in _frozen_first, trained in `flow`:
    "stray": each step first runs a forward whose graph is dropped unused (a
    loss only logged, an evaluation without no_grad); "two_forwards": two
    forwards, then the backward of each; "retain_graph": two backwards
    through one graph; "aborted": each step first runs a backward that
    fails inside blocks[1] (after its gradients, before its inputs), then
    reset_iter_state(), which must leave no trace of it. torch's fully_shard
    does not come back to the run without the failed backward (its later
    losses differ from it), so there torch runs the plain flow as the
    reference. For flatshard also: how many blocks are unsharded each time
    backward leaves a block, which must be what the plain flow gives (each
    block resharded at its own post-backward)."""
    out = {}
    for name, fn in BOTH:
        flow_here = "plain" if name == "torch" and flow == "aborted" else flow
        model = _net()
        for b in model.blocks:
            b.lin.requires_grad_(False)
        _shard(fn, model)
        seen = []
        if name == "ours":
            def watch(module, args):
                if args[0].requires_grad:
                    args[0].register_hook(lambda g: seen.append(_unsharded_blocks(model)))
            for b in model.blocks:
                b.register_forward_pre_hook(watch)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        batches = _batches(6)
        for (x, y), (x2, y2) in zip(batches[0::2], batches[1::2]):
            if flow_here == "stray":
                ((model(x2) - y2) ** 2).mean().item()
            if flow_here == "aborted":
                def fail(grad):
                    raise RuntimeError("failed in backward")

                def arm(module, args, out):
                    out.register_hook(fail)
                handle = model.blocks[1].norm.register_forward_hook(arm)
                mark = len(seen)
                with pytest.raises(RuntimeError, match="failed in backward"):
                    ((model(x2) - y2) ** 2).mean().backward()
                handle.remove()
                model.reset_iter_state()
                opt.zero_grad()
                del seen[mark:]  # blocks the failed backward left
            loss = ((model(x) - y) ** 2).mean()
            if flow_here == "two_forwards":
                loss2 = ((model(x2) - y2) ** 2).mean()
                loss.backward()
                loss2.backward()
                losses.append(loss2.item())
            elif flow_here == "retain_graph":
                loss.backward(retain_graph=True)
                loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = (losses, _locals(model), seen)
    return out


@pytest.mark.parametrize("flow", ["plain", "stray", "two_forwards", "retain_graph", "aborted"])
def test_frozen_layer_through_other_forward_backward_patterns(dist_pool, flow):
    """Each forward counts in the backward that runs through it, and only
    there ([Note: frozen parameters] in fsdp2/state.py): a dropped forward
    does not keep every block gathered through the next backward, and a
    second backward (of another forward, or of the same graph) finds its
    frozen weights gathered again, and a backward that failed leaves nothing
    behind after reset_iter_state()."""
    for out in dist_pool(2).run(_frozen_flow, flow, timeout=TIMEOUT):
        (ours, lo, seen), (theirs, lt, _) = out["ours"], out["torch"]
        assert ours == theirs
        assert _same_locals(lo, lt)
        backwards = {"two_forwards": 6, "retain_graph": 6}.get(flow, 3)
        assert seen == [1] * (backwards * 2)  # one of the two blocks at a time
