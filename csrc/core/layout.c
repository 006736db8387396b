/* layout.c - see layout.h. Pure arithmetic; tested on its own. */
#include "layout.h"

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

fs_status fs_layout_flat(const int64_t *numels, int64_t n, int64_t world_size, int64_t rank,
                         int64_t align_numel, fs_flat_entry *entries, fs_flat_layout *layout)
{
    if (n < 0 || world_size < 1 || rank < 0 || rank >= world_size || align_numel < 1)
        return FS_ERR_INVALID_ARG;
    int64_t end = 0;
    for (int64_t i = 0; i < n; i++) {
        if (numels[i] < 0)
            return FS_ERR_INVALID_ARG;
        int64_t off = round_up(end, align_numel);
        entries[i].numel = numels[i];
        entries[i].flat_offset = off;
        end = off + numels[i];
    }
    /* Every shard starts aligned: shard_numel is a multiple of align_numel. */
    int64_t shard = round_up((end + world_size - 1) / world_size, align_numel);
    layout->unpadded_numel = end;
    layout->shard_numel = shard;
    layout->padded_numel = shard * world_size;
    layout->shard_begin = shard * rank;

    int64_t lo = layout->shard_begin, hi = lo + shard;
    for (int64_t i = 0; i < n; i++) {
        fs_flat_entry *e = &entries[i];
        int64_t b = max64(e->flat_offset, lo);
        int64_t t = min64(e->flat_offset + e->numel, hi);
        if (t > b) {
            e->shard_offset = b - lo;
            e->param_offset = b - e->flat_offset;
            e->piece_numel = t - b;
        } else {
            /* No piece here; park the empty slice where it would begin so a
             * zero-length view of the shard is still in range. */
            e->shard_offset = min64(max64(e->flat_offset - lo, 0), shard);
            e->param_offset = 0;
            e->piece_numel = 0;
        }
    }
    return FS_OK;
}

void fs_dim0_rows(int64_t dim0, int64_t world_size, int64_t rank, int64_t *row_begin,
                  int64_t *rows)
{
    int64_t chunk = (dim0 + world_size - 1) / world_size;
    int64_t b = min64(chunk * rank, dim0);
    int64_t t = min64(chunk * (rank + 1), dim0);
    *row_begin = b;
    *rows = t - b;
}

fs_status fs_layout_dim0(const int64_t *dim0, const int64_t *row_numel, int64_t n,
                         int64_t world_size, int64_t rank, int64_t align_numel,
                         fs_dim0_entry *entries, fs_dim0_layout *layout)
{
    if (n < 0 || world_size < 1 || rank < 0 || rank >= world_size || align_numel < 1)
        return FS_ERR_INVALID_ARG;
    int64_t end = 0;
    for (int64_t i = 0; i < n; i++) {
        if (dim0[i] < 0 || row_numel[i] < 0)
            return FS_ERR_INVALID_ARG;
        fs_dim0_entry *e = &entries[i];
        e->dim0 = dim0[i];
        e->row_numel = row_numel[i];
        e->chunk_rows = (dim0[i] + world_size - 1) / world_size;
        e->block_offset = round_up(end, align_numel);
        fs_dim0_rows(dim0[i], world_size, rank, &e->local_row_begin, &e->local_rows);
        end = e->block_offset + e->chunk_rows * e->row_numel;
    }
    layout->block_numel = round_up(end, align_numel);
    layout->gathered_numel = layout->block_numel * world_size;
    return FS_OK;
}

fs_status fs_layout_dim0_unsharded(const int64_t *numels, int64_t n, int64_t world_size,
                                   int64_t align_numel, int64_t *offsets, int64_t *alloc_numel)
{
    if (n < 0 || world_size < 1 || align_numel < 1)
        return FS_ERR_INVALID_ARG;
    int64_t pos = 0;
    for (int64_t i = 0; i < n; i++) {
        if (numels[i] < 0 || numels[i] > INT64_MAX - pos - align_numel)
            return FS_ERR_INVALID_ARG;
        offsets[i] = pos;
        pos += round_up(numels[i], align_numel);
    }
    *alloc_numel = round_up(pos, align_numel * world_size);
    return FS_OK;
}

fs_status fs_layout_dim0_post_chunk(int64_t alloc_numel, int64_t group_size, int64_t rank,
                                    int64_t *offset, int64_t *numel)
{
    if (alloc_numel < 0 || group_size < 1 || rank < 0 || rank >= group_size ||
        alloc_numel % group_size)
        return FS_ERR_INVALID_ARG;
    *numel = alloc_numel / group_size;
    if (offset)
        *offset = rank * *numel;
    return FS_OK;
}
