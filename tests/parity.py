"""Run inside each rank: train a flatshard-wrapped model and the same model in
plain torch (one process, whole batch) side by side and report the largest
differences in losses and in parameters (this rank's pieces against the
matching slices of the reference).

Tolerance (stated once, used by every parity test): fp32 losses and
parameters agree to 2e-6 relative, with an absolute floor of 2e-6 times the
largest magnitude in the same tensor (elements near zero carry the rounding
of their larger neighbours). The only difference between the two
computations is the order of floating-point sums (per-rank batch means, the
gradient average, accumulation across micro-batches)."""
import functools
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
import flatshard.optim
from flatshard import FSDP, ShardingStrategy
from toy_models import Block, Inner, build

RTOL, ATOL = 2e-6, 1e-7
SCALE_ATOL = 2e-6


def optimizer(name, params):
    """The optimizer for flatshard's model; the reference gets torch's version
    of the same ("fs_*": flatshard.optim's fused C optimizers)."""
    if name == "fs_adamw":
        return flatshard.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    if name == "fs_sgd":
        return flatshard.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True,
                                   weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def batches(steps, per_rank, world, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(per_rank * world, 5, generator=g),
             torch.randn(per_rank * world, 3, generator=g)) for _ in range(steps)]


def policy(kind):
    from torch.distributed.fsdp import wrap as tw
    return {
        "none": None,
        "blocks": tw.ModuleWrapPolicy({Block}),
        "nested": tw.ModuleWrapPolicy({Block, Inner}),
        "fs_blocks": flatshard.ModuleWrapPolicy({Block}),
        "transformer": functools.partial(tw.transformer_auto_wrap_policy,
                                         transformer_layer_cls={Block}),
        "size": functools.partial(tw.size_based_auto_wrap_policy, min_num_params=150),
        "lambda": functools.partial(tw.lambda_auto_wrap_policy,
                                    lambda_fn=lambda m: isinstance(m, Inner)),
        "custom": tw.CustomPolicy(lambda m: isinstance(m, Block)),
        "fs_custom": flatshard.CustomPolicy(
            lambda m: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
            if isinstance(m, Inner) else isinstance(m, Block)),
    }[kind]


def train_steps(model, opt, data):
    """Train on (x, y) batches, each rank on its 2 rows; returns the local losses."""
    rank = dist.get_rank()
    losses = []
    for x, y in data:
        loss = ((model(x[2 * rank:2 * rank + 2]) - y[2 * rank:2 * rank + 2]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def local_pieces(model):
    """fqn -> (offset into the flattened parameter, this rank's piece)."""
    out = {}
    for m in model.modules():
        if isinstance(m, FSDP):
            for g in m._unit.groups:
                for i, aliases in enumerate(g.aliases):
                    e = g.entries[i]
                    piece = g.shard.detach().narrow(0, e[2], e[4])
                    for a in aliases:
                        out[a.fqn] = (e[3], piece)
    return out


def compare_params(model, ref):
    """Asserts the tolerance; returns (largest difference over the scale of its
    tensor, number of parameters compared)."""
    worst = 0.0
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    pieces = local_pieces(model)
    assert set(pieces) <= set(ref_params), set(pieces) - set(ref_params)
    for fqn, (off, piece) in pieces.items():
        want = ref_params[fqn].detach().reshape(-1)[off:off + piece.numel()]
        scale = ref_params[fqn].detach().abs().max().item() if want.numel() else 0.0
        atol = max(ATOL, SCALE_ATOL * scale)
        torch.testing.assert_close(piece, want, rtol=RTOL, atol=atol, msg=lambda m: f"{fqn}: {m}")
        if piece.numel() and scale:
            worst = max(worst, (piece - want).abs().max().item() / scale)
    return worst, len(pieces)


def run_case(strategy="FULL_SHARD", opt="adamw", wrap="blocks", use_orig_params=False,
             steps=4, model_kw=None, microbatches=1, no_sync=False, eval_every=False,
             forwards=1, backward_prefetch="BACKWARD_PRE", forward_prefetch=False,
             comm_backend=None, clip=None, norm_type=2.0):
    rank, world = dist.get_rank(), dist.get_world_size()
    model_kw = model_kw or {}
    ref = build(**model_kw)
    fs = FSDP(build(**model_kw), sharding_strategy=ShardingStrategy[strategy],
              auto_wrap_policy=policy(wrap), use_orig_params=use_orig_params,
              device_id=torch.device("cpu"),
              backward_prefetch=getattr(flatshard.BackwardPrefetch, backward_prefetch)
              if backward_prefetch else None, forward_prefetch=forward_prefetch,
              comm_backend=comm_backend)
    o_fs = optimizer(opt, fs.parameters())
    o_ref = optimizer(opt.replace("fs_", ""), [p for p in ref.parameters() if p.requires_grad])
    per_rank = 2
    losses = []
    data = batches(steps * microbatches * forwards, per_rank, world)
    it = iter(data)
    for step in range(steps):
        for mb in range(microbatches):
            ctx = fs.no_sync() if (no_sync and mb < microbatches - 1) else nullcontext()
            with ctx:
                loss_fs = 0.0
                loss_ref = 0.0
                for _ in range(forwards):
                    x, y = next(it)
                    xs = x[rank * per_rank:(rank + 1) * per_rank]
                    ys = y[rank * per_rank:(rank + 1) * per_rank]
                    loss_fs = loss_fs + ((fs(xs) - ys) ** 2).mean()
                    loss_ref = loss_ref + ((ref(x) - y) ** 2).mean()
                loss_fs.backward()
                loss_ref.backward()
            l = loss_fs.detach().clone()
            dist.all_reduce(l)
            losses.append(((l / world).item(), loss_ref.item()))
        if clip is not None:
            n_fs = fs.clip_grad_norm_(clip, norm_type)
            # (torch refuses an inf-norm over its empty parameter: leave it out)
            n_ref = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.numel()],
                                                   clip, norm_type)
            assert abs(n_fs.item() - n_ref.item()) <= 1e-5 * n_ref.item(), (n_fs, n_ref)
        o_fs.step()
        o_ref.step()
        o_fs.zero_grad()
        o_ref.zero_grad()
        if eval_every:
            fs.eval()
            ref.eval()
            with torch.no_grad():
                x, _ = data[0]
                out = fs(x[rank * per_rank:(rank + 1) * per_rank])
                want = ref(x)[rank * per_rank:(rank + 1) * per_rank]
                torch.testing.assert_close(out, want, rtol=RTOL * 5, atol=ATOL * 10)
            fs.train()
            ref.train()
    for a, b in losses:
        assert abs(a - b) <= ATOL + RTOL * abs(b) * 5, losses
    worst, n = compare_params(fs, ref)
    stats = flatshard.memory_stats(fs, o_fs)
    units = [m._unit.name for m in fs.modules() if isinstance(m, FSDP)]
    return {"backend": fs._unit.c.comm.backend, "losses": losses, "worst_rel": worst,
            "n_params": n, "memory": stats, "units": units,
            "states": [m._unit.c.state for m in fs.modules() if isinstance(m, FSDP)]}
