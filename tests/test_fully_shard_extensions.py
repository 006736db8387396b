"""fully_shard's all-gather extensions (fsdp_pre_all_gather /
fsdp_post_all_gather) against torch's fully_shard in the same run, with two
subclasses written here: a weight all-gathered in bfloat16, and one moved as
two inner tensors plus metadata. Every subclass without the protocol is
refused by name (test_tensor_subclass.py)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._python_dispatch import return_and_correct_aliasing

from flatshard import ConfigError, MixedPrecisionPolicy, NotBuiltError, _C, fully_shard

TIMEOUT = 240


class _Wrapper(torch.Tensor):
    """A float32 weight held in `data`; every op runs on it."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data):
        self.data_ = data

    def __repr__(self):
        return f"{type(self).__name__}({self.data_!r})"

    def __tensor_flatten__(self):
        return ["data_"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["data_"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        out = func(*pytree.tree_map_only(cls, lambda x: x.data_, args),
                   **pytree.tree_map_only(cls, lambda x: x.data_, kwargs))
        out = pytree.tree_map_only(torch.Tensor, cls, out)
        return return_and_correct_aliasing(func, args, kwargs, out)


class BF16Gather(_Wrapper):
    """All-gathered in bfloat16 (half the bytes), rebuilt in param_dtype. Pads
    its own last shard, as torch requires of uneven shards."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = -(-outer_size[0] // mesh.size())
        data = self.data_.to(torch.bfloat16)
        if data.shape[0] < rows:
            data = torch.cat([data, data.new_zeros((rows - data.shape[0], *data.shape[1:]))])
        return (data,), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        if out is not None:  # a refill: autograd's saved copy must stay valid
            if out.dtype != data.dtype:
                with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(data[:out.shape[0]])
            return
        full = data if data.dtype == param_dtype else data.to(param_dtype)
        return full, (full,)


class HiLo(_Wrapper):
    """Moved as two bfloat16 tensors (high and low parts) and a scale in the
    metadata; the older one-argument signature of fsdp_pre_all_gather."""

    def fsdp_pre_all_gather(self, mesh):
        scale = 4.0
        hi = (self.data_ * scale).to(torch.bfloat16)
        lo = (self.data_ * scale - hi.float()).to(torch.bfloat16)
        return (hi, lo), scale

    def fsdp_post_all_gather(self, outputs, scale, param_dtype, *, out=None):
        hi, lo = outputs
        full = ((hi.float() + lo.float()) / scale).to(param_dtype)
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(full[:out.shape[0]])
            return
        return full, (full,)


def _model(kind, d_in, d_hidden):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, 8))
    for lin in (m[0], m[2]):
        lin.weight = nn.Parameter(kind(lin.weight.detach().clone()))
    return m


def _train(kind_name, d_in=16, d_hidden=32, param_dtype=None, steps=3):
    """The same model under torch's fully_shard and flatshard's: per step,
    (our loss, torch's loss); and the largest parameter difference at the end."""
    kind = {"bf16": BF16Gather, "hilo": HiLo}[kind_name]
    rank = dist.get_rank()
    models = []
    for shard, mp in ((torch_fully_shard, TorchMP(param_dtype=param_dtype)),
                      (fully_shard, MixedPrecisionPolicy(param_dtype=param_dtype))):
        m = _model(kind, d_in, d_hidden)
        shard(m[0], mp_policy=mp)
        shard(m[2], mp_policy=mp)
        shard(m, mp_policy=mp)
        models.append(m)
    theirs, ours = models
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=False)
            for m in models]
    g = torch.Generator().manual_seed(11 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, d_in, generator=g)
        step = []
        for m, o in zip(models, opts):
            loss = m(x).float().square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            step.append(loss.item())
        losses.append((step[1], step[0]))
    worst = 0.0
    for (n, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        a, b = p._local_tensor, q._local_tensor
        a = a.data_ if isinstance(a, _Wrapper) else a
        b = b.data_ if isinstance(b, _Wrapper) else b
        assert type(p._local_tensor) is type(q._local_tensor), n
        worst = max(worst, (a - b).abs().max().item())
    gathered = ours[0]._fsdp_state().group.ext
    return losses, worst, sorted(gathered)


@pytest.mark.parametrize("kind,d_in,param_dtype", [
    ("bf16", 16, None), ("bf16", 15, None), ("bf16", 16, torch.bfloat16), ("hilo", 16, None)])
def test_extension_parity_with_torch_fully_shard(dist_pool, kind, d_in, param_dtype):
    # d_in=15 -> Linear(15, 32)'s weight is even, Linear(32, 8)'s too; the
    # uneven case is the hidden size below.
    for losses, worst, ext in dist_pool(2).run(_train, kind, d_in, 32, param_dtype,
                                               timeout=TIMEOUT):
        assert ext == [0]  # the weight (index 0 of its group) took the extension path
        for ours, theirs in losses:
            assert ours == theirs, losses
        assert worst == 0.0


def test_extension_uneven_shards_match_torch(dist_pool):
    # hidden 33 on 2 ranks: the first weight's rows split 17 / 16 (padded).
    for losses, worst, _ in dist_pool(2).run(_train, "bf16", 16, 33, timeout=TIMEOUT):
        for ours, theirs in losses:
            assert ours == theirs, losses
        assert worst == 0.0


def _refusals():
    out = []

    class Half(_Wrapper):
        def fsdp_pre_all_gather(self, mesh):
            return (self.data_,), None

    class BadSignature(_Wrapper):
        def fsdp_pre_all_gather(self, mesh, outer_size):
            return (self.data_,), None

        def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
            return outputs[0], outputs

    for kind, kw in ((Half, {}), (BadSignature, {}), (BF16Gather, {"reshard_after_forward": 2})):
        lin = nn.Linear(4, 4)
        lin.weight = nn.Parameter(kind(lin.weight.detach().clone()))
        try:
            fully_shard(lin, **kw)
            out.append(None)
        except (ConfigError, NotBuiltError) as e:
            out.append(str(e))
    return out


def test_half_protocols_and_post_forward_groups_are_refused(dist_pool):
    half, sig, raf = dist_pool(2).run(_refusals, timeout=TIMEOUT)[0]
    assert "both fsdp_pre_all_gather and fsdp_post_all_gather should be defined" in half
    assert "fsdp_pre_all_gather takes 2 arguments" in sig and "weight" in sig
    assert "reshard_after_forward" in raf and "weight" in raf


def _float8_training(steps=3):
    """torchao's float8 training with float8 all-gather: its weights are a
    subclass running the extension protocol. -> per-step (ours, torch's) losses."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    cfg = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    losses = {}
    for name, shard in (("torch", torch_fully_shard), ("ours", fully_shard)):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
        convert_to_float8_training(m, config=cfg)
        shard(m[0])
        shard(m[2])
        shard(m)
        assert hasattr(m[0].weight.to_local(), "fsdp_pre_all_gather")
        o = torch.optim.SGD(m.parameters(), lr=0.1, foreach=False)
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        losses[name] = []
        for _ in range(steps):
            loss = m(torch.randn(16, 64, generator=g)).square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses[name].append(loss.item())
    return losses["ours"], losses["torch"]


def test_torchao_float8_all_gather_matches_torch(dist_pool):
    pytest.importorskip("torchao.float8")
    for ours, theirs in dist_pool(2).run(_float8_training, timeout=TIMEOUT):
        assert ours == theirs


# torch's TwoTensor given the extension at class level, as torch's own tests
# do: its unsharded parameter, and so its unsharded gradient, is a TwoTensor.

def _two_pre_v1(self, mesh):
    return (self.a, self.b), None


def _two_pre_v2(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.a, self.b), None


def _two_post(self, outputs, metadata, param_dtype, *, out=None):
    a, b = outputs
    if out is not None:
        if a.dtype != param_dtype:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.a.copy_(a)
                out.b.copy_(b)
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


def _two_tensor_train(version, reshard_after_forward, param_dtype, steps=4):
    """A model whose weights are TwoTensors with different halves (b = 2a + 1),
    under torch's fully_shard and flatshard's: -> (per-step losses of both
    halves, ours then torch's; whether every final local tensor, both halves,
    is equal bit for bit; the type of a sharded gradient, ours and torch's)."""
    TwoTensor.fsdp_pre_all_gather = _two_pre_v1 if version == 1 else _two_pre_v2
    TwoTensor.fsdp_post_all_gather = _two_post
    try:
        models = []
        for shard, mp in ((fully_shard, MixedPrecisionPolicy(param_dtype=param_dtype)),
                          (torch_fully_shard, TorchMP(param_dtype=param_dtype))):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(),
                              nn.Linear(16, 6, bias=False), nn.ReLU(), nn.Linear(6, 3))
            for lin in (m[0], m[2]):
                w = lin.weight.detach()
                lin.weight = nn.Parameter(TwoTensor(w.clone(), 2 * w + 1))
            for lin in (m[0], m[2], m[4]):
                shard(lin, reshard_after_forward=reshard_after_forward, mp_policy=mp)
            shard(m, reshard_after_forward=reshard_after_forward, mp_policy=mp)
            models.append(m)
        opts = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True) for m in models]
        g = torch.Generator().manual_seed(3 + dist.get_rank())
        losses, grad_types = [], []
        for step in range(steps):
            x = torch.randn(2, 8, generator=g)
            pair = []
            for m, o in zip(models, opts):
                loss = m(x).sum()
                loss.backward()
                if step == 0:
                    gr = m[0].weight.grad
                    grad_types.append((type(gr).__name__, type(gr._local_tensor).__name__))
                o.step()
                o.zero_grad(set_to_none=step % 2 == 0)
                pair.append((loss.a.item(), loss.b.item()))
            losses.append(tuple(pair))
        same = True
        for p, q in zip(*(m.parameters() for m in models)):
            a, b = p._local_tensor, q._local_tensor
            assert type(a) is type(b)
            halves = (a.a, a.b, b.a, b.b) if isinstance(a, TwoTensor) else (a, a, b, b)
            same = same and torch.equal(halves[0], halves[2]) and torch.equal(halves[1],
                                                                              halves[3])
        return losses, same, grad_types
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


@pytest.mark.parametrize("version,raf,param_dtype", [
    (1, True, None), (2, False, None), (2, True, torch.bfloat16)])
def test_two_tensor_gradients_train_as_torch(dist_pool, version, raf, param_dtype):
    for losses, same, grad_types in dist_pool(2).run(_two_tensor_train, version, raf,
                                                     param_dtype, timeout=TIMEOUT):
        for ours, theirs in losses:
            assert ours == theirs, losses
        assert losses[0][0][0] != losses[0][0][1]  # the halves differ: each is checked
        assert same
        assert grad_types[0] == grad_types[1] == ("DTensor", "Tensor")


# An extension attached to a parameter's local tensor after fully_shard, as
# torch's own test attaches one: bound methods on `param._local_tensor` (after
# to_empty, which makes new local tensors), on TwoTensor weights and on plain
# ones, which flatshard moves from the group's flat all-gather to this path.

def _attach_bf16_gather(local, ran):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        ran.append(1)
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (t,) = outputs
        if out is not None:
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(t)
            return None
        up = t.to(param_dtype)
        return up, (t, up)
    local.fsdp_pre_all_gather = fsdp_pre_all_gather.__get__(local)
    local.fsdp_post_all_gather = fsdp_post_all_gather.__get__(local)


def _attached_train(kind, meta, steps=3):
    """-> (per-step (ours, torch's) losses, whether the final local tensors are
    equal bit for bit, how many pre-all-gathers ran in each)."""
    models, ran = [], ([], [])
    for shard, calls in ((fully_shard, ran[0]), (torch_fully_shard, ran[1])):
        torch.manual_seed(0)
        with torch.device("meta" if meta else "cpu"):
            m = nn.Sequential(*[nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(),
                                              nn.Linear(16, 8, bias=False)) for _ in range(2)])
        if kind == "two":
            for blk in m:
                for lin in (blk[0], blk[2]):
                    w = lin.weight.detach()
                    lin.weight = nn.Parameter(TwoTensor(w, w.clone()))
        for blk in m:
            shard(blk)
        shard(m)
        if meta:
            m.to_empty(device="cpu")
            torch.manual_seed(1)
            for p in m.parameters():
                nn.init.trunc_normal_(p)
        for name, p in m.named_parameters():
            # every TwoTensor (one without is refused, below); of the plain
            # ones each block's first weight, beside a plain one in its group
            if kind == "two" or name.endswith("0.weight"):
                _attach_bf16_gather(p._local_tensor, calls)
        models.append(m)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True) for m in models]
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(2, 8, generator=g)
        pair = []
        for m, o in zip(models, opts):
            loss = m(x).sum()
            loss.backward()
            o.step()
            o.zero_grad()
            pair.append(loss.item())
        losses.append(tuple(pair))
    same = True
    for p, q in zip(*(m.parameters() for m in models)):
        a, b = p._local_tensor, q._local_tensor
        same = same and type(a) is type(b) and (
            torch.equal(a.a, b.a) and torch.equal(a.b, b.b) if isinstance(a, TwoTensor)
            else torch.equal(a, b))
    return losses, same, (len(ran[0]), len(ran[1]))


@pytest.mark.parametrize("kind,meta", [("two", True), ("two", False), ("plain", False)])
def test_extension_attached_after_fully_shard_trains_as_torch(dist_pool, kind, meta):
    for losses, same, (ours_ran, torch_ran) in dist_pool(2).run(_attached_train, kind, meta,
                                                                timeout=TIMEOUT):
        for ours, theirs in losses:
            assert ours == theirs, losses
        assert same
        assert ours_ran == torch_ran > 0  # one per gather of each patched weight


# The extension given after the first step: lazy init has handed each block's
# group its plain-event flags ([Note: plain events] in
# csrc/hooks/shard_events.c) for a group with no extension parameter; the
# next gather moves the weight to the extension's path, and from then on the
# group's events must free the extension's gathered and rebuilt tensors as
# torch's reshard does, after forward and after backward. torch's fully_shard
# takes no extension after its lazy init (it reads the extension's state made
# at wrap), so the reference is the model trained in one process on every
# rank's batch, its first weights rounded to bfloat16 in forward from then on
# (what the bfloat16 all-gather does), their gradients as they are.

def _blocks():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(),
                                         nn.Linear(16, 8)) for _ in range(2)])


def _reference_forward(m, x, rounded):
    for blk in m:
        w = blk[0].weight
        if rounded:  # the bfloat16 value forward, the gradient straight through
            w = w + (w.detach().to(torch.bfloat16).float() - w.detach())
        x = blk[2](torch.relu(x @ w.t()))
    return x


def _ext_freed(group):
    """Whether every extension parameter's all-gather outputs and rebuilt
    tensors hold no bytes (None: the group has none)."""
    if not group.ext:
        return None
    return all(t.untyped_storage().nbytes() == 0
               for x in group.ext.values() for t in list(x.outputs or ()) + list(x.inner))


def _extension_after_lazy_init_train(steps=4):
    """-> (per step: our loss and the reference's for this rank's batch), the
    largest difference of the final parameters, how many pre-all-gathers
    ran, per step whether the blocks' extension tensors were freed after
    forward and after backward, and the blocks' groups' plain flags."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ours, ref = _blocks(), _blocks()
    for blk in ours:
        fully_shard(blk)
    fully_shard(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, foreach=False)
            for m in (ours, ref)]
    groups = [blk._fsdp_state().group for blk in ours]
    gens = [torch.Generator().manual_seed(1 + r) for r in range(world)]
    losses, freed, plain, ran = [], [], [], []
    for step in range(steps):
        if step == 1:  # lazy init done and a step taken: the first weights get it now
            for blk in ours:
                _attach_bf16_gather(blk[0].weight._local_tensor, ran)
        xs = [torch.randn(3, 8, generator=gen) for gen in gens]
        loss = ours(xs[rank]).square().mean()
        seen = [[_ext_freed(gr) for gr in groups]]
        loss.backward()
        seen.append([_ext_freed(gr) for gr in groups])
        ref_losses = [_reference_forward(ref, x, step >= 1).square().mean() for x in xs]
        (sum(ref_losses) / world).backward()  # fully_shard's gradient: the ranks' mean
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append((loss.item(), ref_losses[rank].item()))
        freed.append(seen)
        plain.append([gr.plain for gr in groups])
    worst = max((p.full_tensor() - q).abs().max().item()
                for p, q in zip(ours.parameters(), ref.parameters()))
    return losses, worst, len(ran), freed, plain


def test_extension_given_after_lazy_init_is_freed_and_trains_as_reference(dist_pool):
    for losses, worst, ran, freed, plain in dist_pool(2).run(
            _extension_after_lazy_init_train, timeout=TIMEOUT):
        for ours, ref in losses:
            assert ours == pytest.approx(ref, rel=1e-5, abs=1e-6), losses
        assert worst < 1e-5, worst
        assert ran == 3 * 2 * 2  # 3 steps, 2 blocks, a gather in forward and in backward
        assert freed[0] == [[None, None], [None, None]], freed
        for step in freed[1:]:  # after forward (reshard_after_forward) and backward
            assert step == [[True, True], [True, True]], freed
        # before the extension the blocks' post-backward reduces and reshards
        # in C; after it Python does (the extension's tensors are Python's to
        # free)
        in_c = _C.PB_RESHARD_C | _C.PB_REDUCE_C
        assert all(p & in_c == in_c for p in plain[0]), plain
        assert all(p & in_c == 0 for step in plain[1:] for p in step), plain


def _subclass_without_extension():
    """A TwoTensor weight is taken at wrap (its local tensor may be given the
    extension); still without one at the first forward, refused there."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    w = m[0].weight.detach()
    m[0].weight = nn.Parameter(TwoTensor(w, w.clone()))
    fully_shard(m[0])
    fully_shard(m)
    try:
        m(torch.randn(2, 4))
    except NotBuiltError as e:
        return str(e)
    return None


def test_subclass_without_extension_is_refused_at_its_first_gather(dist_pool):
    for msg in dist_pool(2).run(_subclass_without_extension, timeout=TIMEOUT):
        assert msg is not None and "parameter weight is a" in msg and "TwoTensor" in msg
        assert "_local_tensor" in msg and "fsdp_pre_all_gather" in msg
