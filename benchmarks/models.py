"""Model definitions for benchmarks/bench_core.py.

Each model comes with the module class that is wrapped as one FSDP unit
(`unit_cls`) and a `make_batch(rank)` giving deterministic per-rank inputs,
so every implementation sees identical weights and data.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-LayerNorm GPT block: causal self-attention + 4x MLP."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=1024, seq=128, d_model=256, n_heads=4, n_layers=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.blocks = nn.Sequential(*(Block(d_model, n_heads) for _ in range(n_layers)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos)))


class TinyUnit(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return F.relu(self.fc(x))


class Tiny(nn.Sequential):
    def __init__(self, n_units=64, width=32):
        super().__init__(*(TinyUnit(width) for _ in range(n_units)))


def _gen(rank):
    return torch.Generator().manual_seed(1000 + rank)


def transformer_spec(batch=8, seq=128, vocab=1024):
    def make_batch(rank):
        tokens = torch.randint(vocab, (batch, seq + 1), generator=_gen(rank))
        return tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    return dict(build=lambda: GPT(vocab=vocab, seq=seq), unit_cls=Block,
                make_batch=make_batch, loss_fn=loss_fn)


def tiny64_spec(batch=16, width=32):
    def make_batch(rank):
        g = _gen(rank)
        return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)

    return dict(build=lambda: Tiny(64, width), unit_cls=TinyUnit,
                make_batch=make_batch, loss_fn=F.mse_loss)


MODELS = {"transformer": transformer_spec, "tiny64": tiny64_spec}
