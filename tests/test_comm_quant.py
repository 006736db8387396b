"""Quantized collectives through both APIs (flatshard.CommQuant,
docs/comm_quant.md): the bytes the engine counts per step against the
unquantized run, the loss held over a short training run of a small
transformer LM, HSDP, exact full-precision copies under quantized gathers,
and the option's validation. The kernels and the collectives have their own
tests (test_quant_kernels.py, test_quant_collectives.py)."""
import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard import CommQuant, ConfigError, ConfigTypeError, FSDP
import quant_lm

TIMEOUT = 600
# A job may take TIMEOUT after the pool's start-up (up to 120 s): a deadline
# beyond both (conftest.py), so that the pool's own timeout speaks first.
pytestmark = pytest.mark.deadline(900)
STEPS = 40
CASES = {"off": None, "w8": CommQuant(weights="int8"),
         "w8g4": CommQuant(weights="int8", grads="int4"), "g8": CommQuant(grads="int8")}


def _train_all(api, names, steps, hybrid=False):
    return {n: quant_lm.train(api, CASES[n], steps, hybrid=hybrid) for n in names}


@pytest.fixture(scope="module", params=["fsdp1", "fully_shard"])
def runs(request, dist_pool):
    got = dist_pool(2).run(_train_all, request.param, ["off", "w8", "w8g4"], STEPS,
                           timeout=TIMEOUT)
    assert all(g == got[0] for g in got)  # every rank saw the same mean losses and sizes
    return got[0]


def test_bytes_sent_per_step(runs):
    """counted by the engine: int8 gathers <= 0.27x of fp32 ones; int4
    gradients <= 0.14x; a setting leaves the other collective alone"""
    _, g_off, r_off = runs["off"]
    _, g_w8, r_w8 = runs["w8"]
    _, g_q, r_q = runs["w8g4"]
    assert g_off > 0 and r_off > 0
    assert g_w8 <= 0.27 * g_off and g_q == g_w8
    assert r_w8 == r_off
    assert r_q <= 0.14 * r_off


def test_loss_held(runs):
    off, w8, w8g4 = (runs[k][0][-1] for k in ("off", "w8", "w8g4"))
    assert runs["off"][0][-1] < 0.8 * runs["off"][0][0]  # it learns
    assert abs(w8 - off) <= 0.01 * off, (off, w8)
    assert abs(w8g4 - off) <= 0.02 * off, (off, w8g4)
    assert w8 != off and w8g4 != w8  # the quantization did happen


def _hybrid(api):
    return _train_all(api, ["off", "w8g4"], 10, hybrid=True)


@pytest.mark.parametrize("api", ["fsdp1", "fully_shard"])
def test_hsdp(dist_pool, api):
    """HSDP: the shard group's gathers and reduce-scatters quantized, the
    replicas' all-reduce not"""
    for got in dist_pool(4).run(_hybrid, api, timeout=TIMEOUT):
        (l_off, g_off, r_off), (l_q, g_q, r_q) = got["off"], got["w8g4"]
        assert g_q <= 0.27 * g_off
        assert r_q < r_off
        assert abs(l_q[-1] - l_off[-1]) <= 0.02 * l_off[-1]


def _exact_copies():
    """Under int8 gathers the state dict (full-precision gathers) stays the
    master values bit for bit, before and after a forward left units
    gathered quantized."""
    torch.manual_seed(0)
    want = quant_lm.LM().state_dict()
    model = quant_lm.wrap("fsdp1", CASES["w8g4"])
    first = model.state_dict()
    x = quant_lm.corpus()[:2, :-1]
    with torch.no_grad():
        model(x)
    second = model.state_dict()
    same = [all(torch.equal(sd[k], want[k]) for k in want) for sd in (first, second)]
    # a forward after the state dict computes with quantized weights again
    with torch.no_grad():
        a = model(x)
    plain = quant_lm.wrap("fsdp1", None)
    with torch.no_grad():
        b = plain(x)
    return same, torch.equal(a, b)


def test_full_precision_copies_stay_exact(dist_pool):
    for same, equal in dist_pool(2).run(_exact_copies, timeout=TIMEOUT):
        assert same == [True, True]
        assert not equal


def _errors():
    out = []

    def catch(fn):
        try:
            fn()
            out.append(None)
        except (ConfigError, ConfigTypeError) as e:
            out.append((type(e).__name__, str(e)))

    catch(lambda: FSDP(quant_lm.LM(), comm_quant="int8"))
    catch(lambda: FSDP(quant_lm.LM(), comm_quant=CommQuant(grads="int4"),
                       sharding_strategy=flatshard.ShardingStrategy.NO_SHARD))
    catch(lambda: FSDP(quant_lm.LM(), comm_quant=CommQuant(grads="int8"),
                       sharding_strategy=flatshard.ShardingStrategy.SHARD_OPTIM))
    m = quant_lm.wrap("fully_shard", None)
    catch(lambda: m.set_comm_quant({"weights": "int8"}))
    catch(lambda: m.set_comm_quant(CommQuant(weights="int8"), recurse=1))
    # NO_SHARD with int8 weights only is fine: it gathers nothing
    FSDP(quant_lm.LM(), comm_quant=CommQuant(weights="int8"),
         sharding_strategy=flatshard.ShardingStrategy.NO_SHARD)
    return out


def test_options_are_validated(dist_pool):
    for errs in dist_pool(2).run(_errors, timeout=TIMEOUT):
        assert errs[0][0] == "ConfigTypeError" and "comm_quant" in errs[0][1] and \
            "flatshard.CommQuant or None" in errs[0][1]
        for e, strategy in zip(errs[1:3], ("NO_SHARD", "SHARD_OPTIM")):
            assert e[0] == "ConfigError" and "comm_quant.grads" in e[1] and strategy in e[1]
        assert errs[3][0] == "ConfigTypeError" and "quant got dict" in errs[3][1]
        assert errs[4][0] == "ConfigTypeError" and "recurse" in errs[4][1]


@pytest.mark.parametrize("kw,field,allowed", [
    (dict(weights="int4"), "CommQuant.weights", "None or 'int8'"),
    (dict(weights=8), "CommQuant.weights", "None or 'int8'"),
    (dict(grads="fp8"), "CommQuant.grads", "None, 'int8' or 'int4'"),
    (dict(block_size=48), "CommQuant.block_size", "multiple of 32 up to 4096"),
    (dict(block_size=0), "CommQuant.block_size", "multiple of 32 up to 4096"),
    (dict(block_size=8192), "CommQuant.block_size", "multiple of 32 up to 4096"),
])
def test_comm_quant_fields(kw, field, allowed):
    with pytest.raises(ConfigError) as e:
        CommQuant(**kw)
    assert field in str(e.value) and allowed in str(e.value)
    with pytest.raises(ConfigTypeError, match="block_size got float"):
        CommQuant(block_size=256.0)
    q = CommQuant(weights="int8", grads="int4", block_size=64)
    assert q.engine_args == (8, 4, 64)
    with pytest.raises(Exception):  # frozen
        q.block_size = 32
    assert dist.is_available()
