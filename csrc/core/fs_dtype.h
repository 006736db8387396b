/* fs_dtype.h - element types that cross into the C core, and scalar casts.
 *
 * Codes are fixed (Python maps torch dtypes onto them in one table).
 * bf16 and fp16 are converted by hand so the scalar path is exact and
 * portable; round-to-nearest-even on the way down, as torch does. */
#ifndef FS_DTYPE_H
#define FS_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef enum {
    FS_F32 = 0,
    FS_F16 = 1,
    FS_BF16 = 2,
    FS_F64 = 3,
    FS_U8 = 4,   /* raw bytes: broadcast of any dtype */
    FS_I32 = 5,
    FS_I64 = 6,
    FS_DTYPE_COUNT
} fs_dtype;

static inline size_t fs_dtype_size(fs_dtype t)
{
    static const size_t sizes[FS_DTYPE_COUNT] = {4, 2, 2, 8, 1, 4, 8};
    return (unsigned)t < FS_DTYPE_COUNT ? sizes[t] : 0;
}

static inline int fs_dtype_is_float(fs_dtype t)
{
    return t == FS_F32 || t == FS_F16 || t == FS_BF16 || t == FS_F64;
}

const char *fs_dtype_name(fs_dtype t);

static inline float fs_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t fs_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet, keep sign */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float fs_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while ((man & 0x400u) == 0) {
                man <<= 1;
                exp--;
            }
            man &= 0x3ffu;
            u = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t fs_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN */
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) /* rounds to >= 65520: overflow to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below the smallest normal half: subnormal or 0 */
        if (a < 0x33000000u)
            return (uint16_t)sign;
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; /* 14..24 */
        uint32_t half = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - ((127u - 15u) << 23);
    return (uint16_t)(sign | (r >> 13));
}

#endif
