"""Fused CPU optimizers (csrc/optim/optim_cpu.c, flatshard.optim): kernels against
the scalar path, the optimizers against torch's on awkward sizes and options,
state_dict compatibility both ways, and training on flat shards."""
import copy

import pytest
import torch

from flatshard import _C, ConfigError, NotBuiltError, optim as fo
from parity import run_case

SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 97, 1031, (1 << 16) * 2 + 13]
# every SIMD level this CPU has, the reference first
LEVELS = ["scalar", "avx2", "avx512"][:["scalar", "avx2", "avx512"].index(_C.simd_level()) + 1]


def _buffers(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(4)] + [torch.rand(n, generator=g)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("decoupled,maximize,amsgrad,copy",
                         [(True, False, False, None), (False, True, True, torch.bfloat16),
                          (True, False, True, torch.float16), (False, False, False, None)])
def test_adam_kernel_simd_and_threads_match_scalar(n, decoupled, maximize, amsgrad, copy):
    outs = []
    for simd, threads in [(level, 1) for level in LEVELS] + [("auto", 2)]:
        p, grad, m, mx, v = _buffers(n, n)
        mx = mx.abs() if amsgrad else None
        out = torch.empty(n, dtype=copy) if copy else None
        for step in (1, 2, 3):
            fo.adamw_step_(p, grad, m, v, step, lr=0.01, betas=(0.8, 0.95), eps=1e-6,
                           weight_decay=0.1, decoupled=decoupled, maximize=maximize,
                           max_exp_avg_sq=mx, out_copy=out, threads=threads, simd=simd)
        if copy:
            assert torch.equal(out, p.to(copy))  # the copy is the updated parameter, rounded
        outs.append((p, m, v))
    for p, m, v in outs[1:]:  # same bits on every path: same ops, same order, no FMA
        assert torch.equal(p, outs[0][0]) and torch.equal(m, outs[0][1]) and \
            torch.equal(v, outs[0][2])


CASES = [
    (fo.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (fo.AdamW, torch.optim.AdamW, dict(lr=3e-3, betas=(0.8, 0.9), eps=1e-6, amsgrad=True)),
    (fo.AdamW, torch.optim.AdamW, dict(lr=1e-2, maximize=True)),
    (fo.Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (fo.Adam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    (fo.SGD, torch.optim.SGD, dict(lr=0.05)),
    (fo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (fo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
]


def _step_both(oa, ob, a, b, steps):
    """`steps` steps of both optimizers on the same random gradients."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=g)
            y.grad = x.grad.clone()
        oa.step()
        ob.step()


@pytest.mark.parametrize("ours,theirs,kw", CASES)
def test_optimizers_match_torch_over_many_steps(ours, theirs, kw):
    torch.manual_seed(0)
    shapes = [(0,), (1,), (7,), (3, 5), (97,), (17, 33)]
    a = [torch.randn(s) for s in shapes]
    b = [t.clone() for t in a]
    oa, ob = ours(a, **kw), theirs(b, **kw)
    _step_both(oa, ob, a, b, 60)
    for x, y in zip(a, b):  # 1e-6 of each tensor's scale after 60 steps
        scale = max(y.abs().max().item(), 1e-3) if y.numel() else 1.0
        assert (x - y).abs().max().item() <= 1e-6 * scale if y.numel() else True
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for k in sb["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys()


@pytest.mark.parametrize("ours,theirs,kw,names", [
    (fo.AdamW, torch.optim.AdamW, dict(lr=1e-3, amsgrad=True),
     ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    (fo.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9), ("momentum_buffer",)),
])
def test_large_host_state_lives_in_its_own_mapping(ours, theirs, kw, names, tmp_path):
    """[Note: state in huge pages]: the state of a parameter of 2 MiB and more
    is a zero-filled mapping of its own (aligned to 2 MiB), smaller state is
    torch's; the steps still match torch's, and the state saves and loads."""
    torch.manual_seed(0)
    big, small = torch.randn(3, 1 << 18), torch.randn(100)  # 3 MiB and 400 B
    a = [big.clone(), small.clone()]
    b = [big.clone(), small.clone()]
    oa, ob = ours(a, **kw), theirs(b, **kw)
    _step_both(oa, ob, a, b, 3)
    for name in names:
        t = oa.state[a[0]][name]
        assert t.shape == big.shape and t.is_contiguous() and t.dtype == torch.float32
        assert t.data_ptr() % (2 << 20) == 0  # a mapping of its own, huge-page aligned
        # (FMA rounds differently from torch: within an ulp of the terms, ~1e-6)
        assert torch.allclose(t, ob.state[b[0]][name], rtol=1e-5, atol=1e-6)
    for x, y in zip(a, b):
        assert (x - y).abs().max().item() <= 1e-6 * y.abs().max().item()
    torch.save(oa.state_dict(), tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    for name in names:
        assert torch.equal(loaded["state"][0][name], oa.state[a[0]][name])


@pytest.mark.parametrize("threads", [1, 2, 3, 64, 65])
def test_mapped_state_is_zero_and_whole_on_any_thread_count(threads):
    """[Note: state populated in parallel]: each thread populates its slice
    (huge pages, or plain ones after a stall); whatever the split (threads
    beyond the count of 2 MiB chunks, beyond the cap), every byte is there
    and zero, and writable."""
    mib = 1 << 20
    for n in [2 * mib - 1, 2 * mib, 2 * mib + 1, 7 * mib + 4093, 33 * mib]:
        s = _C.mapped_storage(n, threads=threads)
        t = torch.empty(0, dtype=torch.uint8).set_(s)
        assert s.nbytes() == n and t.data_ptr() % (2 * mib) == 0
        assert t.count_nonzero().item() == 0
        t[::4093] = 7
        assert t.sum().item() == 7 * len(range(0, n, 4093))
        del t, s
    with pytest.raises(ValueError, match="threads must be >= 1"):
        _C.mapped_storage(4 * mib, threads=0)


@pytest.mark.parametrize("ours,theirs,kw", [CASES[0], CASES[6]])
def test_state_dict_moves_between_torch_and_flatshard(ours, theirs, kw):
    torch.manual_seed(0)
    p_t = [torch.randn(33)]
    opt_t = theirs(p_t, **kw)
    for _ in range(5):
        p_t[0].grad = torch.randn(33)
        opt_t.step()
    p_f = [p_t[0].clone()]
    opt_f = ours(p_f, **kw)
    # Resume torch's run in flatshard (a copy: loading shares matching tensors).
    opt_f.load_state_dict(copy.deepcopy(opt_t.state_dict()))
    for _ in range(5):
        grad = torch.randn(33)
        p_t[0].grad, p_f[0].grad = grad, grad.clone()
        opt_t.step()
        opt_f.step()
    assert (p_f[0] - p_t[0]).abs().max() <= 1e-6 * p_t[0].abs().max()
    back = theirs([p_f[0].clone()], **kw)
    back.load_state_dict(opt_f.state_dict())  # and back
    assert back.state_dict()["state"].keys() == opt_t.state_dict()["state"].keys()


@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_group_steps_in_one_engine_call_with_the_functional_bits(amsgrad):
    """step() hands a param group's host parameters to one _C.adam_steps call
    (the C side increments each step count); every parameter gets the bits
    of its own adamw_step_, also one whose state is not the plain layout
    (a float64 step count: stepped on its own) beside them."""
    torch.manual_seed(0)
    shapes = [(0,), (1,), (33,), (17, 5), (1 << 12,), (3, 1000)]
    ps = [torch.randn(s) for s in shapes]
    ref = [p.clone() for p in ps]
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    opt = fo.AdamW(ps, amsgrad=amsgrad, **kw)
    states = [[torch.zeros(s) for _ in range(3)] for s in shapes]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 6):
        for p, r in zip(ps, ref):
            p.grad = torch.randn(p.shape, generator=g)
            r.grad = p.grad.clone()
        if step == 3:  # one state as a loaded one may be: its count a float64
            opt.state[ps[2]]["step"] = opt.state[ps[2]]["step"].double()
        opt.step()
        for r, (m, v, mx) in zip(ref, states):
            fo.adamw_step_(r.view(-1), r.grad.view(-1), m.view(-1), v.view(-1), step, **kw,
                           max_exp_avg_sq=mx.view(-1) if amsgrad else None)
    for p, r, (m, v, _) in zip(ps, ref, states):
        assert torch.equal(p, r)
        assert torch.equal(opt.state[p]["exp_avg"], m)
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)
        assert opt.state[p]["step"].item() == 5


def test_a_group_call_checks_every_job_before_it_runs_any():
    p, m, v = torch.randn(8), torch.zeros(8), torch.zeros(8)
    step, before = torch.tensor(0.0), p.clone()
    good = (p.data_ptr(), p.data_ptr(), m.data_ptr(), v.data_ptr(), 0, step.data_ptr(), 8)
    for bad, word in [(good[:5] + (0, 8), "job 1"), (good[:6] + (-1,), "job 1"),
                      (good[:6], "each job")]:
        with pytest.raises((ValueError, TypeError), match=word):
            _C.adam_steps([good, bad], lr=1e-3)
        assert step.item() == 0 and torch.equal(p, before)
    wrong = {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(8), "step": torch.tensor(0.0)}
    p.grad = torch.zeros(8)
    opt = fo.AdamW([p])
    opt.state[p] = wrong  # a state of another size: the per-parameter checks name it
    with pytest.raises(ConfigError, match="exp_avg.*expected 8 elements"):
        opt.step()


def test_sgd_group_steps_in_one_engine_call_and_checks_a_loaded_buffer():
    """SGD's group call gives every parameter the bits of its own
    _C.sgd_step; a momentum buffer of another size (a state dict loaded for
    another model) is refused by name before anything is written."""
    torch.manual_seed(0)
    shapes = [(0,), (1,), (33,), (17, 5), (3, 1000)]
    ps = [torch.randn(s) for s in shapes]
    ref = [p.clone() for p in ps]
    bufs = [torch.zeros(s) for s in shapes]
    kw = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)
    opt = fo.SGD(ps, **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        for p, r in zip(ps, ref):
            p.grad = torch.randn(p.shape, generator=g)
            r.grad = p.grad.clone()
        opt.step()
        for r, b in zip(ref, bufs):
            _C.sgd_step(r.data_ptr(), r.grad.data_ptr(), b.data_ptr(), 0, _C.BF16, r.numel(),
                        **kw, nesterov=False, maximize=False, first_step=step == 0)
    for p, r, b in zip(ps, ref, bufs):
        assert torch.equal(p, r) and torch.equal(opt.state[p]["momentum_buffer"], b)
    opt.state[ps[2]]["momentum_buffer"] = torch.zeros(5)
    before = [p.clone() for p in ps]
    with pytest.raises(ConfigError, match="group 0 momentum_buffer 2.*33 elements"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))


def test_bad_arguments_are_named():
    p = [torch.zeros(3)]
    for make, word in [(lambda: fo.AdamW(p, lr=-1.0), "lr"),
                       (lambda: fo.AdamW(p, betas=(0.9, 1.0)), "betas"),
                       (lambda: fo.AdamW(p, betas=0.9), "betas"),
                       (lambda: fo.Adam(p, amsgrad=1), "amsgrad"),
                       (lambda: fo.AdamW(p, threads=0), "threads"),
                       (lambda: fo.AdamW(p, lr=torch.tensor(0.1)), "lr"),
                       (lambda: fo.SGD(p, nesterov=True), "nesterov"),
                       (lambda: fo.SGD(p, momentum=-0.5), "momentum")]:
        with pytest.raises(ConfigError, match=word):
            make()


def test_unsupported_tensors_are_refused_by_name():
    p = torch.zeros(4, dtype=torch.float64)
    p.grad = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(TypeError, match="group 0 parameter 0.*float64"):
        fo.AdamW([p]).step()
    q = torch.zeros(4, 4)
    q.grad = torch.zeros(4, 4).t()
    with pytest.raises(TypeError, match="non-contiguous"):
        fo.SGD([q], lr=0.1).step()


@pytest.mark.parametrize("make", [lambda ps: fo.AdamW(ps), lambda ps: fo.Adam(ps, amsgrad=True),
                                  lambda ps: fo.SGD(ps, lr=0.1, momentum=0.9)],
                         ids=["adamw", "adam_amsgrad", "sgd"])
def test_a_gradient_gone_bad_after_the_first_step_is_refused_by_name(make):
    """The per-step checks (one cheap pass over each tensor's attributes,
    the message built only when it fails) still name a gradient that turns
    bad once the state exists, and refuse it before any parameter is
    written."""
    ps = [torch.randn(8), torch.randn(3, 4)]
    opt = make(ps)
    for p in ps:
        p.grad = torch.randn(p.shape)
    opt.step()
    before = [p.clone() for p in ps]
    for bad, err, word in [(torch.zeros(4, 3).t(), TypeError, "gradient 1.*non-contiguous"),
                           (torch.zeros(3, 4).to_sparse(), NotBuiltError,
                            "gradient 1 has layout torch.sparse_coo")]:
        ps[1].grad = bad
        with pytest.raises(err, match="group 0 " + word):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(ps, before))
    ps[1].grad = torch.ones(3, 4)
    opt.step()  # good again: steps as before
    assert not any(torch.equal(p, b) for p, b in zip(ps, before))


@pytest.mark.parametrize("opt", ["fs_adamw", "fs_sgd"])
@pytest.mark.parametrize("use_orig", [False, True])
def test_training_on_flat_shards_matches_plain_torch(dist_pool, opt, use_orig):
    dist_pool(2).run(run_case, opt=opt, use_orig_params=use_orig, steps=5)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.5])
@pytest.mark.parametrize("use_orig", [False, True])
def test_clip_grad_norm_matches_plain_torch(dist_pool, strategy, norm_type, use_orig):
    # max_norm small enough that every step clips; norms compared each step.
    dist_pool(4).run(run_case, strategy=strategy, opt="sgd", clip=0.05, norm_type=norm_type,
                     use_orig_params=use_orig, model_kw={"frozen": True}, steps=3)


def _clip_with_ignored_module():
    import torch.distributed as dist
    from flatshard import FSDP
    from toy_models import build
    torch.manual_seed(0)
    model = build()
    fs = FSDP(model, ignored_modules=[model.head], use_orig_params=True)
    fs(torch.ones(2, 5)).sum().backward()  # same input on every rank: ignored grads agree
    ref = build()
    ref(torch.ones(2, 5)).sum().backward()
    got = fs.clip_grad_norm_(1e-3).item()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3).item()
    return abs(got - want) / want


def test_clip_grad_norm_counts_unsharded_parameters_once(dist_pool):
    assert max(dist_pool(2).run(_clip_with_ignored_module)) < 1e-6


def test_simd_level_names_are_checked():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="simd='avx1024': expected 'auto', 'scalar', 'avx2' or "
                                         "'avx512'"):
        _C.adam_step(*(p.data_ptr(),) * 4, 0, 0, _C.BF16, 4, simd="avx1024")
    if _C.simd_level() != "avx512":
        with pytest.raises(ValueError, match="this CPU lacks it"):
            _C.adam_step(*(p.data_ptr(),) * 4, 0, 0, _C.BF16, 4, simd="avx512")
