/* copy.h - copy-in / copy-out between parameters and flat buffers, with casts.
 *
 * Scalar loops written so the compiler vectorises the same-dtype and f32
 * paths; the hand-written SIMD kernels live with the optimizer. All sizes
 * are 64-bit element counts. None of these touch Python: the glue releases
 * the GIL around them. */
#ifndef FS_COPY_H
#define FS_COPY_H

#include <stdint.h>
#include "fs_dtype.h"
#include "fs_status.h"
#include "layout.h"

/* dst[i] = (dst_t)src[i], i < n. Same dtype is a memmove. Any float dtype
 * to any float dtype; integer types only to themselves. */
fs_status fs_cast(void *dst, fs_dtype dst_t, const void *src, fs_dtype src_t, int64_t n);

fs_status fs_zero(void *dst, fs_dtype t, int64_t n);

/* dst[i] = (accumulate ? dst[i] : 0) + scale * src[i], computed in f32
 * (f64 for f64). Used to fold the post-reduction divide into the gradient
 * accumulation. dst and src may be the same buffer. */
fs_status fs_scale_accumulate(void *dst, fs_dtype dst_t, const void *src, fs_dtype src_t,
                              int64_t n, double scale, int accumulate);

/* One contiguous piece to move: dst + dst_offset <- src + src_offset, numel
 * elements, casting src_t to the buffer's dtype. */
typedef struct {
    void *src;
    fs_dtype src_t;
    int64_t src_offset;
    int64_t dst_offset;
    int64_t numel;
} fs_piece;

/* Copy every piece into `dst` (dtype dst_t, dst_numel elements), then zero
 * every element no piece covered ([Note: padding] in layout.h). */
fs_status fs_gather_pieces(void *dst, fs_dtype dst_t, int64_t dst_numel, const fs_piece *pieces,
                           int64_t n);

/* DIM0 copy-out: gathered is (world_size, block_numel) of dtype t; write
 * parameter e's dim0 * row_numel elements (unpadded) to dst. */
fs_status fs_dim0_copy_out(void *dst, fs_dtype dst_t, const void *gathered, fs_dtype t,
                           int64_t world_size, int64_t block_numel, const fs_dim0_entry *e);

/* DIM0 copy-in: write this rank's rows of the full parameter `src` into
 * its padded chunk of `block`, zero-filling the rows it does not hold. */
fs_status fs_dim0_copy_in(void *block, fs_dtype t, const void *src, fs_dtype src_t,
                          const fs_dim0_entry *e);

#endif
