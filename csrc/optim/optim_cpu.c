/* optim_cpu.c - see optim.h. The kernels (scalar reference, AVX2, AVX-512)
 * of Adam/AdamW and SGD, each runnable in every variant of fs_optim_variant,
 * and the thread split. Which variant runs is decided in optim_tune.c, not
 * here. */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include "optim.h"

#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FS_X86 1
#endif

/* [Note: one formula]
 * Every path computes each element with one formula, written out in
 * adam_scalar and sgd_scalar: the same f32 operations in the same order,
 * each multiply-add a fused one (fmaf in the scalar loop, vfmadd in the
 * vector loops: one rounding instead of two, and one instruction). sqrt and
 * divide are correctly rounded on every path, and so is an FMA, so the
 * vector loops give the scalar loop's bits; the build is ISO C, so the
 * compiler adds no contraction of its own. bf16 rounding is on integers as
 * fs_f32_to_bf16, and the scalar loop finishes whatever a vector loop leaves
 * (tails, alignment peels). Variants only change which instructions move the
 * bytes and which thread updates which element. The tests hold every path to
 * a float64 evaluation of the update within a stated bound (FS_OPTIM_ULP
 * below), and to the scalar loop's bits; nothing else relies on the bits. A
 * faster path that rounds differently (an approximate reciprocal, say) would
 * only have to meet the first. The CUDA kernel (csrc/cuda/optim.cu) writes
 * the same formula. */

/* [Note: local copies]
 * Each vector kernel copies the job's buffer pointers and hyperparameters
 * into locals before its loop. The intrinsics store through vector types
 * that may alias anything, so reading them through the job instead makes
 * the compiler reload every pointer and flag after every store: 8 more loads
 * and their address arithmetic per 16 elements, which cost 8% of the AdamW
 * step at 2^24 (CPU time per element, 2 threads, EPYC Zen 4), where the loop
 * is close to bound by its sqrt and divide as much as by memory. Both vector
 * Adam kernels also run AdamW without maximize or amsgrad as a loop of its
 * own, with those flags constants, and both write the half copy a 32- or
 * 64-byte store at a time, rounding two vectors with one pack (on AVX2,
 * EPYC Zen 3, both made the steps at 2^24 faster: benchmarks/results/optim.md,
 * "AMD EPYC (Zen 3, AVX2 only)"). */

static inline void store_copy(void *copy, fs_dtype t, int64_t i, float v)
{
    if (t == FS_BF16)
        ((uint16_t *)copy)[i] = fs_f32_to_bf16(v);
    else
        ((uint16_t *)copy)[i] = fs_f32_to_f16(v);
}

/* ---------------------------------------------------------------------------
 * Adam / AdamW: scalar reference */

typedef struct {
    float step_size, inv_bc2_sqrt, decay; /* derived once per step */
} adam_consts;

static adam_consts adam_derive(const fs_adam_hparams *h)
{
    adam_consts k;
    double bc1 = 1.0 - pow(h->beta1, (double)h->step);
    double bc2 = 1.0 - pow(h->beta2, (double)h->step);
    k.step_size = (float)(h->lr / bc1);
    /* A multiply instead of torch's divide: one division per element left,
     * which keeps the loop at memory speed (differences ~1 ulp). */
    k.inv_bc2_sqrt = (float)(1.0 / sqrt(bc2));
    k.decay = 1.0f - h->lr * h->weight_decay;
    return k;
}

static void adam_scalar(const fs_adam_buffers *b, const fs_adam_hparams *h, const adam_consts *k,
                        int64_t lo, int64_t hi)
{
    const float b1c = 1.0f - h->beta1, b2 = h->beta2, b2c = 1.0f - h->beta2;
    for (int64_t i = lo; i < hi; i++) {
        float g = h->maximize ? -b->grad[i] : b->grad[i];
        float p = b->param[i];
        if (h->decoupled)
            p *= k->decay;
        else if (h->weight_decay != 0.0f)
            g = fmaf(h->weight_decay, p, g);
        float m = b->exp_avg[i];
        m = fmaf(b1c, g - m, m); /* torch's lerp: m + b1c * (g - m) */
        float v = fmaf(b2, b->exp_avg_sq[i], b2c * g * g);
        b->exp_avg[i] = m;
        b->exp_avg_sq[i] = v;
        if (b->max_exp_avg_sq) {
            v = fmaxf(b->max_exp_avg_sq[i], v);
            b->max_exp_avg_sq[i] = v;
        }
        float denom = fmaf(sqrtf(v), k->inv_bc2_sqrt, h->eps);
        p = fmaf(-k->step_size, m / denom, p);
        b->param[i] = p;
        if (b->copy)
            store_copy(b->copy, b->copy_dtype, i, p);
    }
}

/* ---------------------------------------------------------------------------
 * SGD: scalar reference */

static void sgd_scalar(const fs_sgd_buffers *b, const fs_sgd_hparams *h, int64_t lo, int64_t hi)
{
    const float damp = 1.0f - h->dampening;
    for (int64_t i = lo; i < hi; i++) {
        float g = h->maximize ? -b->grad[i] : b->grad[i];
        float p = b->param[i];
        if (h->weight_decay != 0.0f)
            g = fmaf(h->weight_decay, p, g);
        if (b->momentum_buf) {
            float buf = h->first_step ? g : fmaf(h->momentum, b->momentum_buf[i], damp * g);
            b->momentum_buf[i] = buf;
            g = h->nesterov ? fmaf(h->momentum, buf, g) : buf;
        }
        p = fmaf(-h->lr, g, p);
        b->param[i] = p;
        if (b->copy)
            store_copy(b->copy, b->copy_dtype, i, p);
    }
}

/* What one range of a step needs, shared by its threads. */
typedef struct {
    const fs_optim_job *job;
    adam_consts k;
    fs_optim_variant v;
    int stream;    /* non-temporal copy stores in effect (variant asks and there is a copy) */
    int bf16_insn; /* the AVX-512 kernels round a bf16 copy with vcvtneps2bf16 (the variant
                    * asks, the CPU has it, the copy is bf16) */
} range_ctx;

#ifdef FS_X86
#define FS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FS_AVX512 __attribute__((target("avx512f,avx512bw,fma")))
#define FS_INLINE static inline __attribute__((always_inline))
#define FS_PF(ptr, i) _mm_prefetch((const char *)((ptr) + (i)), _MM_HINT_T0)

/* The unrolled loop over [i, hi) of every vector kernel, W lanes of vector
 * type VT: UPDATE(i) updates W elements and returns their parameters,
 * PREFETCH(j) fetches a line (16 floats) of each stream at element j, COPY2
 * stores the copy of two vectors (one 32- or 64-byte store), COPY1 of one
 * (the last step). Needs x, lo, i, hi, ahead, copy, ct and st in scope. */
#define FS_LOOP(VT, W, UPDATE, PREFETCH, COPY1, COPY2)                                      \
    do {                                                                                   \
        if (x->v.unroll >= 4)                                                              \
            FS_BLOCKS(VT, W, 4, UPDATE, PREFETCH, COPY2);                                  \
        if (x->v.unroll >= 2)                                                              \
            FS_BLOCKS(VT, W, 2, UPDATE, PREFETCH, COPY2);                                  \
        for (; i + (W) <= hi; i += (W)) {                                                  \
            if (ahead && ((i - lo) & 15) == 0)                                             \
                PREFETCH(i + ahead);                                                       \
            VT p0 = UPDATE(i);                                                             \
            if (copy)                                                                      \
                COPY1(copy, ct, i, p0, st);                                                \
        }                                                                                  \
    } while (0)

/* Blocks of N vectors (N even, a constant: the compiler unrolls it), their
 * copy two vectors to a store. */
#define FS_BLOCKS(VT, W, N, UPDATE, PREFETCH, COPY2)                                       \
    for (; i + (N) * (W) <= hi; i += (N) * (W)) {                                          \
        if (ahead)                                                                         \
            for (int64_t k = 0; k < (N) * (W); k += 16)                                    \
                PREFETCH(i + ahead + k);                                                   \
        for (int q = 0; q < (N); q += 2) {                                                 \
            VT p0 = UPDATE(i + q * (W)), p1 = UPDATE(i + (q + 1) * (W));                   \
            if (copy)                                                                      \
                COPY2(copy, ct, i + q * (W), p0, p1, st);                                  \
        }                                                                                  \
    }

/* ---------------------------------------------------------------------------
 * AVX2 kernels: 8 lanes */

/* The bf16 bits of v's 8 values, each in the low half of its 32-bit lane,
 * rounded as fs_f32_to_bf16 does; halves8 and halves16 pack them. A NaN
 * (v != v: one compare) is quieted as the scalar path quiets it. */
FS_AVX2 FS_INLINE __m256i bf16_bits8(__m256 v)
{
    __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
    __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

FS_AVX2 FS_INLINE __m128i halves8(__m256 v, fs_dtype t)
{
    if (t == FS_F16)
        return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    __m256i r = bf16_bits8(v);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}

/* 16 halves, p0's then p1's: one pack and one permute for both. */
FS_AVX2 FS_INLINE __m256i halves16(__m256 p0, __m256 p1, fs_dtype t)
{
    if (t == FS_F16)
        return _mm256_insertf128_si256(
            _mm256_castsi128_si256(_mm256_cvtps_ph(p0, _MM_FROUND_TO_NEAREST_INT)),
            _mm256_cvtps_ph(p1, _MM_FROUND_TO_NEAREST_INT), 1);
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits8(p0), bf16_bits8(p1)), 0xD8);
}

/* The copy of 8 updated parameters at element i (16 bytes), and of 16 (p0:
 * i..i+7, p1: i+8..i+15) in one 32-byte store. Non-temporal stores need the
 * address aligned to their size (run_range's head peel sees to it). */
FS_AVX2 FS_INLINE void copy8(void *copy, fs_dtype t, int64_t i, __m256 p, int stream)
{
    __m128i *dst = (__m128i *)((uint16_t *)copy + i);
    if (stream)
        _mm_stream_si128(dst, halves8(p, t));
    else
        _mm_storeu_si128(dst, halves8(p, t));
}

FS_AVX2 FS_INLINE void copy16x2(void *copy, fs_dtype t, int64_t i, __m256 p0, __m256 p1,
                                int stream)
{
    __m256i *dst = (__m256i *)((uint16_t *)copy + i);
    if (stream)
        _mm256_stream_si256(dst, halves16(p0, p1, t));
    else
        _mm256_storeu_si256(dst, halves16(p0, p1, t));
}

typedef struct {
    __m256 b1c, b2, b2c, eps, bc2, ss, decay, wd, sign;
} adam_k8;

/* Elements i..i+7 of the update, but for the copy: returns the updated
 * parameters for the caller to copy. */
FS_AVX2 FS_INLINE __m256 adam8(const fs_adam_buffers *b, const fs_adam_hparams *h, int l2,
                               const adam_k8 *c, int64_t i)
{
    __m256 g = _mm256_loadu_ps(b->grad + i);
    if (h->maximize)
        g = _mm256_xor_ps(g, c->sign);
    __m256 p = _mm256_loadu_ps(b->param + i);
    if (h->decoupled)
        p = _mm256_mul_ps(p, c->decay);
    else if (l2)
        g = _mm256_fmadd_ps(c->wd, p, g);
    __m256 m = _mm256_loadu_ps(b->exp_avg + i);
    m = _mm256_fmadd_ps(c->b1c, _mm256_sub_ps(g, m), m);
    __m256 v = _mm256_fmadd_ps(c->b2, _mm256_loadu_ps(b->exp_avg_sq + i),
                              _mm256_mul_ps(_mm256_mul_ps(c->b2c, g), g));
    _mm256_storeu_ps(b->exp_avg + i, m);
    _mm256_storeu_ps(b->exp_avg_sq + i, v);
    if (b->max_exp_avg_sq) {
        v = _mm256_max_ps(_mm256_loadu_ps(b->max_exp_avg_sq + i), v);
        _mm256_storeu_ps(b->max_exp_avg_sq + i, v);
    }
    __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), c->bc2, c->eps);
    p = _mm256_fnmadd_ps(c->ss, _mm256_div_ps(m, denom), p); /* p - ss * (m / denom), one rounding */
    _mm256_storeu_ps(b->param + i, p);
    return p;
}

/* One line (16 floats) of each stream at element j. */
FS_INLINE void adam_prefetch(const fs_adam_buffers *b, int64_t j)
{
    FS_PF(b->grad, j);
    FS_PF(b->param, j);
    FS_PF(b->exp_avg, j);
    FS_PF(b->exp_avg_sq, j);
    if (b->max_exp_avg_sq)
        FS_PF(b->max_exp_avg_sq, j);
}

typedef struct {
    __m256 lr, mom, damp, wd, sign;
} sgd_k8;

FS_AVX2 FS_INLINE __m256 sgd8(const fs_sgd_buffers *b, const fs_sgd_hparams *h, const sgd_k8 *c,
                              int64_t i)
{
    __m256 g = _mm256_loadu_ps(b->grad + i);
    if (h->maximize)
        g = _mm256_xor_ps(g, c->sign);
    __m256 p = _mm256_loadu_ps(b->param + i);
    if (h->weight_decay != 0.0f)
        g = _mm256_fmadd_ps(c->wd, p, g);
    if (b->momentum_buf) {
        __m256 buf = h->first_step ? g : _mm256_fmadd_ps(
            c->mom, _mm256_loadu_ps(b->momentum_buf + i), _mm256_mul_ps(c->damp, g));
        _mm256_storeu_ps(b->momentum_buf + i, buf);
        g = h->nesterov ? _mm256_fmadd_ps(c->mom, buf, g) : buf;
    }
    p = _mm256_fnmadd_ps(c->lr, g, p);
    _mm256_storeu_ps(b->param + i, p);
    return p;
}

FS_INLINE void sgd_prefetch(const fs_sgd_buffers *b, int64_t j)
{
    FS_PF(b->grad, j);
    FS_PF(b->param, j);
    if (b->momentum_buf)
        FS_PF(b->momentum_buf, j);
}

#define FS_ADAM8(j) adam8(b, h, l2, &c, (j))
#define FS_ADAM_PF(j) adam_prefetch(b, (j))
#define FS_SGD8(j) sgd8(b, h, &c, (j))
#define FS_SGD_PF(j) sgd_prefetch(b, (j))

/* Prefetches past the end of a buffer are harmless: they never fault. */
FS_AVX2 static int64_t adam_avx2(const range_ctx *x, int64_t lo, int64_t hi)
{
    const fs_adam_buffers bl = x->job->adam, *b = &bl; /* [Note: local copies] */
    const fs_adam_hparams hl = x->job->adam_h, *h = &hl;
    const adam_k8 c = {_mm256_set1_ps(1.0f - h->beta1), _mm256_set1_ps(h->beta2),
                       _mm256_set1_ps(1.0f - h->beta2), _mm256_set1_ps(h->eps),
                       _mm256_set1_ps(x->k.inv_bc2_sqrt), _mm256_set1_ps(x->k.step_size),
                       _mm256_set1_ps(x->k.decay), _mm256_set1_ps(h->weight_decay),
                       _mm256_set1_ps(-0.0f)};
    const int l2 = !h->decoupled && h->weight_decay != 0.0f, st = x->stream;
    const int64_t ahead = x->v.prefetch_bytes / 4;
    void *const copy = b->copy;
    const fs_dtype ct = b->copy_dtype;
    int64_t i = lo;
    if (hl.decoupled && !hl.maximize && !bl.max_exp_avg_sq) {
        /* AdamW, the common case, with its flags constants for the compiler */
        fs_adam_hparams hw = hl;
        fs_adam_buffers bw = bl;
        hw.decoupled = 1, hw.maximize = 0, bw.max_exp_avg_sq = NULL;
        const fs_adam_hparams *const h = &hw;
        const fs_adam_buffers *const b = &bw;
        FS_LOOP(__m256, 8, FS_ADAM8, FS_ADAM_PF, copy8, copy16x2);
    } else {
        FS_LOOP(__m256, 8, FS_ADAM8, FS_ADAM_PF, copy8, copy16x2);
    }
    return i;
}

FS_AVX2 static int64_t sgd_avx2(const range_ctx *x, int64_t lo, int64_t hi)
{
    const fs_sgd_buffers bl = x->job->sgd, *b = &bl; /* [Note: local copies] */
    const fs_sgd_hparams hl = x->job->sgd_h, *h = &hl;
    const sgd_k8 c = {_mm256_set1_ps(h->lr), _mm256_set1_ps(h->momentum),
                      _mm256_set1_ps(1.0f - h->dampening), _mm256_set1_ps(h->weight_decay),
                      _mm256_set1_ps(-0.0f)};
    const int st = x->stream;
    const int64_t ahead = x->v.prefetch_bytes / 4;
    void *const copy = b->copy;
    const fs_dtype ct = b->copy_dtype;
    int64_t i = lo;
    FS_LOOP(__m256, 8, FS_SGD8, FS_SGD_PF, copy8, copy16x2);
    return i;
}

/* ---------------------------------------------------------------------------
 * AVX-512 kernels: 16 lanes, compiled twice (FS_KERNELS512 below): once for
 * AVX-512 F/BW, where the bf16 copy is rounded on integers as half16 does,
 * and once more with AVX512_BF16 for the variants that round it with
 * vcvtneps2bf16 / vcvtne2ps2bf16 ([Note: bf16 instruction]). */

FS_AVX512 FS_INLINE __m256i half16(__m512 v, fs_dtype t)
{
    if (t == FS_F16)
        return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_blend_epi32(nan, r,
                                _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

/* 32 or 64 bytes of the copy at element i: non-temporal stores need the
 * address aligned to their size (run_range's head peel sees to it). */
FS_AVX512 FS_INLINE void put16(void *copy, int64_t i, __m256i h, int stream)
{
    __m256i *dst = (__m256i *)((uint16_t *)copy + i);
    if (stream)
        _mm256_stream_si256(dst, h);
    else
        _mm256_storeu_si256(dst, h);
}

FS_AVX512 FS_INLINE void put32(void *copy, int64_t i, __m512i h, int stream)
{
    __m512i *dst = (__m512i *)((uint16_t *)copy + i);
    if (stream)
        _mm512_stream_si512(dst, h);
    else
        _mm512_storeu_si512(dst, h);
}

/* The copy of 16 updated parameters at element i, and of 32 (p0: i..i+15,
 * p1: i+16..i+31) as one 64-byte line's worth. */
FS_AVX512 FS_INLINE void copy16(void *copy, fs_dtype t, int64_t i, __m512 p, int stream)
{
    put16(copy, i, half16(p, t), stream);
}

FS_AVX512 FS_INLINE void copy32(void *copy, fs_dtype t, int64_t i, __m512 p0, __m512 p1,
                                int stream)
{
    put32(copy, i, _mm512_inserti64x4(_mm512_castsi256_si512(half16(p0, t)), half16(p1, t), 1),
          stream);
}

/* [Note: bf16 instruction]
 * vcvtneps2bf16 rounds f32 to bf16 to nearest even in one instruction
 * (vcvtne2ps2bf16: 32 of them, two vectors into one), instead of half16's
 * eight integer operations. Its results are fs_f32_to_bf16's except for
 * subnormal inputs, which it flushes to a signed zero where the reference
 * rounds them to a bf16 subnormal; NaNs come out quiet with sign and payload
 * kept, as the reference's, on the CPUs tested, but are no part of what the
 * instruction is relied on for. So a vector holding either class of input
 * (vfpclassps: QNaN, SNaN, denormal) is rounded by half16 instead: a branch
 * that real parameters never take, and the same bits either way. Used only
 * where the CPU reports AVX512_BF16 (and AVX512DQ for vfpclassps):
 * fs_optim_have_bf16_insn(); variants name it as simd "avx512bf16". */
#define FS_AVX512BF __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,fma")))
#define FS_BF16_SPECIAL 0xA1 /* vfpclassps categories: QNaN | denormal | SNaN */

FS_AVX512BF FS_INLINE void copy16_bf(void *copy, fs_dtype t, int64_t i, __m512 p, int stream)
{
    if (t != FS_BF16 || _mm512_fpclass_ps_mask(p, FS_BF16_SPECIAL)) {
        copy16(copy, t, i, p, stream);
        return;
    }
    __m256bh h = _mm512_cvtneps_pbh(p);
    __m256i bits;
    memcpy(&bits, &h, sizeof bits);
    put16(copy, i, bits, stream);
}

FS_AVX512BF FS_INLINE void copy32_bf(void *copy, fs_dtype t, int64_t i, __m512 p0, __m512 p1,
                                     int stream)
{
    if (t != FS_BF16 || (_mm512_fpclass_ps_mask(p0, FS_BF16_SPECIAL) |
                         _mm512_fpclass_ps_mask(p1, FS_BF16_SPECIAL))) {
        copy32(copy, t, i, p0, p1, stream);
        return;
    }
    __m512bh h = _mm512_cvtne2ps_pbh(p1, p0); /* p0 in the low half */
    __m512i bits;
    memcpy(&bits, &h, sizeof bits);
    put32(copy, i, bits, stream);
}

typedef struct {
    __m512 b1c, b2, b2c, eps, bc2, ss, decay, wd;
    __m512i sign;
} adam_k16;

/* Elements i..i+15 of the update, but for the copy: returns the updated
 * parameters for the caller to copy. */
FS_AVX512 FS_INLINE __m512 adam16(const fs_adam_buffers *b, const fs_adam_hparams *h, int l2,
                                  const adam_k16 *c, int64_t i)
{
    __m512 g = _mm512_loadu_ps(b->grad + i);
    if (h->maximize)
        g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), c->sign));
    __m512 p = _mm512_loadu_ps(b->param + i);
    if (h->decoupled)
        p = _mm512_mul_ps(p, c->decay);
    else if (l2)
        g = _mm512_fmadd_ps(c->wd, p, g);
    __m512 m = _mm512_loadu_ps(b->exp_avg + i);
    m = _mm512_fmadd_ps(c->b1c, _mm512_sub_ps(g, m), m);
    __m512 v = _mm512_fmadd_ps(c->b2, _mm512_loadu_ps(b->exp_avg_sq + i),
                              _mm512_mul_ps(_mm512_mul_ps(c->b2c, g), g));
    _mm512_storeu_ps(b->exp_avg + i, m);
    _mm512_storeu_ps(b->exp_avg_sq + i, v);
    if (b->max_exp_avg_sq) {
        v = _mm512_max_ps(_mm512_loadu_ps(b->max_exp_avg_sq + i), v);
        _mm512_storeu_ps(b->max_exp_avg_sq + i, v);
    }
    __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), c->bc2, c->eps);
    p = _mm512_fnmadd_ps(c->ss, _mm512_div_ps(m, denom), p); /* p - ss * (m / denom), one rounding */
    _mm512_storeu_ps(b->param + i, p);
    return p;
}

typedef struct {
    __m512 lr, mom, damp, wd;
    __m512i sign;
} sgd_k16;

FS_AVX512 FS_INLINE __m512 sgd16(const fs_sgd_buffers *b, const fs_sgd_hparams *h,
                                 const sgd_k16 *c, int64_t i)
{
    __m512 g = _mm512_loadu_ps(b->grad + i);
    if (h->maximize)
        g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), c->sign));
    __m512 p = _mm512_loadu_ps(b->param + i);
    if (h->weight_decay != 0.0f)
        g = _mm512_fmadd_ps(c->wd, p, g);
    if (b->momentum_buf) {
        __m512 buf = h->first_step ? g : _mm512_fmadd_ps(
            c->mom, _mm512_loadu_ps(b->momentum_buf + i), _mm512_mul_ps(c->damp, g));
        _mm512_storeu_ps(b->momentum_buf + i, buf);
        g = h->nesterov ? _mm512_fmadd_ps(c->mom, buf, g) : buf;
    }
    p = _mm512_fnmadd_ps(c->lr, g, p);
    _mm512_storeu_ps(b->param + i, p);
    return p;
}

#define FS_ADAM16(j) adam16(b, h, l2, &c, (j))
#define FS_SGD16(j) sgd16(b, h, &c, (j))

/* adam_<suffix> and sgd_<suffix> with target ATTR and copy stores COPY16/COPY32. */
#define FS_KERNELS512(SUFFIX, ATTR, COPY16, COPY32)                                         \
    ATTR static int64_t adam_##SUFFIX(const range_ctx *x, int64_t lo, int64_t hi)          \
    {                                                                                      \
        const fs_adam_buffers bl = x->job->adam, *b = &bl; /* [Note: local copies] */      \
        const fs_adam_hparams hl = x->job->adam_h, *h = &hl;                               \
        const adam_k16 c = {_mm512_set1_ps(1.0f - h->beta1), _mm512_set1_ps(h->beta2),     \
                            _mm512_set1_ps(1.0f - h->beta2), _mm512_set1_ps(h->eps),       \
                            _mm512_set1_ps(x->k.inv_bc2_sqrt),                             \
                            _mm512_set1_ps(x->k.step_size), _mm512_set1_ps(x->k.decay),    \
                            _mm512_set1_ps(h->weight_decay),                               \
                            _mm512_set1_epi32((int)0x80000000u)};                          \
        const int l2 = !h->decoupled && h->weight_decay != 0.0f, st = x->stream;           \
        const int64_t ahead = x->v.prefetch_bytes / 4;                                     \
        void *const copy = b->copy;                                                        \
        const fs_dtype ct = b->copy_dtype;                                                 \
        int64_t i = lo;                                                                    \
        if (hl.decoupled && !hl.maximize && !bl.max_exp_avg_sq) {                          \
            /* AdamW, the common case, with its flags constants for the compiler */        \
            fs_adam_hparams hw = hl;                                                       \
            fs_adam_buffers bw = bl;                                                       \
            hw.decoupled = 1, hw.maximize = 0, bw.max_exp_avg_sq = NULL;                   \
            const fs_adam_hparams *const h = &hw;                                          \
            const fs_adam_buffers *const b = &bw;                                          \
            FS_LOOP(__m512, 16, FS_ADAM16, FS_ADAM_PF, COPY16, COPY32);                       \
        } else {                                                                           \
            FS_LOOP(__m512, 16, FS_ADAM16, FS_ADAM_PF, COPY16, COPY32);                       \
        }                                                                                  \
        return i;                                                                          \
    }                                                                                      \
    ATTR static int64_t sgd_##SUFFIX(const range_ctx *x, int64_t lo, int64_t hi)           \
    {                                                                                      \
        const fs_sgd_buffers bl = x->job->sgd, *b = &bl;                                   \
        const fs_sgd_hparams hl = x->job->sgd_h, *h = &hl;                                 \
        const sgd_k16 c = {_mm512_set1_ps(h->lr), _mm512_set1_ps(h->momentum),             \
                           _mm512_set1_ps(1.0f - h->dampening),                            \
                           _mm512_set1_ps(h->weight_decay),                                \
                           _mm512_set1_epi32((int)0x80000000u)};                           \
        const int st = x->stream;                                                          \
        const int64_t ahead = x->v.prefetch_bytes / 4;                                     \
        void *const copy = b->copy;                                                        \
        const fs_dtype ct = b->copy_dtype;                                                 \
        int64_t i = lo;                                                                    \
        FS_LOOP(__m512, 16, FS_SGD16, FS_SGD_PF, COPY16, COPY32);                             \
        return i;                                                                          \
    }

FS_KERNELS512(avx512, FS_AVX512, copy16, copy32)
FS_KERNELS512(avx512bf, FS_AVX512BF, copy16_bf, copy32_bf)

/* AVX512_BF16 and AVX512DQ, with AVX-512 F/BW (fs_simd_best). */
static int detect_bf16_insn(void)
{
    if (fs_simd_best() < FS_SIMD_AVX512)
        return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq");
}
#endif /* FS_X86 */

int fs_optim_have_bf16_insn(void)
{
#ifdef FS_X86
    static int have = -1;
    if (have < 0)
        have = detect_bf16_insn();
    return have;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------
 * one range on one thread */

static void scalar_range(const range_ctx *x, int64_t lo, int64_t hi)
{
    if (x->job->kind == FS_OPTIM_ADAM)
        adam_scalar(&x->job->adam, &x->job->adam_h, &x->k, lo, hi);
    else
        sgd_scalar(&x->job->sgd, &x->job->sgd_h, lo, hi);
}

static void run_range(const range_ctx *x, int64_t lo, int64_t hi)
{
    int64_t i = lo;
#ifdef FS_X86
    if (x->v.simd >= FS_SIMD_AVX2 && lo < hi) {
        if (x->stream) {
            /* Streaming stores need aligned addresses (32 bytes for AVX2's 16
             * halves, then 16 for its last 8; 64 for AVX-512's 32 in a line,
             * then 32 for its last 16): the scalar loop takes the head. */
            const void *copy = x->job->kind == FS_OPTIM_ADAM ? x->job->adam.copy
                                                             : x->job->sgd.copy;
            const uintptr_t mask = x->v.simd >= FS_SIMD_AVX512 ? 63 : 31;
            int64_t head = lo;
            while (head < hi && ((uintptr_t)((const uint16_t *)copy + head) & mask))
                head++;
            scalar_range(x, lo, head);
            i = head;
        }
        const int adam = x->job->kind == FS_OPTIM_ADAM;
        if (x->v.simd >= FS_SIMD_AVX512 && x->bf16_insn)
            i = adam ? adam_avx512bf(x, i, hi) : sgd_avx512bf(x, i, hi);
        else if (x->v.simd >= FS_SIMD_AVX512)
            i = adam ? adam_avx512(x, i, hi) : sgd_avx512(x, i, hi);
        i = adam ? adam_avx2(x, i, hi) : sgd_avx2(x, i, hi);
    }
#endif
    scalar_range(x, i, hi);
}

/* ---------------------------------------------------------------------------
 * thread split */

#define FS_MAX_THREADS 64

typedef struct {
    const range_ctx *x;
    int64_t lo, hi;     /* contiguous: this thread's slice */
    atomic_llong *next; /* chunked: the first element nobody has claimed */
    double *busy;       /* timed runs: this thread's CPU seconds are added here, else NULL */
} slice;

static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void slice_work(const slice *s)
{
    const double t0 = s->busy ? thread_cpu_s() : 0.0;
    if (s->next) {
        const int64_t chunk = s->x->v.chunk_numel;
        for (;;) {
            int64_t lo = atomic_fetch_add_explicit(s->next, chunk, memory_order_relaxed);
            if (lo >= s->hi)
                break;
            run_range(s->x, lo, lo + chunk < s->hi ? lo + chunk : s->hi);
        }
    } else {
        run_range(s->x, s->lo, s->hi);
    }
#ifdef FS_X86
    if (s->x->stream)
        _mm_sfence(); /* streaming stores are weakly ordered: drain them before the join */
#endif
    if (s->busy)
        *s->busy += thread_cpu_s() - t0;
}

static void *slice_main(void *arg)
{
    slice_work(arg);
    return NULL;
}

/* [Note: OpenMP team]
 * Right after torch's own parallel work (the backward pass, or a torch
 * optimizer) its OpenMP threads spin for a while waiting for more. A thread
 * we start then shares a core with a spinner and the step waits for it; the
 * spinner itself is idle and ready. So a variant may run its threads as the
 * process's OpenMP team instead: GOMP_parallel, looked up at run time in
 * whatever OpenMP runtime the process has loaded (torch's libgomp, or a
 * runtime with libgomp's entry points), never linked. Whether that wins is
 * for the tuning to measure; without such a runtime the variants start their
 * own threads. */
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned nthreads,
                                 unsigned flags);
typedef int (*omp_int_fn)(void);

static struct {
    gomp_parallel_fn parallel;
    omp_int_fn thread_num, num_threads;
} omp_rt;
static pthread_once_t omp_once = PTHREAD_ONCE_INIT;

static void omp_lookup(void)
{
    gomp_parallel_fn par = (gomp_parallel_fn)dlsym(RTLD_DEFAULT, "GOMP_parallel");
    omp_int_fn num = (omp_int_fn)dlsym(RTLD_DEFAULT, "omp_get_thread_num");
    omp_int_fn count = (omp_int_fn)dlsym(RTLD_DEFAULT, "omp_get_num_threads");
    if (par && num && count) {
        omp_rt.parallel = par;
        omp_rt.thread_num = num;
        omp_rt.num_threads = count;
    }
}

int fs_optim_have_omp(void)
{
    pthread_once(&omp_once, omp_lookup);
    return omp_rt.parallel != NULL;
}

typedef struct {
    const range_ctx *x;
    int64_t lo, hi;
    atomic_llong *next; /* chunked, else NULL */
    double *busy;       /* timed runs: per member, else NULL */
} team_job;

/* Each member of the team takes its slice of however many members the
 * runtime gave (it may give fewer than asked), or claims chunks. */
static void team_main(void *arg)
{
    const team_job *j = arg;
    const int64_t t = omp_rt.thread_num(), nt = omp_rt.num_threads();
    slice s = {j->x, j->lo, j->hi, j->next,
               j->busy && t < FS_MAX_THREADS ? j->busy + t : NULL};
    if (!j->next) {
        const int64_t per = ((j->hi - j->lo) / nt + 15) / 16 * 16;
        const int64_t a = j->lo + t * per, b = a + per;
        s.lo = a < j->hi ? a : j->hi;
        s.hi = t == nt - 1 || b > j->hi ? j->hi : b;
    }
    slice_work(&s);
}

static fs_simd simd_cap(fs_simd s)
{
    const fs_simd best = fs_simd_best();
    return s > best ? best : s;
}

fs_status fs_optim_check(const fs_optim_job *job)
{
    if (job->kind == FS_OPTIM_ADAM) {
        const fs_adam_buffers *b = &job->adam;
        if (b->n < 0 || job->adam_h.step < 1 ||
            (b->copy && b->copy_dtype != FS_BF16 && b->copy_dtype != FS_F16))
            return FS_ERR_INVALID_ARG;
        return FS_OK;
    }
    if (job->kind == FS_OPTIM_SGD) {
        const fs_sgd_buffers *b = &job->sgd;
        if (b->n < 0 || (b->copy && b->copy_dtype != FS_BF16 && b->copy_dtype != FS_F16))
            return FS_ERR_INVALID_ARG;
        return FS_OK;
    }
    return FS_ERR_INVALID_ARG;
}

int fs_optim_step_count_ok(const float *step)
{
    const float next = step ? *step + 1.0f : 0.0f;
    return next >= 1.0f && next <= 9.2e18f;
}

void fs_optim_take_step_counts(fs_optim_job *js, float *const *steps, int n)
{
    for (int i = 0; steps && i < n; i++)
        if (steps[i] && js[i].kind == FS_OPTIM_ADAM) {
            const float next = *steps[i] + 1.0f;
            *steps[i] = next;
            js[i].adam_h.step = (int64_t)next;
        }
}

/* [lo, hi) on `threads` threads started for it (this one the first); `next`:
 * chunked, else NULL; busy: per thread CPU seconds, or NULL. */
static void run_started(const range_ctx *x, int64_t lo, int64_t hi, int threads,
                        atomic_llong *next, double *busy)
{
    const int64_t len = hi - lo;
    slice s[FS_MAX_THREADS];
    pthread_t tids[FS_MAX_THREADS];
    /* Contiguous slices start on 16-element boundaries so vector loops stay
     * aligned when the buffers are. */
    const int64_t per = (len / threads + 15) / 16 * 16;
    for (int t = 0; t < threads; t++) {
        int64_t a = lo + t * per, b = lo + (t + 1) * per;
        s[t] = (slice){x, a < hi ? a : hi, t == threads - 1 || b > hi ? hi : b, next,
                       busy ? busy + t : NULL};
        if (next)
            s[t].hi = hi;
    }
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], NULL, slice_main, &s[t]) != 0)
            break;
        started = t;
    }
    slice_work(&s[0]);
    /* Contiguous slices whose thread could not start run here, after our
     * own (chunked ones were claimed by the running threads). */
    if (!next)
        for (int t = started + 1; t < threads; t++) {
            s[t].busy = busy; /* this thread's time */
            slice_work(&s[t]);
        }
    for (int t = 1; t <= started; t++)
        pthread_join(tids[t], NULL);
}

fs_status fs_optim_run(const fs_optim_job *job, int64_t lo, int64_t hi, const fs_optim_variant *v)
{
    return fs_optim_run_busy(job, lo, hi, v, NULL);
}

fs_status fs_optim_run_busy(const fs_optim_job *job, int64_t lo, int64_t hi,
                            const fs_optim_variant *v, double *busy_s)
{
    const int64_t n = job->kind == FS_OPTIM_ADAM ? job->adam.n : job->sgd.n;
    if (lo < 0 || hi < lo || hi > n || v->threads < 1 || v->chunk_numel < 0 ||
        v->chunk_numel % 16 != 0 || v->prefetch_bytes < 0 ||
        (v->unroll != 1 && v->unroll != 2 && v->unroll != 4))
        return FS_ERR_INVALID_ARG;
    range_ctx x = {job, {0, 0, 0}, *v, 0, 0};
    x.v.simd = simd_cap(v->simd);
    const void *copy = job->kind == FS_OPTIM_ADAM ? job->adam.copy : job->sgd.copy;
    const fs_dtype copy_dtype = job->kind == FS_OPTIM_ADAM ? job->adam.copy_dtype
                                                           : job->sgd.copy_dtype;
    x.stream = v->stream_copy && copy && x.v.simd >= FS_SIMD_AVX2;
    x.bf16_insn = v->bf16_insn && copy && copy_dtype == FS_BF16 &&
                  x.v.simd >= FS_SIMD_AVX512 && fs_optim_have_bf16_insn();
    if (job->kind == FS_OPTIM_ADAM)
        x.k = adam_derive(&job->adam_h);

    const int64_t len = hi - lo;
    int threads = v->threads > FS_MAX_THREADS ? FS_MAX_THREADS : v->threads;
    if (threads > (len + 15) / 16) /* at least one vector each */
        threads = len > 16 ? (int)((len + 15) / 16) : 1;
    atomic_llong next;
    atomic_init(&next, lo);
    const int chunked = v->chunk_numel > 0 && threads > 1;
    double busy[FS_MAX_THREADS] = {0};
    if (v->omp && threads > 1 && fs_optim_have_omp()) {
        team_job tj = {&x, lo, hi, chunked ? &next : NULL, busy_s ? busy : NULL};
        omp_rt.parallel(team_main, &tj, (unsigned)threads, 0);
    } else {
        run_started(&x, lo, hi, threads, chunked ? &next : NULL, busy_s ? busy : NULL);
    }
    if (busy_s) {
        *busy_s = 0.0;
        for (int t = 0; t < threads; t++)
            *busy_s = busy[t] > *busy_s ? busy[t] : *busy_s;
    }
    return FS_OK;
}

fs_optim_variant fs_optim_default_variant(fs_simd simd, int threads)
{
    const fs_simd level = simd_cap(simd);
    fs_optim_variant v = {level, level >= FS_SIMD_AVX2 ? 4 : 1, 0, 0, threads < 1 ? 1 : threads,
                          0, 0, 0};
    return v;
}

void fs_optim_variant_name(const fs_optim_variant *v, char out[FS_OPTIM_VARIANT_NAME_MAX])
{
    const char *simd = v->bf16_insn && v->simd >= FS_SIMD_AVX512 ? "avx512bf16"
                                                                 : fs_simd_name(v->simd);
    snprintf(out, FS_OPTIM_VARIANT_NAME_MAX, "%s.u%d.pf%d.%s.%s%d.c%lld", simd, v->unroll,
             v->prefetch_bytes, v->stream_copy ? "nt" : "st", v->omp ? "omp" : "t", v->threads,
             (long long)v->chunk_numel);
}

fs_status fs_optim_variant_parse(const char *name, fs_optim_variant *out)
{
    char simd[16], stores[3], team[4];
    int unroll, pf, threads, used = 0;
    long long chunk;
    if (!name || sscanf(name, "%15[a-z0-9].u%d.pf%d.%2[a-z].%3[a-z]%d.c%lld%n", simd, &unroll,
                        &pf, stores, team, &threads, &chunk, &used) != 7 || name[used] != '\0')
        return FS_ERR_INVALID_ARG;
    /* "avx512bf16": AVX-512 with the bf16 instructions, where the CPU has them. */
    const int bf16 = strcmp(simd, "avx512bf16") == 0;
    int level = bf16 ? (fs_optim_have_bf16_insn() ? FS_SIMD_AVX512 : -2) : fs_simd_parse(simd);
    int nt = strcmp(stores, "nt") == 0, omp = strcmp(team, "omp") == 0;
    if (level < 0 || strcmp(simd, "auto") == 0 || (!nt && strcmp(stores, "st") != 0) ||
        (!omp && strcmp(team, "t") != 0) || (unroll != 1 && unroll != 2 && unroll != 4) ||
        pf < 0 || pf > (1 << 20) || threads < 1 || threads > FS_MAX_THREADS || chunk < 0 ||
        chunk % 16 != 0)
        return FS_ERR_INVALID_ARG;
    *out = (fs_optim_variant){(fs_simd)level, unroll, pf, nt, threads, omp, chunk, bf16};
    return FS_OK;
}
