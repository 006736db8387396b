/* reduce.c - see reduce.h. Scalar reference and AVX2/F16C kernels. */
#include "reduce.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FS_X86 1
#endif

#include <string.h>

const char *fs_simd_name(fs_simd s)
{
    return s == FS_SIMD_AVX512 ? "avx512" : s == FS_SIMD_AVX2 ? "avx2" : "scalar";
}

fs_simd fs_simd_best(void)
{
#ifdef FS_X86
    static int level = -1;
    if (level < 0) {
        __builtin_cpu_init();
        level = FS_SIMD_SCALAR;
        /* the optimizer's AVX2 loops use FMA (every AVX2 CPU has it) */
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
            __builtin_cpu_supports("fma")) {
            level = FS_SIMD_AVX2;
            if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
                level = FS_SIMD_AVX512;
        }
    }
    return (fs_simd)level;
#else
    return FS_SIMD_SCALAR;
#endif
}

int fs_simd_parse(const char *name)
{
    static const char *names[] = {"scalar", "avx2", "avx512"};
    if (!name || strcmp(name, "auto") == 0)
        return fs_simd_best();
    for (int k = 0; k < 3; k++)
        if (strcmp(name, names[k]) == 0)
            return k <= (int)fs_simd_best() ? k : -2;
    return -1;
}

/* ---------------------------------------------------------------------------
 * scalar reference */

static inline float ld(const void *p, fs_dtype t, int64_t i)
{
    switch (t) {
    case FS_F16: return fs_f16_to_f32(((const uint16_t *)p)[i]);
    case FS_BF16: return fs_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline void st(void *p, fs_dtype t, int64_t i, float v)
{
    switch (t) {
    case FS_F16: ((uint16_t *)p)[i] = fs_f32_to_f16(v); break;
    case FS_BF16: ((uint16_t *)p)[i] = fs_f32_to_bf16(v); break;
    default: ((float *)p)[i] = v; break;
    }
}

static void reduce_scalar(void *dst, const void *const *srcs, int nsrc, int64_t lo, int64_t hi,
                          fs_dtype t, float scale)
{
    for (int64_t i = lo; i < hi; i++) {
        float acc = ld(srcs[0], t, i);
        for (int k = 1; k < nsrc; k++)
            acc += ld(srcs[k], t, i);
        st(dst, t, i, acc * scale);
    }
}

static void reduce_f64(double *dst, const void *const *srcs, int nsrc, int64_t n, double scale)
{
    for (int64_t i = 0; i < n; i++) {
        double acc = ((const double *)srcs[0])[i];
        for (int k = 1; k < nsrc; k++)
            acc += ((const double *)srcs[k])[i];
        dst[i] = acc * scale;
    }
}

/* ---------------------------------------------------------------------------
 * AVX2 + F16C: 8 elements per step */

#ifdef FS_X86
__attribute__((target("avx2,f16c"))) static inline __m256 ld8(const void *p, fs_dtype t,
                                                               int64_t i)
{
    if (t == FS_F32)
        return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (t == FS_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,f16c"))) static inline void st8(void *p, fs_dtype t, int64_t i,
                                                             __m256 v, int stream)
{
    if (t == FS_F32) {
        if (stream)
            _mm256_stream_ps((float *)p + i, v);
        else
            _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    __m128i out;
    if (t == FS_F16) {
        out = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    } else { /* bf16, round to nearest even; NaN stays quiet NaN (as fs_f32_to_bf16) */
        __m256i u = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
        __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
        __m256i nan = _mm256_cmpgt_epi32(absu, _mm256_set1_epi32(0x7f800000));
        __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        r = _mm256_blendv_epi8(r, q, nan);
        /* 8 x u32 (< 2^16) -> 8 x u16; packus works per 128-bit lane. */
        __m256i p16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
        out = _mm256_castsi256_si128(p16);
    }
    if (stream)
        _mm_stream_si128((__m128i *)((uint16_t *)p + i), out);
    else
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), out);
}

/* Elements [lo, returned) done; with `stream`, dst + lo must be 32-byte
 * aligned (the caller does the head in scalar: same bits). */
__attribute__((target("avx2,f16c"))) static int64_t reduce_avx2(void *dst,
                                                                 const void *const *srcs,
                                                                 int nsrc, int64_t lo, int64_t n,
                                                                 fs_dtype t, float scale,
                                                                 int stream)
{
    const __m256 k = _mm256_set1_ps(scale);
    int64_t i = lo;
    for (; i + 8 <= n; i += 8) {
        __m256 acc = ld8(srcs[0], t, i);
        for (int s = 1; s < nsrc; s++)
            acc = _mm256_add_ps(acc, ld8(srcs[s], t, i));
        st8(dst, t, i, _mm256_mul_ps(acc, k), stream);
    }
    if (stream)
        _mm_sfence();
    return i;
}
#endif

fs_status fs_reduce_sum(void *dst, const void *const *srcs, int nsrc, int64_t n, fs_dtype t,
                        double scale, fs_simd simd, int stream)
{
    if (nsrc < 1 || n < 0 || !fs_dtype_is_float(t))
        return FS_ERR_INVALID_ARG;
    if (n > 0) {
        if (!dst)
            return FS_ERR_INVALID_ARG;
        for (int i = 0; i < nsrc; i++)
            if (!srcs[i])
                return FS_ERR_INVALID_ARG;
    }
    if (t == FS_F64) {
        reduce_f64(dst, srcs, nsrc, n, scale);
        return FS_OK;
    }
    int64_t head = 0, done = 0;
#ifdef FS_X86
    if (simd >= FS_SIMD_AVX2 && fs_simd_best() >= FS_SIMD_AVX2) {
        const size_t es = fs_dtype_size(t);
        stream = stream && ((uintptr_t)dst % es) == 0;
        if (stream) { /* scalar up to the first 32-byte boundary */
            head = (int64_t)(((32 - ((uintptr_t)dst & 31)) & 31) / es);
            head = head < n ? head : n;
            reduce_scalar(dst, srcs, nsrc, 0, head, t, (float)scale);
        }
        done = reduce_avx2(dst, srcs, nsrc, head, n, t, (float)scale, stream);
    }
#else
    (void)simd;
    (void)stream;
#endif
    reduce_scalar(dst, srcs, nsrc, done > head ? done : head, n, t, (float)scale);
    return FS_OK;
}
