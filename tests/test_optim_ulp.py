"""Every path of the fused CPU optimizer loop (csrc/optim/optim_cpu.c: the
scalar reference and each SIMD level, unrolled and threaded) against the
update evaluated in float64 from the same f32 inputs, within FS_OPTIM_ULP
(csrc/optim/optim.h) ulps, on awkward sizes (0, 1, SIMD widths +- 1, odd
primes) and unaligned views, for AdamW, Adam (L2), amsgrad, maximize and SGD.

An ulp is counted at the scale of each value's terms: the largest magnitude
among what the last operations that make it add up (so that a correctly
rounded sum whose terms cancel is not blamed for the cancellation), carried
through the update as the errors are."""
import itertools
import math

import pytest
import torch

from flatshard import _C, optim as fo

ULP = 6  # FS_OPTIM_ULP in csrc/optim/optim.h
LEVELS = ["scalar", "avx2", "avx512"][:["scalar", "avx2", "avx512"].index(_C.simd_level()) + 1]
VARIANTS = ["scalar.u1.pf0.st.t1.c0"] + [
    f"{s}.u{u}.pf{pf}.nt.{t}" for s, u, pf, t in itertools.product(
        LEVELS[1:], (1, 4), (0, 4096), ("t1.c0", "omp3.c32", "t3.c0"))] + [None]  # None: tuned
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 97, 1031, 4099]
HP = dict(lr=0.01, beta1=0.8, beta2=0.95, eps=1e-6, wd=0.1, step=3)


def _f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


def _ulps(got, want, scale):
    """|got - want| in f32 ulps of `scale` (float64 tensors)."""
    exp = torch.floor(torch.log2(scale.clamp_min(2.0 ** -126)))
    return ((got - want).abs() / torch.exp2(exp - 23)).max().item() if got.numel() else 0.0


def _inputs(n, offset, seed):
    g = torch.Generator().manual_seed(seed)
    p, grad, m = (torch.randn(n + offset, generator=g)[offset:] for _ in range(3))
    v = torch.rand(n + offset, generator=g)[offset:] * 0.1
    mx = v + torch.rand(n + offset, generator=g)[offset:] * 0.05
    return p, grad, m, v, mx


def _adam_f64(p, g, m, v, mx, decoupled, maximize):
    """One step in float64 from the f32 inputs, with the f32 hyperparameters,
    and each value's scale."""
    lr, b1, b2, eps, wd = (_f32(HP[k]) for k in ("lr", "beta1", "beta2", "eps", "wd"))
    p, g, m, v = (t.double() for t in (p, g, m, v))
    g = -g if maximize else g
    g_scale = g.abs()
    if decoupled:
        pd = p * (1 - lr * wd)
    else:
        pd = p
        g_scale = torch.maximum(g.abs(), (wd * p).abs())
        g = g + wd * p
    m_new = m + (1 - b1) * (g - m)
    m_scale = torch.maximum(torch.maximum(m.abs(), ((1 - b1) * (g - m)).abs()), (1 - b1) * g_scale)
    v_new = b2 * v + (1 - b2) * g * g
    v_scale = torch.maximum(v_new, (1 - b2) * g_scale * g_scale)
    vv = torch.maximum(mx.double(), v_new) if mx is not None else v_new
    bc1, bc2 = 1 - b1 ** HP["step"], 1 - b2 ** HP["step"]
    denom = vv.sqrt() / math.sqrt(bc2) + eps
    step_size = lr / bc1
    p_new = pd - step_size * m_new / denom
    p_scale = torch.maximum(pd.abs(), step_size * m_scale / denom)
    return (p_new, p_scale), (m_new, m_scale), (v_new, v_scale)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("decoupled,maximize,amsgrad", [(True, False, False), (False, True, True),
                                                        (False, False, False), (True, False, True)])
def test_adam_paths_are_within_the_ulp_bound_of_float64(variant, decoupled, maximize, amsgrad):
    worst = 0.0
    for n, offset in itertools.product(SIZES, (0, 3)):
        p, g, m, v, mx = _inputs(n, offset, n + offset)
        want = _adam_f64(p, g, m, v, mx if amsgrad else None, decoupled, maximize)
        fo.adamw_step_(p, g, m, v, HP["step"], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                       eps=HP["eps"], weight_decay=HP["wd"], decoupled=decoupled,
                       maximize=maximize, max_exp_avg_sq=mx if amsgrad else None, threads=3,
                       variant=variant)
        for got, (ref, scale) in zip((p, m, v), want):
            worst = max(worst, _ulps(got.double(), ref, scale))
    assert worst <= ULP, f"{variant}: {worst:.2f} ulps"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("nesterov,wd", [(False, 0.0), (True, 0.01), (False, 0.01)])
def test_sgd_paths_are_within_the_ulp_bound_of_float64(variant, nesterov, wd):
    lr, mom, damp = _f32(0.05), _f32(0.9), 1 - _f32(0.0 if nesterov else 0.1)
    wd32 = _f32(wd)
    worst = 0.0
    for n, offset in itertools.product(SIZES, (0, 3)):
        p, g, buf, _, _ = _inputs(n, offset, n + offset)
        pd, gd, bd = p.double(), g.double(), buf.double()
        g2 = gd + wd32 * pd
        g_scale = torch.maximum(gd.abs(), (wd32 * pd).abs())
        b_new = mom * bd + damp * g2
        b_scale = torch.maximum((mom * bd).abs(), damp * g_scale)
        upd = g2 + mom * b_new if nesterov else b_new
        u_scale = torch.maximum(g_scale, mom * b_scale) if nesterov else b_scale
        p_new = pd - lr * upd
        p_scale = torch.maximum(pd.abs(), lr * u_scale)
        _C.sgd_step(p.data_ptr(), g.data_ptr(), buf.data_ptr(), 0, _C.BF16, n, lr=0.05,
                    momentum=0.9, dampening=0.0 if nesterov else 0.1, weight_decay=wd,
                    nesterov=nesterov, maximize=False, first_step=False, threads=3,
                    variant=variant)
        worst = max(worst, _ulps(p.double(), p_new, p_scale), _ulps(buf.double(), b_new, b_scale))
    assert worst <= ULP, f"{variant}: {worst:.2f} ulps"
