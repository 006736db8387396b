/* layout.h - flat-parameter layout arithmetic: offsets, padding, shard ranges.
 *
 * Pure integer arithmetic from a size table; no Python, no CUDA, no memory
 * allocation. This is the only place where the flat layout is decided.
 *
 * Two layouts:
 *
 *  FLAT (torch FSDP1): parameters are concatenated, each starting at an
 *  offset rounded up to `align_numel` elements, then the buffer is cut into
 *  world_size equal contiguous shards. The unsharded buffer holds every
 *  parameter as a plain view.
 *
 *  DIM0 (torch FSDP2): each parameter is cut on dim 0 into world_size chunks
 *  of ceil(dim0 / world_size) rows (torch.chunk's rule); every rank's chunk
 *  is padded to that row count. A rank's all-gather input ("block") is its
 *  padded chunks laid end to end, each starting at a multiple of
 *  `align_numel`; the gathered buffer is (world_size, block_numel) and each
 *  parameter is copied out of it into the unsharded buffer, where each
 *  starts aligned too and the end is padded so that every post-forward group
 *  (int reshard_after_forward) keeps an equal chunk.
 *
 * [Note: padding] Padding is decided here once and is always zero-filled by
 * the callers: FLAT pads between parameters (alignment) and at the end (so
 * the total divides by world_size and every shard starts aligned); DIM0 pads
 * each chunk to the common row count and aligns chunk starts. Padding never
 * carries data, and reduce-scatter over it sums zeros.
 */
#ifndef FS_LAYOUT_H
#define FS_LAYOUT_H

#include <stdint.h>
#include "fs_status.h"

/* Every parameter in a flat buffer (FLAT and DIM0) starts at a multiple of
 * this many bytes, and every shard or block is a multiple of it: vector
 * loads, and what NCCL prefers. The one place the rule is written. */
#define FS_ALIGN_BYTES 16

/* The alignment in elements of elem_bytes each (at least 1). */
static inline int64_t fs_align_numel(int64_t elem_bytes)
{
    return elem_bytes > 0 && elem_bytes < FS_ALIGN_BYTES ? FS_ALIGN_BYTES / elem_bytes : 1;
}

/* One parameter in the FLAT layout, seen from one rank. */
typedef struct {
    int64_t numel;         /* elements of the parameter */
    int64_t flat_offset;   /* its start in the unsharded flat buffer */
    int64_t shard_offset;  /* start of this rank's piece inside the local shard */
    int64_t param_offset;  /* start of this rank's piece inside the (flattened) parameter */
    int64_t piece_numel;   /* length of this rank's piece; 0 when the rank holds none */
} fs_flat_entry;

typedef struct {
    int64_t unpadded_numel; /* end of the last parameter (aligned starts included) */
    int64_t shard_numel;    /* elements every rank holds, padding included */
    int64_t padded_numel;   /* shard_numel * world_size */
    int64_t shard_begin;    /* rank * shard_numel: the local shard's start in the flat buffer */
} fs_flat_layout;

/* numels[n] -> entries[n] and *layout for `rank` of `world_size`.
 * align_numel >= 1. Zero-size parameters are allowed (and n == 0). */
fs_status fs_layout_flat(const int64_t *numels, int64_t n, int64_t world_size, int64_t rank,
                         int64_t align_numel, fs_flat_entry *entries, fs_flat_layout *layout);

/* One parameter in the DIM0 layout, seen from one rank. */
typedef struct {
    int64_t dim0;               /* rows (1 for a 0-d tensor) */
    int64_t row_numel;          /* elements per row: product of the other dims */
    int64_t chunk_rows;         /* ceil(dim0 / world_size): rows of every padded chunk */
    int64_t block_offset;       /* start of the padded chunk inside each rank's block */
    int64_t local_row_begin;    /* first row this rank holds (== dim0 when it holds none) */
    int64_t local_rows;         /* rows this rank really holds, 0..chunk_rows */
} fs_dim0_entry;

typedef struct {
    int64_t block_numel;    /* one rank's all-gather input, padding included */
    int64_t gathered_numel; /* block_numel * world_size */
} fs_dim0_layout;

fs_status fs_layout_dim0(const int64_t *dim0, const int64_t *row_numel, int64_t n,
                         int64_t world_size, int64_t rank, int64_t align_numel,
                         fs_dim0_entry *entries, fs_dim0_layout *layout);

/* DIM0's unsharded buffer: numels[i] elements of parameter i (0 for one
 * that is not gathered into it) at offsets[i], each start a multiple of
 * align_numel; the whole (*alloc_numel) padded to a multiple of
 * align_numel * world_size, so that any group size dividing world_size cuts
 * it into equal aligned chunks (int reshard_after_forward). */
fs_status fs_layout_dim0_unsharded(const int64_t *numels, int64_t n, int64_t world_size,
                                   int64_t align_numel, int64_t *offsets, int64_t *alloc_numel);

/* The chunk of that buffer which rank `rank` of a post-forward group of
 * group_size ranks keeps after forward, and gathers it back from:
 * [*offset, *offset + *numel) (offset may be NULL). group_size must
 * divide alloc_numel. */
fs_status fs_layout_dim0_post_chunk(int64_t alloc_numel, int64_t group_size, int64_t rank,
                                    int64_t *offset, int64_t *numel);

/* Rows that `rank` holds of a parameter cut by the DIM0 rule. */
void fs_dim0_rows(int64_t dim0, int64_t world_size, int64_t rank, int64_t *row_begin,
                  int64_t *rows);

#endif
