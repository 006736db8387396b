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
