/* norm.c - see norm.h. Four f64 accumulators keep the loop vectorisable
 * without -ffast-math (the sum order is fixed, not reassociated freely). */
#include "norm.h"

#include <math.h>

static inline double load(const void *x, fs_dtype t, int64_t i)
{
    switch (t) {
    case FS_F32: return ((const float *)x)[i];
    case FS_F16: return fs_f16_to_f32(((const uint16_t *)x)[i]);
    case FS_BF16: return fs_bf16_to_f32(((const uint16_t *)x)[i]);
    default: return ((const double *)x)[i];
    }
}

fs_status fs_norm_partial(const void *x, fs_dtype t, int64_t n, int inf, double *out)
{
    if (n < 0 || !fs_dtype_is_float(t) || (n > 0 && !x))
        return FS_ERR_INVALID_ARG;
    double acc[4] = {0, 0, 0, 0};
    int64_t i = 0;
    if (t == FS_F32 && !inf) { /* the hot case */
        const float *f = x;
        for (; i + 4 <= n; i += 4)
            for (int k = 0; k < 4; k++)
                acc[k] += (double)f[i + k] * f[i + k];
    }
    for (; i < n; i++) {
        double v = load(x, t, i);
        if (inf) {
            v = fabs(v);
            if (v > acc[0] || isnan(v))
                acc[0] = v; /* a NaN gradient makes the norm NaN, as torch's */
        } else {
            acc[i & 3] += v * v;
        }
    }
    *out = inf ? acc[0] : (acc[0] + acc[1]) + (acc[2] + acc[3]);
    return FS_OK;
}
