"""Small models for the end-to-end tests: uneven shapes on purpose (primes,
sizes smaller than the world size, zero-size parameters), nesting, reuse,
buffers, frozen and tied parameters."""
import torch
import torch.nn as nn


class Odd(nn.Module):
    """Parameters of awkward sizes: prime, 1, 3 (< world size 4), and empty."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 13)
        self.back = nn.Linear(13, d)
        self.one = nn.Parameter(torch.randn(1))
        self.three = nn.Parameter(torch.randn(3))
        self.empty = nn.Parameter(torch.randn(0, 4))

    def forward(self, x):
        h = torch.tanh(self.lin(x)) * self.one + self.three.sum() * 0.1
        return x + self.back(h) + self.empty.sum()


class Block(nn.Module):
    def __init__(self, d, inner=False):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = Odd(d)
        self.inner = Inner(d) if inner else None
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, x):
        y = self.ff(self.norm(x)) * (1 + self.scale)
        return self.inner(y) if self.inner is not None else y


class Inner(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return x + 0.5 * self.proj(x)


class Net(nn.Module):
    """Embedding-free MLP net: in -> blocks -> head. Options for the cases."""

    def __init__(self, d=7, depth=3, nested=False, reuse=False, frozen=False, tied=False):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(Block(d, inner=nested and i % 2 == 0) for i in range(depth))
        self.head = nn.Linear(d, 3)
        self.reuse = reuse
        self.tied = tied
        if tied:
            self.out = nn.Linear(d, 5, bias=False)
            self.out.weight = self.inp.weight  # (d, 5) used as (5, d)^T
        if frozen:
            self.inp.weight.requires_grad_(False)
            self.blocks[0].ff.lin.weight.requires_grad_(False)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        if self.reuse:
            h = self.blocks[-1](h)  # the same unit twice in one forward
        y = self.head(h)
        if self.tied:
            y = y + 0.01 * torch.nn.functional.linear(h, self.out.weight.t()).sum(-1, keepdim=True)
        return y


def build(seed=0, **kw):
    torch.manual_seed(seed)
    return Net(**kw)


class MLP(nn.Module):
    """Two Linears with a ReLU between (torch's FSDP2 tests' MLP, small)."""

    def __init__(self, d=8):
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * d)
        self.out_proj = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))
