/* pool.c - the host pool of unit-lifetime blocks (pool.h): one anonymous
 * mapping per block, a small cache of free ones. Not a general allocator:
 * a handful of sizes (one per unit group) and tens of blocks, so a linear
 * table is all the bookkeeping needed. */
#define _GNU_SOURCE
#include "pool.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static size_t page_bytes(void)
{
    long n = sysconf(_SC_PAGESIZE);
    return n > 0 ? (size_t)n : 4096;
}

/* Blocks of at least this many bytes are whole, aligned huge pages: a
 * unit's buffer then costs a few hundred faults to make resident, not tens
 * of thousands (where transparent huge pages are enabled at all). */
#define FS_POOL_HUGE_BYTES ((size_t)2 << 20)

/* A mapping of `bytes` (a huge-page multiple) aligned to a huge page, with
 * huge pages advised (without the advice, plain pages), not resident yet;
 * MAP_FAILED. */
static char *map_aligned_huge(size_t bytes)
{
    const size_t span = bytes + FS_POOL_HUGE_BYTES; /* room to align */
    char *m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return MAP_FAILED;
    const uintptr_t mask = FS_POOL_HUGE_BYTES - 1;
    char *a = (char *)(((uintptr_t)m + mask) & ~mask);
    if (a > m)
        munmap(m, (size_t)(a - m));
    if (m + span > a + bytes)
        munmap(a + bytes, (size_t)(m + span - (a + bytes)));
#ifdef MADV_HUGEPAGE
    madvise(a, bytes, MADV_HUGEPAGE);
#endif
    return a;
}

/* A resident mapping of `bytes` (a page multiple; a huge-page multiple from
 * FS_POOL_HUGE_BYTES on), or MAP_FAILED. */
static void *map_block(size_t bytes)
{
    if (bytes < FS_POOL_HUGE_BYTES) /* faulted in by the kernel in one call */
        return mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    char *a = map_aligned_huge(bytes);
    if (a == MAP_FAILED)
        return MAP_FAILED;
#ifdef MADV_POPULATE_WRITE
    madvise(a, bytes, MADV_POPULATE_WRITE); /* else faulted in by first use */
#endif
    return a;
}

/* The size a request is mapped at: whole pages, whole huge pages from
 * FS_POOL_HUGE_BYTES on; 0 when it cannot be represented. */
static size_t mapped_bytes(size_t nbytes)
{
    const size_t pg = page_bytes();
    if (nbytes == 0)
        nbytes = 1;
    if (nbytes > SIZE_MAX - 2 * FS_POOL_HUGE_BYTES)
        return 0;
    size_t bytes = (nbytes + pg - 1) / pg * pg;
    if (bytes >= FS_POOL_HUGE_BYTES)
        bytes = (bytes + FS_POOL_HUGE_BYTES - 1) / FS_POOL_HUGE_BYTES * FS_POOL_HUGE_BYTES;
    return bytes;
}

/* [Note: state populated in parallel]
 * Optimizer state is made at a step (torch's own is zeros_like then, whose
 * fill runs on torch's threads), so its first touch is on the step's path.
 * Populating a whole huge-page mapping in one call stalled that step for
 * 44-1441 ms per 64 MiB (EPYC Zen 5, 2026-12-04; 142 ms on a Zen 3 VM whose
 * guest memory was not yet backed) where it took 6 ms another time: a huge
 * page may need compaction, or memory the hypervisor has not backed yet,
 * and under THP defrag=madvise the fault waits for either. So the mapping is
 * populated by `threads` threads, each its own slice, 2 MiB at a time; a
 * huge page that takes longer than FS_STATE_HUGE_STALL_NS to fault in
 * (about 8x a clear of 2 MiB at 10 GB/s) makes that thread ask plain pages
 * for the rest of its slice, which the kernel recycles without compaction.
 * A stall costs a thread one chunk, not the mapping. The state is resident
 * and zero on return either way, as the memory planner counts it. */
#define FS_STATE_HUGE_STALL_NS 2000000LL

typedef struct {
    char *lo, *hi; /* this thread's slice: huge-page aligned but for the end */
} populate_job;

/* This thread's CPU time: a compaction or a hypervisor's fault counts, a
 * turn given to another process (a loaded machine) does not. */
static long long thread_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void populate(char *a, size_t len)
{
#ifdef MADV_POPULATE_WRITE
    if (madvise(a, len, MADV_POPULATE_WRITE) == 0)
        return;
#endif
    memset(a, 0, len); /* older kernels: write faults (the pages are zero already) */
}

static void *populate_main(void *arg)
{
    const populate_job *j = arg;
    int huge = 1;
    for (char *c = j->lo; c < j->hi; c += FS_POOL_HUGE_BYTES) {
        const size_t len = (size_t)(j->hi - c) < FS_POOL_HUGE_BYTES ? (size_t)(j->hi - c)
                                                                   : FS_POOL_HUGE_BYTES;
        const long long t0 = huge ? thread_ns() : 0;
        populate(c, len);
        if (huge && thread_ns() - t0 > FS_STATE_HUGE_STALL_NS && c + len < j->hi) {
#ifdef MADV_NOHUGEPAGE
            madvise(c + len, (size_t)(j->hi - (c + len)), MADV_NOHUGEPAGE);
#endif
            huge = 0;
        }
    }
    return NULL;
}

fs_status fs_map_resident(size_t nbytes, int threads, void **out, size_t *mapped)
{
    const size_t bytes = mapped_bytes(nbytes);
    if (!bytes)
        return FS_ERR_NO_MEMORY;
    if (bytes < FS_POOL_HUGE_BYTES) {
        void *m = map_block(bytes); /* small: populated in one call, plain pages */
        if (m == MAP_FAILED)
            return FS_ERR_NO_MEMORY;
        *out = m;
        *mapped = bytes;
        return FS_OK;
    }
    char *a = map_aligned_huge(bytes);
    if (a == MAP_FAILED)
        return FS_ERR_NO_MEMORY;
    /* [Note: state populated in parallel] */
    const size_t chunks = bytes / FS_POOL_HUGE_BYTES;
    int nt = threads < 1 ? 1 : threads > FS_STATE_MAX_THREADS ? FS_STATE_MAX_THREADS : threads;
    if ((size_t)nt > chunks)
        nt = (int)chunks;
    populate_job jobs[FS_STATE_MAX_THREADS];
    pthread_t tids[FS_STATE_MAX_THREADS];
    int started = 0;
    for (int t = 0; t < nt; t++) {
        jobs[t].lo = a + chunks * (size_t)t / (size_t)nt * FS_POOL_HUGE_BYTES;
        jobs[t].hi = a + chunks * (size_t)(t + 1) / (size_t)nt * FS_POOL_HUGE_BYTES;
    }
    for (int t = 1; t < nt; t++) {
        if (pthread_create(&tids[t], NULL, populate_main, &jobs[t]) != 0)
            break;
        started = t;
    }
    populate_main(&jobs[0]);
    for (int t = started + 1; t < nt; t++) /* slices whose thread did not start */
        populate_main(&jobs[t]);
    for (int t = 1; t <= started; t++)
        pthread_join(tids[t], NULL);
    *out = a;
    *mapped = bytes;
    return FS_OK;
}

void fs_unmap(void *ptr, size_t mapped)
{
    munmap(ptr, mapped);
}

static fs_pool process_pool;
static pthread_once_t process_once = PTHREAD_ONCE_INIT;

static void process_init(void)
{
    fs_pool_init(&process_pool, FS_POOL_KEEP_BLOCKS);
}

fs_pool *fs_pool_process(void)
{
    pthread_once(&process_once, process_init);
    return &process_pool;
}

void fs_pool_init(fs_pool *p, int keep_blocks)
{
    memset(p, 0, sizeof *p);
    pthread_mutex_init(&p->lock, NULL);
    p->keep_blocks = keep_blocks < 0 ? 0 : keep_blocks;
}

void fs_pool_destroy(fs_pool *p)
{
    for (size_t i = 0; i < p->nblocks; i++)
        munmap(p->blocks[i].ptr, p->blocks[i].bytes);
    free(p->blocks);
    pthread_mutex_destroy(&p->lock);
    memset(p, 0, sizeof *p);
}

/* Caller holds the lock. */
static void unmap_at(fs_pool *p, size_t i)
{
    fs_pool_block b = p->blocks[i];
    munmap(b.ptr, b.bytes);
    p->stats.cached_bytes -= b.bytes;
    p->stats.unmaps++;
    p->blocks[i] = p->blocks[--p->nblocks];
}

/* Caller holds the lock: [Note: pool cache]. Unmaps the free block freed
 * longest ago among the small ones (small = 1) or the large ones, while
 * there are more of them cached than the rule allows. */
static void enforce_class(fs_pool *p, int small)
{
    for (;;) {
        size_t n = 0, bytes = 0, oldest = p->nblocks;
        for (size_t i = 0; i < p->nblocks; i++) {
            const fs_pool_block *b = &p->blocks[i];
            if (b->in_use || (b->bytes <= FS_POOL_SMALL_BYTES) != small)
                continue;
            n++;
            bytes += b->bytes;
            if (oldest == p->nblocks || b->freed_at < p->blocks[oldest].freed_at)
                oldest = i;
        }
        const int over = small ? p->keep_blocks == 0 ? n > 0 : bytes > FS_POOL_SMALL_BUDGET
                               : n > (size_t)p->keep_blocks;
        if (!over)
            return;
        unmap_at(p, oldest);
    }
}

static void enforce_keep(fs_pool *p)
{
    enforce_class(p, 1);
    enforce_class(p, 0);
}

fs_status fs_pool_take(fs_pool *p, size_t nbytes, int cacheable, void **out)
{
    const size_t bytes = mapped_bytes(nbytes);
    if (!bytes)
        return FS_ERR_NO_MEMORY;
    fs_status s = FS_OK;
    pthread_mutex_lock(&p->lock);
    size_t hit = p->nblocks;
    for (size_t i = 0; i < p->nblocks; i++) /* the most recently freed: warmest in cache */
        if (!p->blocks[i].in_use && p->blocks[i].bytes == bytes &&
            (hit == p->nblocks || p->blocks[i].freed_at > p->blocks[hit].freed_at))
            hit = i;
    if (hit < p->nblocks) {
        p->blocks[hit].in_use = 1;
        p->blocks[hit].cacheable = cacheable;
        p->stats.cached_bytes -= bytes;
        p->stats.reuses++;
    } else {
        if (p->nblocks == p->cap) {
            size_t cap = p->cap ? 2 * p->cap : 16;
            fs_pool_block *nb = realloc(p->blocks, cap * sizeof *nb);
            if (!nb) {
                s = FS_ERR_NO_MEMORY;
                goto done;
            }
            p->blocks = nb;
            p->cap = cap;
        }
        /* Faulted in here, rather than a page at a time by the all-gather
         * that writes it. */
        void *m = map_block(bytes);
        if (m == MAP_FAILED) {
            s = FS_ERR_NO_MEMORY;
            goto done;
        }
        hit = p->nblocks++;
        p->blocks[hit] = (fs_pool_block){m, bytes, 0, 1, cacheable};
        p->stats.maps++;
    }
    p->stats.live_bytes += bytes;
    if (p->stats.live_bytes > p->stats.peak_live_bytes)
        p->stats.peak_live_bytes = p->stats.live_bytes;
    *out = p->blocks[hit].ptr;
done:
    pthread_mutex_unlock(&p->lock);
    return s;
}

fs_status fs_pool_give(fs_pool *p, void *ptr)
{
    fs_status s = FS_ERR_INVALID_ARG;
    pthread_mutex_lock(&p->lock);
    for (size_t i = 0; i < p->nblocks; i++) {
        fs_pool_block *b = &p->blocks[i];
        if (b->ptr != ptr || !b->in_use)
            continue;
        b->in_use = 0;
        b->freed_at = ++p->gives;
        p->stats.live_bytes -= b->bytes;
        p->stats.cached_bytes += b->bytes;
        if (b->cacheable)
            enforce_keep(p);
        else
            unmap_at(p, i);
        s = FS_OK;
        break;
    }
    pthread_mutex_unlock(&p->lock);
    return s;
}

static size_t trim_locked(fs_pool *p)
{
    size_t released = 0;
    for (size_t i = p->nblocks; i-- > 0;)
        if (!p->blocks[i].in_use) {
            released += p->blocks[i].bytes;
            unmap_at(p, i);
        }
    return released;
}

size_t fs_pool_trim(fs_pool *p)
{
    pthread_mutex_lock(&p->lock);
    size_t r = trim_locked(p);
    pthread_mutex_unlock(&p->lock);
    return r;
}

size_t fs_pool_trim_idle(fs_pool *p)
{
    pthread_mutex_lock(&p->lock);
    int gathering = 0;
    for (size_t i = 0; i < p->nblocks; i++)
        gathering |= p->blocks[i].in_use && p->blocks[i].cacheable;
    size_t r = gathering ? 0 : trim_locked(p);
    pthread_mutex_unlock(&p->lock);
    return r;
}

fs_pool_stats fs_pool_get_stats(fs_pool *p)
{
    pthread_mutex_lock(&p->lock);
    fs_pool_stats s = p->stats;
    pthread_mutex_unlock(&p->lock);
    return s;
}

void fs_pool_reset_peak(fs_pool *p)
{
    pthread_mutex_lock(&p->lock);
    p->stats.peak_live_bytes = p->stats.live_bytes;
    pthread_mutex_unlock(&p->lock);
}

void fs_pool_set_keep(fs_pool *p, int keep_blocks)
{
    pthread_mutex_lock(&p->lock);
    p->keep_blocks = keep_blocks < 0 ? 0 : keep_blocks;
    enforce_keep(p);
    pthread_mutex_unlock(&p->lock);
}
