"""A small transformer language model trained on a fixed synthetic corpus,
through either API, with or without quantized collectives: what
tests/test_comm_quant.py holds for a short run and benchmarks/bench_quant.py
runs for 300 steps. Call train() on every rank of an initialised default
process group (gloo); every rank returns the same losses (the mean over
ranks of each step's loss)."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flatshard

VOCAB, SEQ, D, HEADS, LAYERS = 96, 32, 64, 4, 2


def corpus(n_seq=4096, seed=0):
    """n_seq sequences of a fixed random Markov chain over VOCAB tokens
    (each token has 4 equally likely successors): learnable down to the
    chain's entropy, log(4) = 1.386 nats a token, never memorised (300
    steps of 8 sequences do not come back to one), identical on every rank
    and every run."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    seqs = torch.empty(n_seq, SEQ + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, VOCAB, (n_seq,), generator=g)
    for t in range(SEQ):
        pick = torch.randint(0, 4, (n_seq,), generator=g)
        seqs[:, t + 1] = succ[seqs[:, t], pick]
    return seqs


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.02)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos)))


def wrap(api, quant, backend=None, hybrid=False):
    """The LM wrapped by `api` ("fsdp1" or "fully_shard"), each block a unit,
    quantized as `quant` says; hybrid: HSDP over a (2, world / 2) mesh."""
    torch.manual_seed(0)
    model = LM()
    mesh = None
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                                mesh_dim_names=("replicate", "shard"))
    if api == "fsdp1":
        kw = dict(device_mesh=mesh, sharding_strategy=flatshard.ShardingStrategy.HYBRID_SHARD) \
            if hybrid else {}
        return flatshard.FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                              comm_quant=quant, comm_backend=backend, **kw)
    for b in model.blocks:
        flatshard.fully_shard(b, mesh=mesh)
    flatshard.fully_shard(model, mesh=mesh)
    model.set_comm_quant(quant)
    return model


def train(api, quant, steps, batch=8, lr=3e-3, backend=None, hybrid=False):
    """-> (losses, bytes sent by gathers per step, by reductions per step),
    the bytes this rank's engine counted over the last step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = wrap(api, quant, backend, hybrid)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = corpus()
    per = batch // world
    losses, sent = [], (0, 0)
    for step in range(steps):
        lo = (step * batch) % data.shape[0]
        x = data[lo + rank * per:lo + (rank + 1) * per]
        before = flatshard.memory_stats(model)
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        after = flatshard.memory_stats(model)
        sent = (after["sent_gather"] - before["sent_gather"],
                after["sent_reduce"] - before["sent_reduce"])
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses, sent[0], sent[1]
