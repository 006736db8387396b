/* quant.c - see quant.h. The scalar reference, and AVX2 kernels chosen at
 * run time that give the same bits. Each block is quantized from float32:
 * float16/bfloat16 inputs are widened into a stack buffer first; each
 * block is dequantized into float32 pieces that a cast stores, unless the
 * destination is float32 itself. */
#include "quant.h"

#include <math.h>
#include <string.h>

#include "copy.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FS_X86 1
#endif

#define PIECE 256 /* dequantized values staged at once for a cast */

int fs_quant_valid(int bits, int64_t block)
{
    return (bits == 8 || bits == 4) && block > 0 && block % FS_QUANT_BLOCK_MULTIPLE == 0 &&
           block <= FS_QUANT_BLOCK_MAX;
}

static int64_t nblocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

static int64_t code_bytes(int64_t n, int bits) { return bits == 8 ? n : (n + 1) / 2; }

int64_t fs_quant_payload_bytes(int64_t n, int bits, int64_t block)
{
    if (n <= 0)
        return 0;
    int64_t b = 4 * nblocks(n, block) + code_bytes(n, bits);
    return (b + FS_QUANT_ALIGN - 1) / FS_QUANT_ALIGN * FS_QUANT_ALIGN;
}

/* [Note: quantization rule]: a block's scale and its inverse from its
 * absmax (and whether it held an infinity or a NaN). */
static float block_scale(float absmax, int bad, int qmax, float *inv)
{
    if (bad) {
        *inv = 0.0f;
        return NAN;
    }
    float s = absmax / (float)qmax;
    float i = s > 0.0f ? 1.0f / s : 0.0f;
    if (!(s > 0.0f) || !(i < INFINITY)) { /* zeros, or too small to scale */
        *inv = 0.0f;
        return 0.0f;
    }
    *inv = i;
    return s;
}

static inline int code_of(float x, float inv, int qmax)
{
    float r = nearbyintf(x * inv);
    r = r < (float)-qmax ? (float)-qmax : r > (float)qmax ? (float)qmax : r;
    return (int)r;
}

static inline int nibble(const uint8_t *codes, int64_t i)
{
    int v = (codes[i >> 1] >> ((i & 1) * 4)) & 0xF;
    return (v ^ 8) - 8;
}

/* ---------------------------------------------------------------------------
 * scalar reference: one block of len float32 values */

static float absmax_scalar(const float *x, int64_t lo, int64_t len, float m, int *bad)
{
    for (int64_t i = lo; i < len; i++) {
        float a = fabsf(x[i]);
        if (!(a < INFINITY))
            *bad = 1;
        else if (a > m)
            m = a;
    }
    return m;
}

static void codes_scalar(uint8_t *codes, const float *x, int64_t lo, int64_t len, float inv,
                         int bits)
{
    const int qmax = bits == 8 ? 127 : 7;
    for (int64_t i = lo; i < len; i++) {
        int q = code_of(x[i], inv, qmax);
        if (bits == 8) {
            codes[i] = (uint8_t)(int8_t)q;
        } else if (i & 1) {
            codes[i >> 1] = (uint8_t)((codes[i >> 1] & 0x0F) | ((q & 0xF) << 4));
        } else {
            codes[i >> 1] = (uint8_t)(q & 0xF);
        }
    }
}

static void values_scalar(float *out, const uint8_t *codes, int64_t lo, int64_t len,
                          float scale, int bits, int accumulate)
{
    for (int64_t i = lo; i < len; i++) {
        float v = (float)(bits == 8 ? (int8_t)codes[i] : nibble(codes, i)) * scale;
        out[i] = accumulate ? out[i] + v : v;
    }
}

/* ---------------------------------------------------------------------------
 * AVX2: 32 values a step when quantizing, 8 when dequantizing; the tails
 * run the scalar loops from where these stop */

#ifdef FS_X86
__attribute__((target("avx2"))) static int64_t absmax_avx2(const float *x, int64_t len,
                                                            float *m, int *bad)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 mx = _mm256_setzero_ps(), nonfinite = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
        nonfinite = _mm256_or_ps(nonfinite, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));
        mx = _mm256_max_ps(mx, a);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    if (_mm256_movemask_ps(nonfinite))
        *bad = 1;
    for (int k = 0; k < 8; k++)
        if (lanes[k] > *m)
            *m = lanes[k];
    return i;
}

__attribute__((target("avx2"))) static inline __m256i codes8(const float *x, __m256 inv,
                                                              __m256 lo, __m256 hi)
{
    __m256i q[4];
    for (int k = 0; k < 4; k++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), inv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[k] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

__attribute__((target("avx2"))) static int64_t codes_avx2(uint8_t *codes, const float *x,
                                                           int64_t len, float inv, int bits)
{
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const __m256 vi = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-qmax), hi = _mm256_set1_ps(qmax);
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        __m256i b = codes8(x + i, vi, lo, hi);
        if (bits == 8) {
            _mm256_storeu_si256((__m256i *)(codes + i), b);
            continue;
        }
        /* pairs of codes as 16-bit words: the even one's nibble low, the odd one's high */
        __m256i t = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi16(0x000F)),
                                    _mm256_and_si256(_mm256_srli_epi16(b, 4),
                                                     _mm256_set1_epi16(0x00F0)));
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(t, t), 0xD8);
        _mm_storeu_si128((__m128i *)(codes + i / 2), _mm256_castsi256_si128(p));
    }
    return i;
}

__attribute__((target("avx2"))) static int64_t values_avx2(float *out, const uint8_t *codes,
                                                            int64_t len, float scale, int bits,
                                                            int accumulate)
{
    const __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        __m128i c;
        if (bits == 8) {
            c = _mm_loadl_epi64((const __m128i *)(codes + i));
        } else {
            int32_t w;
            memcpy(&w, codes + i / 2, 4);
            __m128i v = _mm_cvtsi32_si128(w), m = _mm_set1_epi8(0x0F), e = _mm_set1_epi8(8);
            c = _mm_unpacklo_epi8(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
            c = _mm_sub_epi8(_mm_xor_si128(c, e), e);
        }
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), s);
        if (accumulate)
            v = _mm256_add_ps(_mm256_loadu_ps(out + i), v);
        _mm256_storeu_ps(out + i, v);
    }
    return i;
}
#endif

static int use_avx2(fs_simd simd)
{
#ifdef FS_X86
    return simd >= FS_SIMD_AVX2 && fs_simd_best() >= FS_SIMD_AVX2;
#else
    (void)simd;
    return 0;
#endif
}

/* ---------------------------------------------------------------------------
 * entry points */

fs_status fs_quantize(void *payload, const void *src, fs_dtype t, int64_t n, int bits,
                      int64_t block, fs_simd simd)
{
    if (!fs_quant_valid(bits, block) || n < 0 || !fs_dtype_is_float(t))
        return FS_ERR_INVALID_ARG;
    if (n == 0)
        return FS_OK;
    if (!payload || !src)
        return FS_ERR_INVALID_ARG;
    const int avx2 = use_avx2(simd);
    const int qmax = bits == 8 ? 127 : 7;
    const int64_t nb = nblocks(n, block);
    float *scales = payload;
    uint8_t *codes = (uint8_t *)payload + 4 * nb;
    float stage[FS_QUANT_BLOCK_MAX];
    const size_t es = fs_dtype_size(t);
    for (int64_t k = 0; k < nb; k++) {
        const int64_t off = k * block, len = n - off < block ? n - off : block;
        const float *x = (const float *)((const char *)src + (size_t)off * es);
        if (t != FS_F32) {
            fs_cast(stage, FS_F32, (const char *)src + (size_t)off * es, t, len);
            x = stage;
        }
        float m = 0.0f;
        int bad = 0;
        int64_t done = 0;
#ifdef FS_X86
        if (avx2)
            done = absmax_avx2(x, len, &m, &bad);
#endif
        m = absmax_scalar(x, done, len, m, &bad);
        float inv;
        scales[k] = block_scale(m, bad, qmax, &inv);
        uint8_t *c = codes + (bits == 8 ? off : off / 2);
        if (bad) { /* zero codes: x * 0 would be NaN for the infinities */
            memset(c, 0, (size_t)code_bytes(len, bits));
            continue;
        }
        done = 0;
#ifdef FS_X86
        if (avx2)
            done = codes_avx2(c, x, len, inv, bits);
#endif
        codes_scalar(c, x, done, len, inv, bits);
    }
    return FS_OK;
}

fs_status fs_dequantize(void *dst, fs_dtype dt, const void *payload, int64_t n, int bits,
                        int64_t block, int accumulate, fs_simd simd)
{
    if (!fs_quant_valid(bits, block) || n < 0 || !fs_dtype_is_float(dt) ||
        (accumulate && dt != FS_F32))
        return FS_ERR_INVALID_ARG;
    if (n == 0)
        return FS_OK;
    if (!payload || !dst)
        return FS_ERR_INVALID_ARG;
    const int avx2 = use_avx2(simd);
    const int64_t nb = nblocks(n, block);
    const float *scales = payload;
    const uint8_t *codes = (const uint8_t *)payload + 4 * nb;
    const size_t es = fs_dtype_size(dt);
    float stage[PIECE];
    for (int64_t k = 0; k < nb; k++) {
        const int64_t off = k * block, len = n - off < block ? n - off : block;
        const uint8_t *c = codes + (bits == 8 ? off : off / 2);
        /* float32 straight into dst; other dtypes PIECE values at a time (a
         * multiple of 32: an int4 piece starts on a byte) through stage */
        for (int64_t p = 0; p < len; p += dt == FS_F32 ? len : PIECE) {
            const int64_t pl = dt == FS_F32 ? len : len - p < PIECE ? len - p : PIECE;
            float *out = dt == FS_F32 ? (float *)dst + off : stage;
            const uint8_t *pc = c + (bits == 8 ? p : p / 2);
            int64_t done = 0;
#ifdef FS_X86
            if (avx2)
                done = values_avx2(out, pc, pl, scales[k], bits, accumulate);
#endif
            values_scalar(out, pc, done, pl, scales[k], bits, accumulate);
            if (dt != FS_F32)
                fs_cast((char *)dst + (size_t)(off + p) * es, dt, stage, FS_F32, pl);
        }
    }
    return FS_OK;
}
