/* stream_copy.c - see stream_copy.h. memcpy and an AVX2 streaming loop. */
#include "stream_copy.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* The destination is aligned to a line by a plain copy of its head; the
 * source may have any alignment (unaligned loads cost nothing measurable
 * against memory). Four 32-byte streams per step fill two whole lines. */
__attribute__((target("avx2"))) static void copy_avx2(char *dst, const char *src, size_t n)
{
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
    memcpy(dst + i, src + i, n - i);
    _mm_sfence();
}
#endif

void fs_copy_stream(void *dst, const void *src, size_t n, fs_simd simd)
{
#if defined(__x86_64__) || defined(__i386__)
    if (simd >= FS_SIMD_AVX2 && fs_simd_best() >= FS_SIMD_AVX2) {
        copy_avx2(dst, src, n);
        return;
    }
#endif
    (void)simd;
    memcpy(dst, src, n);
}
