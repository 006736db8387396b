/* optim_cpu.c - see optim.h. Scalar reference, AVX2 and AVX-512 kernels,
 * thread split. */
#include "optim.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FS_X86 1
#endif

/* Below this many elements per thread, more threads cost more than they save. */
#define FS_MIN_PER_THREAD (1 << 16)

/* The SIMD loops read four or five streams at once, more than a core's
 * hardware prefetchers keep ahead of: each loop asks for the lines this many
 * elements (4 KiB) ahead itself. On a 2-core Xeon it took the AdamW step over
 * 2^26 parameters from about 64 to 57 ms (benchmarks/RESULTS.md). Prefetches
 * past the end of a buffer are harmless: they never fault. */
#define FS_PREFETCH_AHEAD 1024

#ifdef FS_X86
#define FS_PREFETCH(ptr, i) _mm_prefetch((const char *)((ptr) + (i) + FS_PREFETCH_AHEAD), \
                                         _MM_HINT_T0)
#endif

static inline void store_copy(void *copy, fs_dtype t, int64_t i, float v)
{
    if (t == FS_BF16)
        ((uint16_t *)copy)[i] = fs_f32_to_bf16(v);
    else
        ((uint16_t *)copy)[i] = fs_f32_to_f16(v);
}

/* ---------------------------------------------------------------------------
 * Adam / AdamW */

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
            g += h->weight_decay * p;
        float m = b->exp_avg[i];
        m = m + b1c * (g - m); /* torch's lerp */
        float v = b2 * b->exp_avg_sq[i] + b2c * g * g;
        b->exp_avg[i] = m;
        b->exp_avg_sq[i] = v;
        if (b->max_exp_avg_sq) {
            v = fmaxf(b->max_exp_avg_sq[i], v);
            b->max_exp_avg_sq[i] = v;
        }
        float denom = sqrtf(v) * k->inv_bc2_sqrt + h->eps;
        p = p - k->step_size * (m / denom);
        b->param[i] = p;
        if (b->copy)
            store_copy(b->copy, b->copy_dtype, i, p);
    }
}

#ifdef FS_X86
__attribute__((target("avx2,f16c"))) static void store_copy8(void *copy, fs_dtype t, int64_t i,
                                                             __m256 v)
{
    __m128i out;
    if (t == FS_F16) {
        out = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    } else {
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
        r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16),
                                                  _mm256_set1_epi32(0x40)), nan);
        out = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)copy + i), out);
}

/* Same operations in the same order as adam_scalar (no FMA contraction:
 * mul and add are separate intrinsics), so both paths give the same bits. */
__attribute__((target("avx2,f16c"))) static int64_t adam_avx2(const fs_adam_buffers *b,
                                                               const fs_adam_hparams *h,
                                                               const adam_consts *k, int64_t lo,
                                                               int64_t hi)
{
    const __m256 b1c = _mm256_set1_ps(1.0f - h->beta1), b2 = _mm256_set1_ps(h->beta2),
                 b2c = _mm256_set1_ps(1.0f - h->beta2), eps = _mm256_set1_ps(h->eps),
                 bc2 = _mm256_set1_ps(k->inv_bc2_sqrt), ss = _mm256_set1_ps(k->step_size),
                 decay = _mm256_set1_ps(k->decay), wd = _mm256_set1_ps(h->weight_decay),
                 sign = _mm256_set1_ps(-0.0f);
    const int l2 = !h->decoupled && h->weight_decay != 0.0f;
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        if ((i & 15) == 0) { /* one 64-byte line per stream every other iteration */
            FS_PREFETCH(b->grad, i);
            FS_PREFETCH(b->param, i);
            FS_PREFETCH(b->exp_avg, i);
            FS_PREFETCH(b->exp_avg_sq, i);
            if (b->max_exp_avg_sq)
                FS_PREFETCH(b->max_exp_avg_sq, i);
        }
        __m256 g = _mm256_loadu_ps(b->grad + i);
        if (h->maximize)
            g = _mm256_xor_ps(g, sign);
        __m256 p = _mm256_loadu_ps(b->param + i);
        if (h->decoupled)
            p = _mm256_mul_ps(p, decay);
        else if (l2)
            g = _mm256_add_ps(g, _mm256_mul_ps(wd, p));
        __m256 m = _mm256_loadu_ps(b->exp_avg + i);
        m = _mm256_add_ps(m, _mm256_mul_ps(b1c, _mm256_sub_ps(g, m)));
        __m256 v = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(b->exp_avg_sq + i)),
                                 _mm256_mul_ps(_mm256_mul_ps(b2c, g), g));
        _mm256_storeu_ps(b->exp_avg + i, m);
        _mm256_storeu_ps(b->exp_avg_sq + i, v);
        if (b->max_exp_avg_sq) {
            v = _mm256_max_ps(_mm256_loadu_ps(b->max_exp_avg_sq + i), v);
            _mm256_storeu_ps(b->max_exp_avg_sq + i, v);
        }
        __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), bc2), eps);
        p = _mm256_sub_ps(p, _mm256_mul_ps(ss, _mm256_div_ps(m, denom)));
        _mm256_storeu_ps(b->param + i, p);
        if (b->copy)
            store_copy8(b->copy, b->copy_dtype, i, p);
    }
    return i;
}

/* The AVX-512 version of the two above: 16 lanes, the same operations in
 * the same order (no FMA), so the same bits. The bf16 rounding is done on
 * integers rather than with vcvtneps2bf16, which flushes subnormal inputs. */
__attribute__((target("avx512f,avx512bw"))) static void store_copy16(void *copy, fs_dtype t,
                                                                     int64_t i, __m512 v)
{
    __m256i out;
    if (t == FS_F16) {
        out = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    } else {
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
        __mmask16 nan = _mm512_cmpgt_epi32_mask(
            _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        r = _mm512_mask_blend_epi32(
            nan, r, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
        out = _mm512_cvtepi32_epi16(r);
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)copy + i), out);
}

__attribute__((target("avx512f,avx512bw"))) static int64_t adam_avx512(const fs_adam_buffers *b,
                                                                      const fs_adam_hparams *h,
                                                                      const adam_consts *k,
                                                                      int64_t lo, int64_t hi)
{
    const __m512 b1c = _mm512_set1_ps(1.0f - h->beta1), b2 = _mm512_set1_ps(h->beta2),
                 b2c = _mm512_set1_ps(1.0f - h->beta2), eps = _mm512_set1_ps(h->eps),
                 bc2 = _mm512_set1_ps(k->inv_bc2_sqrt), ss = _mm512_set1_ps(k->step_size),
                 decay = _mm512_set1_ps(k->decay), wd = _mm512_set1_ps(h->weight_decay);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const int l2 = !h->decoupled && h->weight_decay != 0.0f;
    int64_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        FS_PREFETCH(b->grad, i);
        FS_PREFETCH(b->param, i);
        FS_PREFETCH(b->exp_avg, i);
        FS_PREFETCH(b->exp_avg_sq, i);
        if (b->max_exp_avg_sq)
            FS_PREFETCH(b->max_exp_avg_sq, i);
        __m512 g = _mm512_loadu_ps(b->grad + i);
        if (h->maximize)
            g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
        __m512 p = _mm512_loadu_ps(b->param + i);
        if (h->decoupled)
            p = _mm512_mul_ps(p, decay);
        else if (l2)
            g = _mm512_add_ps(g, _mm512_mul_ps(wd, p));
        __m512 m = _mm512_loadu_ps(b->exp_avg + i);
        m = _mm512_add_ps(m, _mm512_mul_ps(b1c, _mm512_sub_ps(g, m)));
        __m512 v = _mm512_add_ps(_mm512_mul_ps(b2, _mm512_loadu_ps(b->exp_avg_sq + i)),
                                 _mm512_mul_ps(_mm512_mul_ps(b2c, g), g));
        _mm512_storeu_ps(b->exp_avg + i, m);
        _mm512_storeu_ps(b->exp_avg_sq + i, v);
        if (b->max_exp_avg_sq) {
            v = _mm512_max_ps(_mm512_loadu_ps(b->max_exp_avg_sq + i), v);
            _mm512_storeu_ps(b->max_exp_avg_sq + i, v);
        }
        __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), bc2), eps);
        p = _mm512_sub_ps(p, _mm512_mul_ps(ss, _mm512_div_ps(m, denom)));
        _mm512_storeu_ps(b->param + i, p);
        if (b->copy)
            store_copy16(b->copy, b->copy_dtype, i, p);
    }
    return i;
}
#endif

/* ---------------------------------------------------------------------------
 * SGD */

static void sgd_scalar(const fs_sgd_buffers *b, const fs_sgd_hparams *h, int64_t lo, int64_t hi)
{
    const float damp = 1.0f - h->dampening;
    for (int64_t i = lo; i < hi; i++) {
        float g = h->maximize ? -b->grad[i] : b->grad[i];
        float p = b->param[i];
        if (h->weight_decay != 0.0f)
            g += h->weight_decay * p;
        if (b->momentum_buf) {
            float buf = h->first_step ? g : h->momentum * b->momentum_buf[i] + damp * g;
            b->momentum_buf[i] = buf;
            g = h->nesterov ? g + h->momentum * buf : buf;
        }
        p = p - h->lr * g;
        b->param[i] = p;
        if (b->copy)
            store_copy(b->copy, b->copy_dtype, i, p);
    }
}

/* ---------------------------------------------------------------------------
 * thread split */

typedef struct {
    int kind; /* 0 adam, 1 sgd */
    const void *buffers, *hparams;
    const adam_consts *consts;
    fs_simd simd;
    int64_t lo, hi;
} slice_job;

static void run_slice(const slice_job *j)
{
    int64_t i = j->lo;
    if (j->kind == 0) {
#ifdef FS_X86
        if (j->simd >= FS_SIMD_AVX512)
            i = adam_avx512(j->buffers, j->hparams, j->consts, i, j->hi);
        if (j->simd >= FS_SIMD_AVX2)
            i = adam_avx2(j->buffers, j->hparams, j->consts, i, j->hi);
#endif
        adam_scalar(j->buffers, j->hparams, j->consts, i, j->hi);
    } else {
        sgd_scalar(j->buffers, j->hparams, i, j->hi); /* compiler-vectorised */
    }
}

static void *slice_main(void *arg)
{
    run_slice(arg);
    return NULL;
}

static fs_status split_run(slice_job base, int64_t n, int threads)
{
    if (threads < 1)
        threads = 1;
    int64_t max_threads = n / FS_MIN_PER_THREAD;
    if (threads > max_threads)
        threads = max_threads < 1 ? 1 : (int)max_threads;
    if (threads > 64)
        threads = 64;
    slice_job jobs[64];
    pthread_t tids[64];
    /* Slices start on 16-element boundaries so vector loops stay aligned. */
    int64_t per = (n / threads + 15) / 16 * 16;
    int started = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].lo = t * per < n ? t * per : n;
        jobs[t].hi = t == threads - 1 ? n : ((t + 1) * per < n ? (t + 1) * per : n);
    }
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], NULL, slice_main, &jobs[t]) != 0)
            break;
        started = t;
    }
    /* Slices whose thread could not start run here, after our own. */
    run_slice(&jobs[0]);
    for (int t = started + 1; t < threads; t++)
        run_slice(&jobs[t]);
    for (int t = 1; t <= started; t++)
        pthread_join(tids[t], NULL);
    return FS_OK;
}

fs_status fs_adam_step(const fs_adam_buffers *b, const fs_adam_hparams *h, fs_simd simd,
                       int threads)
{
    if (b->n < 0 || h->step < 1 || (b->copy && b->copy_dtype != FS_BF16 &&
                                     b->copy_dtype != FS_F16))
        return FS_ERR_INVALID_ARG;
    adam_consts k = adam_derive(h);
    const fs_simd best = fs_simd_best();
    slice_job base = {0, b, h, &k, simd > best ? best : simd, 0, 0};
    return split_run(base, b->n, threads);
}

fs_status fs_sgd_step(const fs_sgd_buffers *b, const fs_sgd_hparams *h, fs_simd simd, int threads)
{
    if (b->n < 0 || (b->copy && b->copy_dtype != FS_BF16 && b->copy_dtype != FS_F16))
        return FS_ERR_INVALID_ARG;
    slice_job base = {1, b, h, NULL, simd, 0, 0};
    return split_run(base, b->n, threads);
}
