"""The planner's accounting of quantized collectives (flatshard.CommQuant):
communication per step with the payloads' bytes per value, and the staging
line of the largest unit's quantized gather or reduction, each against the
arithmetic of csrc/core/quant.h done here independently."""
import pytest

from flatshard import CommQuant
from flatshard.plan import plan
from flatshard.plan.units import flat_layout, units_from_count

P, W, L = 10_000_000, 8, 4


def test_comm_bytes_follow_the_payloads():
    off = plan(params=P, world_size=W, layers=L)
    w8 = plan(params=P, world_size=W, layers=L, comm_quant=CommQuant(weights="int8"))
    both = plan(params=P, world_size=W, layers=L,
                comm_quant=CommQuant(weights="int8", grads="int4", block_size=128))
    units = units_from_count(P, L, 4)
    r, psi, root = (W - 1) / W, P, units[-1].numel
    gathered = 2 * (psi - root) + root
    assert off.comm_bytes == int(r * (gathered * 4 + psi * 4))
    assert w8.comm_bytes == int(r * (gathered * (1 + 4 / 256) + psi * 4))
    assert both.comm_bytes == int(r * (gathered * (1 + 4 / 128) + psi * (0.5 + 4 / 128)))
    assert "comm_quant" in w8.comm_formula and "int4" in both.comm_formula
    assert off["comm_quant"] == 0 and not [ln for ln in off.lines if ln.key == "comm_quant"]


def test_staging_line():
    q = CommQuant(weights="int8", grads="int8", block_size=64)
    p = plan(params=P, world_size=W, layers=L, comm_quant=q)
    # the largest unit's buffer, laid out as the engine lays it (csrc/core/layout.c)
    shard, padded = max(flat_layout(g.numels, 4, W) for u in units_from_count(P, L, 4)
                        for g in u.groups)
    per = 1 + 4 / 64
    assert p["comm_quant"] == int(2 * padded * per)  # float32 reduction: no extra sum buffer
    bf = plan(params=P, world_size=W, layers=L, comm_quant=q, reduce_dtype="bf16",
              mixed_precision="bf16")
    assert bf["comm_quant"] == int(2 * padded * per + 4 * shard)


def test_hybrid_keeps_the_replicas_all_reduce():
    q = CommQuant(grads="int4")
    a = plan(params=P, world_size=W, layers=L, strategy="HYBRID_SHARD", hybrid_group=4)
    b = plan(params=P, world_size=W, layers=L, strategy="HYBRID_SHARD", hybrid_group=4,
             comm_quant=q)
    across = 2 * (2 - 1) / 2 * P / 4 * 4  # the all-reduce of the shard over 2 groups
    within = a.comm_bytes - across
    assert b.comm_bytes == pytest.approx(within - 3 / 4 * P * (4 - 0.5 - 4 / 256) + across,
                                         abs=2)


def test_bad_comm_quant():
    with pytest.raises(Exception, match="comm_quant got str"):
        plan(params=P, world_size=W, comm_quant="int8")
