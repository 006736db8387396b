/* optim_disk.c - see optim_disk.h. A three-stage pipeline (read, update,
 * write) over a ring of chunk buffers, one mutex and one condition variable:
 * the stages are I/O- and memory-bound, so the simplest correct hand-off is
 * enough; what matters is that the disk never waits for the update. */
#define _GNU_SOURCE
#include "optim_disk.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------
 * work items: one per chunk, in file order */

typedef struct {
    int seg;
    int64_t elem;   /* first element within the segment */
    int64_t count;  /* elements in this chunk */
    int64_t offset; /* bytes into the files */
} chunk_item;

typedef struct {
    fs_disk_stream *s;
    const fs_disk_segment *segs;
    const chunk_item *items;
    int64_t nitems;
    float *bufs;         /* nslots * 2 * chunk_numel */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int64_t n_read, n_done, n_written; /* items past each stage */
    int stop;
} pipeline;

int64_t fs_disk_segment_bytes(int64_t n) { return n * 2 * (int64_t)sizeof(float); }

static float *slot(pipeline *p, int64_t k)
{
    return p->bufs + (k % p->s->nslots) * 2 * p->s->chunk_numel;
}

static void fail(pipeline *p, int err, int is_write)
{
    pthread_mutex_lock(&p->mu);
    if (!p->s->err) {
        p->s->err = err ? err : EIO;
        p->s->err_write = is_write;
    }
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Advance a stage counter and wake the others. */
static void advance(pipeline *p, int64_t *counter, int64_t value)
{
    pthread_mutex_lock(&p->mu);
    *counter = value;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Wait until `ready(k)` or stop; returns 0 to go on, -1 to stop. */
#define WAIT_UNTIL(p, cond)                                  \
    do {                                                     \
        pthread_mutex_lock(&(p)->mu);                        \
        while (!(cond) && !(p)->stop)                        \
            pthread_cond_wait(&(p)->cv, &(p)->mu);           \
        int stop_ = (p)->stop;                               \
        pthread_mutex_unlock(&(p)->mu);                      \
        if (stop_)                                           \
            goto out;                                        \
    } while (0)

static int read_full(int fd, void *buf, size_t len, off_t off)
{
    char *b = buf;
    while (len) {
        ssize_t r = pread(fd, b, len, off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? errno : EIO; /* EOF: the file is shorter than its layout */
        b += r;
        len -= (size_t)r;
        off += r;
    }
    return 0;
}

static int write_full(int fd, const void *buf, size_t len, off_t off)
{
    const char *b = buf;
    while (len) {
        ssize_t r = pwrite(fd, b, len, off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? errno : EIO;
        b += r;
        len -= (size_t)r;
        off += r;
    }
    return 0;
}

/* ---------------------------------------------------------------------------
 * the three stages */

static void *reader(void *arg)
{
    pipeline *p = arg;
    for (int64_t k = 0; k < p->nitems; k++) {
        /* slot k is free once item k - nslots has been written */
        WAIT_UNTIL(p, k - p->n_written < p->s->nslots);
        const chunk_item *it = &p->items[k];
        size_t bytes = (size_t)it->count * 2 * sizeof(float);
        if (p->s->fd_in < 0) {
            memset(slot(p, k), 0, bytes); /* first step: zero moments */
        } else {
            int e = read_full(p->s->fd_in, slot(p, k), bytes, (off_t)it->offset);
            if (e) {
                fail(p, e, 0);
                goto out;
            }
            p->s->bytes_read += (int64_t)bytes; /* only this thread writes it */
        }
        advance(p, &p->n_read, k + 1);
    }
out:
    return NULL;
}

static void *writer(void *arg)
{
    pipeline *p = arg;
    for (int64_t k = 0; k < p->nitems; k++) {
        WAIT_UNTIL(p, k < p->n_done);
        const chunk_item *it = &p->items[k];
        size_t bytes = (size_t)it->count * 2 * sizeof(float);
        int e = write_full(p->s->fd_out, slot(p, k), bytes, (off_t)it->offset);
        if (e) {
            fail(p, e, 1);
            goto out;
        }
        p->s->bytes_written += (int64_t)bytes;
        advance(p, &p->n_written, k + 1);
    }
out:
    return NULL;
}

static fs_status update(pipeline *p, const fs_adam_hparams *h, fs_simd simd)
{
    for (int64_t k = 0; k < p->nitems; k++) {
        WAIT_UNTIL(p, k < p->n_read);
        const chunk_item *it = &p->items[k];
        const fs_disk_segment *sg = &p->segs[it->seg];
        if (sg->grad) {
            float *m = slot(p, k);
            fs_adam_buffers b = {sg->param + it->elem, sg->grad + it->elem, m, m + it->count,
                                 NULL, NULL, FS_BF16, it->count};
            fs_adam_hparams hs = *h;
            hs.step = sg->step;
            fs_status st = fs_adam_step(&b, &hs, simd, p->s->threads);
            if (st != FS_OK) {
                fail(p, EINVAL, 0);
                return st;
            }
        }
        advance(p, &p->n_done, k + 1);
    }
out:
    return FS_OK;
}

/* ---------------------------------------------------------------------------
 * entry point */

fs_status fs_disk_adam_step(fs_disk_stream *s, const fs_disk_segment *segs, int nsegs,
                            const fs_adam_hparams *h, fs_simd simd)
{
    if (!s || s->chunk_numel <= 0 || s->nslots < 2 || s->fd_out < 0 || nsegs < 0 ||
        (nsegs && !segs))
        return FS_ERR_INVALID_ARG;
    s->bytes_read = s->bytes_written = 0;
    s->err = s->err_write = 0;
    int64_t nitems = 0;
    for (int i = 0; i < nsegs; i++) {
        if (segs[i].n < 0 || segs[i].file_offset < 0 || (segs[i].grad && segs[i].step < 1))
            return FS_ERR_INVALID_ARG;
        nitems += (segs[i].n + s->chunk_numel - 1) / s->chunk_numel;
    }
    if (nitems == 0)
        return FS_OK;

    fs_status status = FS_OK;
    pipeline p = {.s = s, .segs = segs, .nitems = nitems};
    chunk_item *items = malloc((size_t)nitems * sizeof(chunk_item));
    float *bufs = NULL;
    if (!items || posix_memalign((void **)&bufs, 64,
                                 (size_t)s->nslots * 2 * (size_t)s->chunk_numel * sizeof(float))) {
        bufs = NULL;
        status = FS_ERR_NO_MEMORY;
        goto done;
    }
    int64_t k = 0;
    for (int i = 0; i < nsegs; i++)
        for (int64_t e = 0; e < segs[i].n; e += s->chunk_numel) {
            int64_t c = segs[i].n - e < s->chunk_numel ? segs[i].n - e : s->chunk_numel;
            int64_t off = segs[i].file_offset + e * 2 * (int64_t)sizeof(float);
            items[k++] = (chunk_item){i, e, c, off};
        }
    p.items = items;
    p.bufs = bufs;
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    pthread_t rt, wt;
    int have_r = pthread_create(&rt, NULL, reader, &p) == 0;
    int have_w = have_r && pthread_create(&wt, NULL, writer, &p) == 0;
    if (have_w) {
        status = update(&p, h, simd);
    } else {
        fail(&p, EAGAIN, 0);
        status = FS_ERR_NO_MEMORY;
    }
    if (have_r)
        pthread_join(rt, NULL);
    if (have_w)
        pthread_join(wt, NULL);
    pthread_cond_destroy(&p.cv);
    pthread_mutex_destroy(&p.mu);
    if (status == FS_OK && s->err)
        status = FS_ERR_BACKEND;
done:
    free(bufs);
    free(items);
    return status;
}
