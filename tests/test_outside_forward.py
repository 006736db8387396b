"""A method other than forward that reads a fully_shard module's
parameters (fsdp2/outside_forward.py): torch's DTensor stops it with an
operator error naming neither module nor fix; flatshard's error names the
method and register_fsdp_forward_method, which then makes it work."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import fsdp as tfsdp

import flatshard
from flatshard.errors import OutsideForwardError
from test_diagnostics import assert_documented

TIMEOUT = 120


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.embed_only(x))

    def embed_only(self, x):  # reads its own parameters directly
        return F.linear(x, self.emb.weight, self.emb.bias)


def _case(which):
    shard, register = ((flatshard.fully_shard, flatshard.register_fsdp_forward_method)
                       if which == "flatshard" else
                       (tfsdp.fully_shard, tfsdp.register_fsdp_forward_method))
    torch.manual_seed(0)
    m = Embedder()
    plain = copy.deepcopy(m)
    shard(m, reshard_after_forward=True)
    x = torch.randn(3, 4)
    m(x)  # trains as usual; resharded after it
    try:
        m.embed_only(x)
        caught = None
    except RuntimeError as e:
        caught = (type(e).__name__, str(e))
    register(m, "embed_only")
    same = torch.equal(m.embed_only(x), plain.embed_only(x))
    return caught, same


def _both():
    return {w: _case(w) for w in ("torch", "flatshard")}


def test_a_method_reading_resharded_parameters_is_named_with_the_fix(dist_pool):
    for r in dist_pool(2).run(_both, timeout=TIMEOUT):
        kind, msg = r["torch"][0]  # torch: the operator's words only
        assert kind == "RuntimeError" and "got mixed torch.Tensor and DTensor" in msg
        assert "embed_only" not in msg and "register_fsdp_forward_method" not in msg
        kind, msg = r["flatshard"][0]
        assert kind == "OutsideForwardError" and issubclass(OutsideForwardError, RuntimeError)
        assert msg.startswith("flatshard: Embedder.embed_only() read the parameters of a "
                              "fully_shard module outside its forward"), msg
        assert "register_fsdp_forward_method(model, 'embed_only')" in msg
        assert "got mixed torch.Tensor and DTensor" in msg  # torch's words kept
        assert_documented("outside-forward", "OutsideForwardError: " + msg)
        assert r["torch"][1] and r["flatshard"][1]  # registered: it gathers, as the plain module


def test_only_the_models_public_methods_are_guarded():
    from flatshard.fsdp2 import FSDPModule
    from flatshard.fsdp2.outside_forward import guarded_methods

    class Child(Embedder):
        def generate(self, x):
            return self.embed_only(x)

        def _helper(self, x):
            return x

        def state_dict(self, *a, **k):  # nn.Module's: left alone
            return super().state_dict(*a, **k)

    assert sorted(guarded_methods(Child, FSDPModule)) == ["embed_only", "generate"]
