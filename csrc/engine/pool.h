/* pool.h - host memory for buffers that live as long as one unit's gather
 * (the unsharded buffer, its low-precision copy, reduction staging).
 *
 * Why not malloc: glibc serves a large request with mmap only until the
 * first such block is freed; then it raises its mmap threshold to that size
 * (up to 32 MiB), and every later unit-sized buffer comes from the heap,
 * where what resharding frees stays in the process. Here every block is its
 * own mapping: a block handed back is either kept, resident, for the next
 * gather of the same size (no page faults, no zeroing), or unmapped, which
 * returns its pages to the system at once.
 *
 * [Note: pool cache] At most `keep_blocks` free large blocks stay mapped (the
 * next unit's gather and one prefetch); a give beyond that unmaps the large
 * block freed longest ago. Small blocks (up to FS_POOL_SMALL_BYTES: the
 * gathers and reduction staging of units of a few thousand parameters) are
 * not counted against keep_blocks but against a byte budget of their own,
 * FS_POOL_SMALL_BUDGET: a unit's cycle takes three blocks (its unsharded
 * buffer and two for the reduction), and a cache of two large blocks made
 * every small unit map and unmap one, a syscall pair that cost more than
 * the unit's compute. A keep_blocks of 0 keeps nothing, small or large.
 * fs_pool_trim_idle() unmaps every free block when no gather holds one (the
 * end of a backward pass), so that between steps the process holds only its
 * model states.
 *
 * Pure allocator logic: no Python, no torch; thread-safe (a block may be
 * handed back from whichever thread drops the last tensor over it). */
#ifndef FS_POOL_H
#define FS_POOL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "fs_status.h"

/* [Note: pool cache] */
#define FS_POOL_SMALL_BYTES ((size_t)256 << 10)
#define FS_POOL_SMALL_BUDGET ((size_t)4 << 20)

typedef struct {
    void *ptr;
    size_t bytes;      /* mapped length: the request rounded up to whole pages
                        * (whole 2 MiB huge pages from 2 MiB on) */
    uint64_t freed_at; /* the pool's give counter when it was handed back */
    int in_use;
    int cacheable;     /* kept for reuse when handed back; else unmapped at once */
} fs_pool_block;

typedef struct {
    size_t live_bytes;      /* handed out now */
    size_t cached_bytes;    /* free, mapped and resident, kept for the next take */
    size_t peak_live_bytes; /* since creation, or since fs_pool_reset_peak */
    uint64_t maps;          /* blocks mapped (each one page-faulted in once) */
    uint64_t reuses;        /* takes served from the cache */
    uint64_t unmaps;        /* blocks returned to the system */
} fs_pool_stats;

typedef struct {
    pthread_mutex_t lock;
    fs_pool_block *blocks; /* every mapped block, in use or cached */
    size_t nblocks, cap;
    int keep_blocks;       /* [Note: pool cache] */
    uint64_t gives;
    fs_pool_stats stats;
} fs_pool;

/* [Note: pool cache]: the blocks a process pool keeps to begin with: the
 * unit being used and one prefetched, the gathers in flight at once. */
#define FS_POOL_KEEP_BLOCKS 2

/* The process's pool: one per process, like the C library's heap it stands
 * in for (a block may come back from any thread, after every engine object
 * is gone); made at the first call, keeping FS_POOL_KEEP_BLOCKS. */
fs_pool *fs_pool_process(void);

void fs_pool_init(fs_pool *p, int keep_blocks);
/* Unmaps every block, in use or not: only when nothing refers to them. */
void fs_pool_destroy(fs_pool *p);

/* A page-aligned block of at least nbytes (>= 1), resident (faulted in) and
 * with undefined contents: a cached block of the same rounded size if there
 * is one, else a new mapping. cacheable: kept for the next take when handed
 * back (gathers, which recur within a step); 0 for buffers that live until
 * the step ends (gradient shards), unmapped when handed back. */
fs_status fs_pool_take(fs_pool *p, size_t nbytes, int cacheable, void **out);
/* Hand back a block from fs_pool_take. FS_ERR_INVALID_ARG for a pointer the
 * pool did not hand out (nothing changes). */
fs_status fs_pool_give(fs_pool *p, void *ptr);
/* Unmap every free block if no cacheable block is in use (no gather is
 * live); returns the bytes released. */
size_t fs_pool_trim_idle(fs_pool *p);
/* Unmap every free block; returns the bytes released. */
size_t fs_pool_trim(fs_pool *p);

/* A resident, zero-filled mapping of at least nbytes outside any pool, for
 * buffers that live as long as training does and are streamed through
 * whole every step (optimizer state): from FS_POOL_HUGE_BYTES on it is
 * whole, aligned huge pages where they come without a stall (transparent
 * huge pages enabled, memory free in 2 MiB blocks), so that a streaming loop
 * crosses a 2 MiB page boundary where it crossed 512 small ones, each of
 * which stops the hardware prefetcher; populated by up to `threads` threads
 * ([Note: state populated in parallel] in pool.c). *mapped: the length to
 * hand to fs_unmap. FS_ERR_NO_MEMORY when it cannot be mapped. */
#define FS_STATE_MAX_THREADS 64
fs_status fs_map_resident(size_t nbytes, int threads, void **out, size_t *mapped);
void fs_unmap(void *ptr, size_t mapped);

fs_pool_stats fs_pool_get_stats(fs_pool *p);
void fs_pool_reset_peak(fs_pool *p);
void fs_pool_set_keep(fs_pool *p, int keep_blocks);

#endif
