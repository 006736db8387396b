/* reduce_rule.c - see reduce_rule.h ([Note: divide rule]). */
#include "reduce_rule.h"

#include <math.h>

/* torch's loop, in doubles as torch's Python floats: p doubled from 1 while
 * p divides f and f / p > p. */
static double predivide(double f)
{
    double p = 1.0;
    while (fmod(f, p) == 0.0 && f / p > p)
        p *= 2.0;
    return p;
}

fs_status fs_divide_rule(fs_divide_api api, fs_dtype reduce, int shard_world,
                         int replicate_world, double factor, int force_sum, fs_divide *out)
{
    if (shard_world < 1 || replicate_world < 1 || !(factor >= 0.0) || isinf(factor) ||
        !fs_dtype_is_float(reduce) || (api != FS_DIVIDE_FLAT && api != FS_DIVIDE_FULLY_SHARD) ||
        (api == FS_DIVIDE_FLAT && (factor > 0.0 || force_sum)))
        return FS_ERR_INVALID_ARG;
    const double n = (double)shard_world * (double)replicate_world;
    fs_divide d = {1.0, 1.0, 1.0, 1.0};
    if (api == FS_DIVIDE_FLAT) {
        d.pre = predivide(n);
        d.post = n / d.pre;
    } else {
        const int overflow_risk = reduce != FS_F32 && reduce != FS_BF16;
        const double f = factor > 0.0 ? factor : n;
        if (!overflow_risk && !force_sum) {
            d.in_comm = f; /* one rank without a factor: SUM, and f == 1 */
        } else {
            d.pre = overflow_risk ? predivide(f) : 1.0;
            d.post = f / d.pre;
        }
    }
    d.hold = d.pre * d.in_comm;
    *out = d;
    return FS_OK;
}

int fs_divide_fuses(fs_dtype out, fs_dtype reduce, int accumulate)
{
    return out == reduce && (!accumulate || reduce == FS_F32 || reduce == FS_F64);
}

/* torch.promote_types on two floats: the wider one; float16 with bfloat16
 * (same width, neither holds the other) gives float32. */
static fs_dtype promote_float(fs_dtype a, fs_dtype b)
{
    if (a == b)
        return a;
    if (fs_dtype_size(a) != fs_dtype_size(b))
        return fs_dtype_size(a) > fs_dtype_size(b) ? a : b;
    return FS_F32;
}

fs_status fs_reduce_dtype(fs_reduce_dtype_rule rule, fs_dtype set, fs_dtype compute,
                          const fs_dtype *accumulate, int n, fs_dtype *out)
{
    if ((rule != FS_REDUCE_IN_COMPUTE && rule != FS_REDUCE_IN_GRAD) || n < 0 ||
        (n > 0 && accumulate == NULL) || !fs_dtype_is_float(compute) ||
        (set != FS_DTYPE_COUNT && !fs_dtype_is_float(set)))
        return FS_ERR_INVALID_ARG;
    for (int i = 0; i < n; i++)
        if (!fs_dtype_is_float(accumulate[i]))
            return FS_ERR_INVALID_ARG;
    if (set != FS_DTYPE_COUNT) {
        *out = set;
        return FS_OK;
    }
    if (rule == FS_REDUCE_IN_COMPUTE) {
        *out = compute;
        return FS_OK;
    }
    if (n == 0)
        return FS_ERR_INVALID_ARG;
    fs_dtype d = accumulate[0];
    for (int i = 1; i < n; i++)
        d = promote_float(d, accumulate[i]);
    *out = d;
    return FS_OK;
}
