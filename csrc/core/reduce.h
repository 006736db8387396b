/* reduce.h - elementwise sums of several buffers, the hot loop of the
 * shared-memory reductions.
 *
 * dst[i] = scale * (srcs[0][i] + srcs[1][i] + ... ), summed in that order
 * in f32 (f64 for f64, where scale stays double) whatever the storage
 * dtype, then stored as dtype.
 * The order is fixed so every rank that reduces the same sources gets the
 * same bits. The instruction set is chosen at run time; the scalar path is
 * the reference and the SIMD paths give identical bits (no FMA, same order).
 */
#ifndef FS_REDUCE_H
#define FS_REDUCE_H

#include <stdint.h>
#include "fs_dtype.h"
#include "fs_status.h"

/* Ordered: a level includes the ones below it. */
typedef enum {
    FS_SIMD_SCALAR = 0,
    FS_SIMD_AVX2 = 1,   /* AVX2 + F16C */
    FS_SIMD_AVX512 = 2, /* + AVX-512 F and BW (the optimizers; reductions use AVX2) */
} fs_simd;

/* Best level this CPU supports (detected once). */
fs_simd fs_simd_best(void);
const char *fs_simd_name(fs_simd s);
/* "auto" (the best), "scalar", "avx2" or "avx512" -> the level, capped at
 * the best this CPU has; -1 for an unknown name, -2 for a level this CPU
 * lacks. */
int fs_simd_parse(const char *name);

/* nsrc >= 1; dst may be one of the sources. Float dtypes only. With
 * `stream`, the SIMD path writes dst with non-temporal stores (for an output
 * nobody reads soon: stream_copy.h); the bits are the same either way. */
fs_status fs_reduce_sum(void *dst, const void *const *srcs, int nsrc, int64_t n, fs_dtype t,
                        double scale, fs_simd simd, int stream);

#endif
