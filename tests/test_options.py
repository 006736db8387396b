"""Arguments (invalid ones: test_validation.py): torch's own option objects,
sync_module_states, ignored modules/states, meta-device init, shared
parameters across units, and the torch FSDP drop-in surface."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
from flatshard import FSDP, ConfigError
from toy_models import Block, build


def test_uninitialized_distributed_is_a_clear_error():
    if dist.is_initialized():
        pytest.skip("process group already initialized in this process")
    with pytest.raises(ConfigError, match="init_process_group"):
        FSDP(build())


def _torch_options_accepted():
    import torch.distributed.fsdp as tf
    m = FSDP(build(), sharding_strategy=tf.ShardingStrategy.SHARD_GRAD_OP,
             backward_prefetch=tf.BackwardPrefetch.BACKWARD_POST,
             cpu_offload=tf.CPUOffload(offload_params=False), mixed_precision=None,
             device_id=torch.device("cpu"), limit_all_gathers=False)
    return m.sharding_strategy.name


def test_torch_option_objects_are_accepted(dist_pool):
    assert dist_pool(2).run(_torch_options_accepted) == ["SHARD_GRAD_OP"] * 2


def _sync_states():
    rank = dist.get_rank()
    model = build(seed=100 + rank)  # every rank starts different
    model.blocks[0].scale.fill_(rank + 1.0)
    fs = FSDP(model, sync_module_states=True, use_orig_params=True)
    ref = build(seed=100)  # rank 0's initialization
    full = [torch.empty(0)]
    out = {}
    for m in fs.modules():
        if isinstance(m, FSDP):
            for g in m._unit.groups:
                gathered = torch.empty(g.padded_numel)
                dist.all_gather_into_tensor(gathered, g.shard.detach())
                for (numel, off, *_), aliases in zip(g.entries, g.aliases):
                    for a in aliases:
                        out[a.fqn] = gathered[off:off + numel]
    del full
    for n, p in ref.named_parameters():
        assert torch.equal(out[n], p.detach().reshape(-1)), n
    return fs.module.blocks[0].scale[0].item()


def test_sync_module_states_broadcasts_rank0(dist_pool):
    assert dist_pool(2).run(_sync_states) == [1.0, 1.0]


def _ignored(use_orig):
    model = build()
    ignored = model.head
    fs = FSDP(model, ignored_modules=[ignored], use_orig_params=use_orig)
    names = dict(fs.named_parameters())
    # The ignored module keeps its own full parameters, untouched by sharding.
    assert fs.module.head.weight.shape == (3, 7) and isinstance(fs.module.head.weight,
                                                                nn.Parameter)
    fs(torch.randn(2, 5)).sum().backward()
    assert fs.module.head.weight.grad.shape == (3, 7)
    return sorted(n for n in names if "head" in n)


@pytest.mark.parametrize("use_orig", [False, True])
def test_ignored_modules_stay_whole(dist_pool, use_orig):
    res = dist_pool(2).run(_ignored, use_orig)
    assert res[0] == ["_fsdp_wrapped_module.head.bias", "_fsdp_wrapped_module.head.weight"]


def _ignored_states_param():
    model = build()
    fs = FSDP(model, ignored_states=[model.inp.weight], use_orig_params=True)
    return tuple(fs.module.inp.weight.shape), tuple(fs.module.inp.bias.shape)


def test_ignored_states_accepts_parameters(dist_pool):
    res = dist_pool(2).run(_ignored_states_param)
    assert res[0][0] == res[1][0] == (7, 5)  # ignored: whole on every rank
    # Managed: a 1-D piece per rank, the pieces adding up to the 7-element bias.
    assert len(res[0][1]) == 1 and res[0][1][0] + res[1][1][0] == 7



def _meta_init():
    with torch.device("meta"):
        model = build()
    fs = FSDP(model, param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False),
              auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}), use_orig_params=True)
    return all(not p.is_meta for p in fs.parameters())


def test_meta_device_with_param_init_fn(dist_pool):
    assert dist_pool(2).run(_meta_init) == [True, True]


class _Resettable(nn.Module):
    """A block whose own parameter has a reset_parameters()."""

    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(d))
        self.lin = nn.Linear(d, d)
        self.act = nn.GELU()
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.gain, 0.5, 1.5)

    def forward(self, x):
        return self.act(self.lin(x)) * self.gain


def _meta_like_torch(mode):
    """The weights torch's FSDP gives a meta-device model from one seed, and
    ours: param_init_fn called on every module of each unit in torch's
    order, or (None) to_empty + reset_parameters. Also the modules torch
    and we hand to param_init_fn."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def make():
        with torch.device("meta"):
            return nn.Sequential(nn.Embedding(11, 6), _Resettable(6),
                                 nn.Sequential(_Resettable(6), nn.ReLU()), nn.Linear(6, 3))
    out = []
    for cls, policy in ((TorchFSDP, ModuleWrapPolicy), (FSDP, flatshard.ModuleWrapPolicy)):
        calls = []

        def init(m, calls=calls):
            calls.append(type(m).__name__)
            m.to_empty(device="cpu", recurse=False)
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        torch.manual_seed(3)
        model = cls(make(), auto_wrap_policy=policy({_Resettable}), device_id=torch.device("cpu"),
                    param_init_fn=init if mode == "fn" else None)
        with cls.summon_full_params(model):
            out.append(({n: p.detach().clone() for n, p in model.named_parameters()}, calls))
    return out


@pytest.mark.parametrize("mode", ["fn", "none"])
def test_meta_device_init_gives_torchs_weights(dist_pool, mode):
    for (theirs, their_calls), (ours, our_calls) in dist_pool(2).run(_meta_like_torch, mode):
        assert our_calls == their_calls
        assert list(ours) == list(theirs)
        for n in theirs:
            assert torch.equal(ours[n], theirs[n]), n


def _shared_across_units():
    model = build()
    model.blocks[1].ff.lin.weight = model.blocks[0].ff.lin.weight
    try:
        FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}))
    except ConfigError as e:
        return str(e)
    return "no error"


def test_parameter_shared_across_units_is_named(dist_pool):
    msg = dist_pool(2).run(_shared_across_units)[0]
    assert "blocks.0.ff.lin.weight" in msg and "blocks.1" in msg and "common parent" in msg


def _same_surface_as_torch(use_orig):
    """The module tree, parameter names and losses of torch's own FSDP."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    kw = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig,
              device_id=torch.device("cpu"))
    ours, theirs = FSDP(build(), **kw), TorchFSDP(build(), **kw)
    names = [n for n, _ in ours.named_parameters()], [n for n, _ in theirs.named_parameters()]
    mods = ([n for n, _ in ours.named_modules()], [n for n, _ in theirs.named_modules()])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randn(4, 5, generator=g)
        pair = []
        for m, o in zip((ours, theirs), opts):
            loss = m(x).pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    return names, mods, losses


@pytest.mark.parametrize("use_orig", [False, True])
def test_same_names_and_losses_as_torch_fsdp(dist_pool, use_orig):
    for names, mods, losses in dist_pool(2).run(_same_surface_as_torch, use_orig):
        assert names[0] == names[1]
        assert mods[0] == mods[1]
        for a, b in losses:
            assert abs(a - b) <= 1e-6 * max(1.0, abs(b))


@dataclasses.dataclass
class _Hidden:
    h: torch.Tensor


class _ToHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return _Hidden(torch.tanh(self.lin(x)))


class _FromHidden(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, hidden):
        return self.lin(hidden.h)


def _dataclass_units(mixed):
    """Units that return and take dataclass objects, the first with an input
    that requires grad (its weight is gathered again in backward through the
    hook on the tensor inside): torch FSDP1's losses, with bf16 mixed
    precision casting the tensors inside too."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    losses = []
    for cls, policy, mp in ((TorchFSDP, ModuleWrapPolicy, TorchMP),
                            (FSDP, flatshard.ModuleWrapPolicy, flatshard.MixedPrecision)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), _ToHidden(), _FromHidden())
        fs = cls(model, auto_wrap_policy=policy({_ToHidden, _FromHidden}),
                 device_id=torch.device("cpu"),
                 mixed_precision=mp(param_dtype=torch.bfloat16) if mixed else None)
        opt = torch.optim.SGD(fs.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(dist.get_rank())
        run = []
        for _ in range(3):
            loss = fs(torch.randn(4, 5, generator=g)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    return losses


@pytest.mark.parametrize("mixed", [False, True])
def test_dataclass_outputs_and_inputs_as_torch_fsdp(dist_pool, mixed):
    for theirs, ours in dist_pool(2).run(_dataclass_units, mixed):
        assert ours == theirs
