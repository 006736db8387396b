/* checksum.c - CRC-32C: a byte-at-a-time table and the SSE4.2 crc32
 * instruction, 8 bytes a step. See checksum.h. */
#include "checksum.h"

#include <string.h>

#define FS_CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static uint32_t table[256];
static int table_ready;

static void make_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (FS_CRC32C_POLY & (0u - (c & 1u)));
        table[i] = c;
    }
    table_ready = 1; /* the same values from any thread that races here */
}

uint32_t fs_crc32c_table(uint32_t crc, const void *p, size_t n)
{
    if (!table_ready)
        make_table();
    const unsigned char *b = p;
    crc = ~crc;
    while (n--)
        crc = (crc >> 8) ^ table[(crc ^ *b++) & 0xFFu];
    return ~crc;
}

#if defined(__x86_64__)
#include <nmmintrin.h>

__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const void *p,
                                                                size_t n)
{
    const unsigned char *b = p;
    uint64_t c = ~crc;
    for (; n && ((uintptr_t)b & 7u); n--)
        c = _mm_crc32_u8((uint32_t)c, *b++);
    for (; n >= 8; n -= 8, b += 8) {
        uint64_t w;
        memcpy(&w, b, 8);
        c = _mm_crc32_u64(c, w);
    }
    for (; n; n--)
        c = _mm_crc32_u8((uint32_t)c, *b++);
    return ~(uint32_t)c;
}

uint32_t fs_crc32c(uint32_t crc, const void *p, size_t n)
{
    static int hw = -1;
    if (hw < 0)
        hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    return hw ? crc32c_sse42(crc, p, n) : fs_crc32c_table(crc, p, n);
}
#else
uint32_t fs_crc32c(uint32_t crc, const void *p, size_t n)
{
    return fs_crc32c_table(crc, p, n);
}
#endif
