/* snapshot.c - see snapshot.h: the segment's layout, its two slots, the copy
 * thread and the checks on read. */
#define _GNU_SOURCE /* shm_open, ftruncate, mremap-free remap */
#include "snapshot.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checksum.h"
#include "reduce.h"
#include "stream_copy.h"

#define SNAP_MAGIC 0x50414e5348534621ULL /* "!FSHSNAP" */
#define SNAP_VERSION 1u
#define HEADER_BYTES 4096u
#define PART_ALIGN 64u
#define CHUNK_BYTES ((int64_t)1 << 18) /* CRC of a chunk while it is cached */

/* A slot's header. Its region: the part table (nparts entries), then each
 * part at a 64-byte boundary. */
typedef struct {
    uint64_t offset;   /* of the region, from the segment's start */
    uint64_t capacity; /* bytes of the region */
    int64_t step;
    uint64_t nparts;
    uint32_t table_crc;
    uint32_t complete; /* [Note: the complete mark] */
} slot_hdr;

typedef struct {
    uint64_t bytes;
    uint64_t offset; /* from the region's start */
    uint32_t crc;
    uint32_t pad;
} part_entry;

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t header_bytes;
    slot_hdr slot[2];
} seg_header;

struct fs_snapshot {
    int fd;
    char *base; /* the mapping, map_bytes long */
    size_t map_bytes;
    fs_simd simd;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    pthread_t thread;
    int stop, busy;
    /* the copy in flight */
    int slot;
    int64_t n, stop_after;
    fs_snap_part *parts;
    int64_t parts_cap;
};

static seg_header *hdr(const fs_snapshot *s) { return (seg_header *)s->base; }

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static fs_status fail_errno(char *err, size_t cap, const char *what, const char *name)
{
    snprintf(err, cap, "%s %s: %s", what, name, strerror(errno));
    return FS_ERR_BACKEND;
}

/* ---------------------------------------------------------------------------
 * the copy thread */

static void copy_parts(fs_snapshot *s)
{
    slot_hdr *sh = &hdr(s)->slot[s->slot];
    char *region = s->base + sh->offset;
    part_entry *table = (part_entry *)region;
    int64_t left = s->stop_after;
    for (int64_t i = 0; i < s->n; i++) {
        const char *src = s->parts[i].ptr;
        char *dst = region + table[i].offset;
        uint32_t crc = 0;
        for (int64_t at = 0; at < s->parts[i].bytes; at += CHUNK_BYTES) {
            int64_t len = s->parts[i].bytes - at < CHUNK_BYTES ? s->parts[i].bytes - at
                                                               : CHUNK_BYTES;
            if (left >= 0 && len > left)
                len = left;
            crc = fs_crc32c(crc, src + at, (size_t)len);
            fs_copy_stream(dst + at, src + at, (size_t)len, s->simd);
            if (left >= 0 && (left -= len) == 0)
                return; /* stopped as a crash here would: the slot stays incomplete */
        }
        table[i].crc = crc;
    }
    sh->table_crc = fs_crc32c(0, table, (size_t)s->n * sizeof *table);
    __atomic_store_n(&sh->complete, 1u, __ATOMIC_RELEASE);
}

static void *worker(void *arg)
{
    fs_snapshot *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->busy && !s->stop)
            pthread_cond_wait(&s->work, &s->mu);
        if (!s->busy)
            break;
        pthread_mutex_unlock(&s->mu);
        copy_parts(s);
        pthread_mutex_lock(&s->mu);
        s->busy = 0;
        pthread_cond_broadcast(&s->done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---------------------------------------------------------------------------
 * open, close */

static fs_status map(fs_snapshot *s, size_t bytes, const char *name, char *err, size_t cap)
{
    void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (base == MAP_FAILED)
        return fail_errno(err, cap, "mmap", name);
    if (s->base)
        munmap(s->base, s->map_bytes);
    s->base = base;
    s->map_bytes = bytes;
    return FS_OK;
}

fs_status fs_snapshot_open(const char *name, int create, fs_snapshot **out, char *err,
                           size_t err_cap)
{
    *out = NULL;
    fs_snapshot *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, err_cap, "out of memory");
        return FS_ERR_NO_MEMORY;
    }
    s->fd = shm_open(name, O_RDWR | (create ? O_CREAT : 0), 0600);
    fs_status st = FS_OK;
    struct stat sb;
    if (s->fd < 0) {
        st = fail_errno(err, err_cap, "shm_open", name);
        goto fail;
    }
    if (fstat(s->fd, &sb) != 0) {
        st = fail_errno(err, err_cap, "fstat", name);
        goto fail;
    }
    if (sb.st_size == 0) { /* new: the header alone, both slots empty */
        if (ftruncate(s->fd, HEADER_BYTES) != 0) {
            st = fail_errno(err, err_cap, "ftruncate", name);
            goto fail;
        }
        sb.st_size = HEADER_BYTES;
        if ((st = map(s, HEADER_BYTES, name, err, err_cap)) != FS_OK)
            goto fail;
        seg_header *h = hdr(s);
        h->version = SNAP_VERSION;
        h->header_bytes = HEADER_BYTES;
        h->slot[0].step = h->slot[1].step = -1;
        __atomic_store_n(&h->magic, SNAP_MAGIC, __ATOMIC_RELEASE);
    } else if ((st = map(s, (size_t)sb.st_size, name, err, err_cap)) != FS_OK) {
        goto fail;
    }
    seg_header *h = hdr(s);
    if ((size_t)sb.st_size < sizeof *h || h->magic != SNAP_MAGIC || h->version != SNAP_VERSION) {
        snprintf(err, err_cap, "shm segment %s is not a flatshard snapshot store (version %u)",
                 name, SNAP_VERSION);
        st = FS_ERR_INVALID_ARG;
        goto fail;
    }
    for (int i = 0; i < 2; i++) {
        const slot_hdr *sh = &h->slot[i];
        if (sh->offset + sh->capacity > (uint64_t)sb.st_size) {
            snprintf(err, err_cap, "shm segment %s: slot %d lies past its end (%llu bytes): "
                     "the segment was cut short", name, i, (unsigned long long)sb.st_size);
            st = FS_ERR_INVALID_ARG;
            goto fail;
        }
    }
    s->simd = fs_simd_best();
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->done, NULL);
    if (pthread_create(&s->thread, NULL, worker, s) != 0) {
        snprintf(err, err_cap, "could not start the snapshot's copy thread");
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->work);
        pthread_cond_destroy(&s->done);
        st = FS_ERR_BACKEND;
        goto fail;
    }
    *out = s;
    return FS_OK;
fail:
    if (s->base)
        munmap(s->base, s->map_bytes);
    if (s->fd >= 0)
        close(s->fd);
    free(s);
    return st;
}

void fs_snapshot_close(fs_snapshot *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->work);
    pthread_cond_destroy(&s->done);
    munmap(s->base, s->map_bytes);
    close(s->fd);
    free(s->parts);
    free(s);
}

fs_status fs_snapshot_unlink(const char *name, char *err, size_t err_cap)
{
    return shm_unlink(name) == 0 ? FS_OK : fail_errno(err, err_cap, "shm_unlink", name);
}

/* ---------------------------------------------------------------------------
 * write */

void fs_snapshot_wait(fs_snapshot *s, void *(*unlock)(void), void (*lock)(void *))
{
    if (!fs_snapshot_busy(s))
        return;
    void *saved = unlock ? unlock() : NULL;
    pthread_mutex_lock(&s->mu);
    while (s->busy)
        pthread_cond_wait(&s->done, &s->mu);
    pthread_mutex_unlock(&s->mu);
    if (lock)
        lock(saved);
}

int fs_snapshot_busy(fs_snapshot *s)
{
    pthread_mutex_lock(&s->mu);
    int b = s->busy;
    pthread_mutex_unlock(&s->mu);
    return b;
}

/* The region for `need` bytes in slot i: where it is when it fits, else
 * at the header's end when that leaves the other slot whole, else right
 * after the other slot. The segment grows to hold it. */
static fs_status place(fs_snapshot *s, int i, uint64_t need, int64_t budget, char *err,
                       size_t cap)
{
    seg_header *h = hdr(s);
    if (h->slot[i].capacity >= need)
        return FS_OK;
    const slot_hdr *o = &h->slot[1 - i];
    uint64_t at = HEADER_BYTES;
    if (o->capacity && o->offset < at + need)
        at = o->offset + o->capacity;
    uint64_t end = at + need;
    uint64_t other_end = o->capacity ? o->offset + o->capacity : HEADER_BYTES;
    uint64_t total = end > other_end ? end : other_end;
    if (total < s->map_bytes)
        total = s->map_bytes;
    /* the other slot takes as much at its next write */
    uint64_t projected = total + (o->capacity < need ? need : 0);
    if (budget > 0 && projected > (uint64_t)budget) {
        snprintf(err, cap, "the snapshot segment would hold %llu bytes (two slots of this "
                 "step's %llu bytes), over the budget of %lld bytes",
                 (unsigned long long)projected, (unsigned long long)need, (long long)budget);
        return FS_ERR_INVALID_ARG;
    }
    if (total > s->map_bytes) {
        if (ftruncate(s->fd, (off_t)total) != 0)
            return fail_errno(err, cap, "ftruncate", "(snapshot segment)");
        FS_CHECK(map(s, total, "(snapshot segment)", err, cap));
        h = hdr(s);
    }
    h->slot[i].offset = at;
    h->slot[i].capacity = need;
    return FS_OK;
}

fs_status fs_snapshot_write(fs_snapshot *s, int64_t step, const fs_snap_part *parts, int64_t n,
                            int64_t budget_bytes, int64_t stop_after_bytes,
                            void *(*unlock)(void), void (*lock)(void *), char *err,
                            size_t err_cap)
{
    if (n < 0 || step < 0 || (n && !parts)) {
        snprintf(err, err_cap, "step %lld with %lld parts: both must be >= 0", (long long)step,
                 (long long)n);
        return FS_ERR_INVALID_ARG;
    }
    uint64_t need = align_up((uint64_t)n * sizeof(part_entry), PART_ALIGN);
    for (int64_t k = 0; k < n; k++) {
        if (parts[k].bytes < 0 || (parts[k].bytes && !parts[k].ptr)) {
            snprintf(err, err_cap, "part %lld: %lld bytes at %p", (long long)k,
                     (long long)parts[k].bytes, parts[k].ptr);
            return FS_ERR_INVALID_ARG;
        }
        need += align_up((uint64_t)parts[k].bytes, PART_ALIGN);
    }
    fs_snapshot_wait(s, unlock, lock);
    seg_header *h = hdr(s);
    /* the slot that does not hold the newest complete step */
    int i = !h->slot[0].complete ? 0 : !h->slot[1].complete ? 1
            : (h->slot[0].step <= h->slot[1].step ? 0 : 1);
    __atomic_store_n(&h->slot[i].complete, 0u, __ATOMIC_SEQ_CST);
    FS_CHECK(place(s, i, align_up(need, 4096), budget_bytes, err, err_cap));
    h = hdr(s);
    if (n > s->parts_cap) {
        fs_snap_part *p = realloc(s->parts, (size_t)n * sizeof *p);
        if (!p) {
            snprintf(err, err_cap, "out of memory");
            return FS_ERR_NO_MEMORY;
        }
        s->parts = p;
        s->parts_cap = n;
    }
    if (n)
        memcpy(s->parts, parts, (size_t)n * sizeof *parts);
    slot_hdr *sh = &h->slot[i];
    part_entry *table = (part_entry *)(s->base + sh->offset);
    uint64_t at = align_up((uint64_t)n * sizeof(part_entry), PART_ALIGN);
    for (int64_t k = 0; k < n; k++) {
        table[k] = (part_entry){.bytes = (uint64_t)parts[k].bytes, .offset = at};
        at += align_up((uint64_t)parts[k].bytes, PART_ALIGN);
    }
    sh->step = step;
    sh->nparts = (uint64_t)n;
    pthread_mutex_lock(&s->mu);
    s->slot = i;
    s->n = n;
    s->stop_after = stop_after_bytes;
    s->busy = 1;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    return FS_OK;
}

void fs_snapshot_drop(fs_snapshot *s, int slot, void *(*unlock)(void), void (*lock)(void *))
{
    fs_snapshot_wait(s, unlock, lock);
    __atomic_store_n(&hdr(s)->slot[slot].complete, 0u, __ATOMIC_SEQ_CST);
}

/* ---------------------------------------------------------------------------
 * read */

void fs_snapshot_slot_info(const fs_snapshot *s, int slot, fs_snap_slot_info *out)
{
    const slot_hdr *sh = &hdr(s)->slot[slot];
    out->complete = (int)__atomic_load_n(&sh->complete, __ATOMIC_ACQUIRE);
    out->step = sh->step;
    out->nparts = (int64_t)sh->nparts;
    out->capacity_bytes = (int64_t)sh->capacity;
}

int64_t fs_snapshot_segment_bytes(const fs_snapshot *s) { return (int64_t)s->map_bytes; }

/* The slot's table when the slot is complete and the table lies inside its
 * region with a CRC that holds; NULL otherwise. */
static const part_entry *checked_table(const fs_snapshot *s, int slot)
{
    const slot_hdr *sh = &hdr(s)->slot[slot];
    if (!__atomic_load_n(&sh->complete, __ATOMIC_ACQUIRE) ||
        sh->nparts * sizeof(part_entry) > sh->capacity)
        return NULL;
    const part_entry *t = (const part_entry *)(s->base + sh->offset);
    if (fs_crc32c(0, t, (size_t)sh->nparts * sizeof *t) != sh->table_crc)
        return NULL;
    for (uint64_t k = 0; k < sh->nparts; k++)
        if (t[k].offset + t[k].bytes > sh->capacity)
            return NULL;
    return t;
}

void fs_snapshot_verify(const fs_snapshot *s, int slot, int64_t *bad)
{
    const part_entry *t = checked_table(s, slot);
    *bad = -2;
    if (!t)
        return;
    const char *region = s->base + hdr(s)->slot[slot].offset;
    for (uint64_t k = 0; k < hdr(s)->slot[slot].nparts; k++)
        if (fs_crc32c(0, region + t[k].offset, t[k].bytes) != t[k].crc) {
            *bad = (int64_t)k;
            return;
        }
    *bad = -1;
}

int64_t fs_snapshot_part_bytes(const fs_snapshot *s, int slot, int64_t part)
{
    const part_entry *t = checked_table(s, slot);
    if (!t || part < 0 || (uint64_t)part >= hdr(s)->slot[slot].nparts)
        return -1;
    return (int64_t)t[part].bytes;
}

fs_status fs_snapshot_read(const fs_snapshot *s, int slot, int64_t part, void *dst,
                           int64_t bytes)
{
    if (fs_snapshot_part_bytes(s, slot, part) != bytes || (bytes && !dst))
        return FS_ERR_INVALID_ARG;
    const part_entry *t = (const part_entry *)(s->base + hdr(s)->slot[slot].offset);
    memcpy(dst, s->base + hdr(s)->slot[slot].offset + t[part].offset, (size_t)bytes);
    return FS_OK;
}
