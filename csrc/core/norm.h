/* norm.h - one-pass partial norms of gradient shards (for clip_grad_norm_).
 * Sums of squares accumulate in f64 so a shard of 2^31 elements keeps its
 * precision; the cross-rank combination happens in the caller. */
#ifndef FS_NORM_H
#define FS_NORM_H

#include <stdint.h>
#include "fs_dtype.h"
#include "fs_status.h"

/* *out = sum(x^2) (inf == 0) or max(|x|) (inf == 1) over n elements. */
fs_status fs_norm_partial(const void *x, fs_dtype t, int64_t n, int inf, double *out);

#endif
