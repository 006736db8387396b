/* link.c - what every engine object does on a link (engine.h): casts and
 * accumulations on the host or the device, the divide after a reduction,
 * float32 workspace for low-precision reductions on a device, the handles a
 * deferred collective holds, coalesced host all-gathers and reduction
 * buckets. */
#include "engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "copy.h"
#include "reduce_rule.h"

/* ---------------------------------------------------------------------------
 * held handles */

int fs_held_add(fs_held *l, void *h)
{
    if (!h)
        return 0;
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 8;
        void **p = realloc(l->h, (size_t)cap * sizeof *p);
        if (!p)
            return -1;
        l->h = p;
        l->cap = cap;
    }
    l->h[l->n++] = h;
    return 0;
}

void fs_held_release(fs_held *l, const fs_env *env)
{
    /* A release may run host code that frees what the list holds: empty the
     * list first. */
    int n = l->n;
    l->n = 0;
    for (int i = 0; i < n; i++)
        env->release(env->ctx, l->h[i]);
}

void fs_held_free(fs_held *l, const fs_env *env)
{
    fs_held_release(l, env);
    free(l->h);
    l->h = NULL;
    l->cap = 0;
}

/* ---------------------------------------------------------------------------
 * kernels and workspace */

void *fs_link_unlock_for(const fs_link *l, int64_t n)
{
    return l->unlock && n >= FS_UNLOCK_NUMEL ? l->unlock() : NULL;
}

void fs_link_relock(const fs_link *l, int64_t n, void *tok)
{
    if (l->unlock && n >= FS_UNLOCK_NUMEL)
        l->lock(tok);
}

fs_status fs_link_cast(const fs_link *l, void *stream, void *dst, fs_dtype dt, const void *src,
                       fs_dtype st, int64_t n)
{
    if (l->dev)
        return l->dev->cast(dst, dt, src, st, n, stream, l->comm->last_error,
                            sizeof l->comm->last_error);
    void *tok = fs_link_unlock_for(l, n);
    fs_status s = fs_cast(dst, dt, src, st, n);
    fs_link_relock(l, n, tok);
    return s;
}

fs_status fs_link_cast2d(const fs_link *l, void *stream, void *dst, int64_t dst_pitch,
                         fs_dtype dt, const void *src, int64_t src_pitch, fs_dtype st,
                         int64_t width, int64_t height)
{
    if (height == 1)
        return fs_link_cast(l, stream, dst, dt, src, st, width);
    if (l->dev)
        return l->dev->cast2d(dst, dst_pitch, dt, src, src_pitch, st, width, height, stream,
                              l->comm->last_error, sizeof l->comm->last_error);
    const size_t ds = fs_dtype_size(dt), ss = fs_dtype_size(st);
    void *tok = fs_link_unlock_for(l, width * height);
    fs_status s = FS_OK;
    for (int64_t j = 0; j < height && s == FS_OK; j++)
        s = fs_cast((char *)dst + (size_t)(j * dst_pitch) * ds, dt,
                    (const char *)src + (size_t)(j * src_pitch) * ss, st, width);
    fs_link_relock(l, width * height, tok);
    return s;
}

fs_status fs_link_scale_accumulate(const fs_link *l, void *stream, void *dst, fs_dtype dt,
                                   const void *src, fs_dtype st, int64_t n, double scale,
                                   int accumulate)
{
    if (l->dev)
        return l->dev->scale_accumulate(dst, dt, src, st, n, scale, accumulate, stream,
                                        l->comm->last_error, sizeof l->comm->last_error);
    void *tok = fs_link_unlock_for(l, n);
    fs_status s = fs_scale_accumulate(dst, dt, src, st, n, scale, accumulate);
    fs_link_relock(l, n, tok);
    return s;
}

fs_status fs_link_divide_out(const fs_link *l, void *stream, void *dst, fs_dtype dt, void *src,
                             fs_dtype st, int64_t n, double scale, double post, int accumulate)
{
    if (post != 1.0) {
        if (fs_divide_fuses(dt, st, accumulate)) {
            scale /= post;
        } else {
            fs_status s = fs_link_scale_accumulate(l, stream, src, st, src, st, n, 1.0 / post, 0);
            if (s != FS_OK)
                return s;
        }
    }
    if (src == dst && scale == 1.0)
        return FS_OK;
    return fs_link_scale_accumulate(l, stream, dst, dt, src, st, n, scale,
                                    src == dst ? 0 : accumulate);
}

fs_status fs_link_lend(const fs_env *env, const fs_link *l, fs_dtype t, int64_t count,
                       void **h)
{
    *h = NULL;
    if (!l->dev || (t != FS_BF16 && t != FS_F16))
        return FS_OK;
    void *p;
    fs_status s = env->take(env->ctx, (count ? count : 1) * 4, 0, &p, h);
    if (s == FS_OK)
        l->dev->set_workspace(l->comm, p, (size_t)count * 4);
    return s;
}

void fs_link_unlend(const fs_link *l)
{
    l->dev->set_workspace(l->comm, NULL, 0);
}

static fs_status collective_run(fs_comm *c, fs_ledger_op op, void *send, void *recv,
                                int64_t count, fs_dtype t, int average, int root)
{
    const fs_redop red = average ? FS_RED_AVG : FS_RED_SUM;
    switch (op) {
    case FS_LOP_ALL_GATHER:
        return fs_comm_all_gather(c, send, recv, count, t);
    case FS_LOP_REDUCE_SCATTER:
        return fs_comm_reduce_scatter(c, send, recv, count, t, red);
    case FS_LOP_ALL_REDUCE:
        return fs_comm_all_reduce(c, send, count, t, red);
    case FS_LOP_BROADCAST:
        return fs_comm_broadcast(c, send, count, t, root);
    case FS_LOP_ALL_TO_ALL:
        return fs_comm_all_to_all(c, send, recv, count, t);
    default:
        return fs_comm_barrier(c);
    }
}

fs_status fs_link_collective(fs_link *l, const fs_env *env, fs_ledger_op op, const char *tag,
                             void *send, void *recv, int64_t count, fs_dtype t, int average,
                             int root)
{
    /* what a bfloat16/float16 reduction stages through on a device */
    const int64_t staged = op == FS_LOP_REDUCE_SCATTER ? count * l->comm->world_size : count;
    void *ws = NULL;
    fs_status s;
    if ((op == FS_LOP_REDUCE_SCATTER || op == FS_LOP_ALL_REDUCE) &&
        (s = fs_link_lend(env, l, t, staged, &ws)) != FS_OK)
        return s;
    FS_LINK_RUN(l, s, op, tag, count, t, collective_run(l->comm, op, send, recv, count, t,
                                                        average, root));
    if (ws) {
        fs_link_unlend(l);
        env->release(env->ctx, ws);
    }
    return s;
}

/* ---------------------------------------------------------------------------
 * coalesced gathers ([Note: coalesced gathers] in engine.h) */

/* The ledger's name of n coalesced parts: the first one's, cut to leave
 * room for " +<the others>". */
static void coalesced_name(char what[FS_LEDGER_UNIT], const char *first, int n)
{
    snprintf(what, FS_LEDGER_UNIT, "%.*s +%d", FS_LEDGER_UNIT - 8, first ? first : "", n - 1);
}

/* A part recorded at the end of a batch's or a bucket's list: the first
 * one names the whole in the ledger and gives its dtype; a batch of several
 * dtypes moves bytes (a bucket refuses another dtype before). */
static void record(fs_coalesced_part *part, int *nparts, fs_dtype *dtype, const char **first,
                   const char *what, fs_dtype t, fs_coalesced_part p)
{
    if (!*nparts) {
        *dtype = t;
        *first = what;
    } else if (*dtype != t) {
        *dtype = FS_U8;
    }
    part[(*nparts)++] = p;
}

/* The one buffer n coalesced parts are packed into for their collective
 * (`kind` names it in the words of a failure). */
static fs_status take_staging(const fs_env *env, fs_comm *c, int64_t nbytes, const char *kind,
                              void **buf, void **h)
{
    fs_status s = env->take(env->ctx, nbytes, FS_TAKE_TRANSIENT, buf, h);
    if (s != FS_OK)
        snprintf(c->last_error, sizeof c->last_error, "out of memory for %lld bytes of %s",
                 (long long)nbytes, kind);
    return s;
}

fs_status fs_link_all_gather(fs_link *l, const char *what, const void *send, void *recv,
                             int64_t count, fs_dtype t)
{
    fs_gather_batch *b = l->batch;
    fs_status s;
    if (!b || l->dev) {
        FS_LINK_RUN(l, s, FS_LOP_ALL_GATHER, what, count, t,
                    fs_comm_all_gather(l->comm, send, recv, count, t));
        return s;
    }
    if (b->nparts == FS_BATCH_MAX_PARTS) {
        snprintf(l->comm->last_error, sizeof l->comm->last_error,
                 "more than %d all-gathers coalesced in one call", FS_BATCH_MAX_PARTS);
        return FS_ERR_INVALID_ARG;
    }
    const int64_t nbytes = count * (int64_t)fs_dtype_size(t);
    if (!nbytes)
        return FS_OK;
    record(b->part, &b->nparts, &b->dtype, &b->what, what, t,
           (fs_coalesced_part){send, recv, nbytes, NULL});
    b->nbytes += nbytes;
    return FS_OK;
}

fs_status fs_gather_batch_flush(fs_gather_batch *b, fs_link *l, const fs_env *env)
{
    fs_comm *c = l->comm;
    const int n = b->nparts;
    const int64_t total = b->nbytes;
    const size_t es = fs_dtype_size(b->dtype);
    b->nparts = 0;
    b->nbytes = 0;
    if (!n)
        return FS_OK;
    fs_status s;
    if (n == 1) { /* nothing to pack */
        FS_LINK_RUN(l, s, FS_LOP_ALL_GATHER, b->what, total / (int64_t)es, b->dtype,
                    fs_comm_all_gather(c, b->part[0].send, b->part[0].recv,
                                       total / (int64_t)es, b->dtype));
        return s;
    }
    /* the parts' sizes are multiples of the common dtype's, or it is bytes */
    char what[FS_LEDGER_UNIT];
    coalesced_name(what, b->what, n);
    void *buf, *h;
    if ((s = take_staging(env, c, total * c->world_size, "coalesced all-gather", &buf, &h)) !=
        FS_OK)
        return s;
    char *mine = (char *)buf + (size_t)c->rank * (size_t)total;
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        memcpy(mine + off, b->part[i].send, (size_t)b->part[i].size);
        off += b->part[i].size;
    }
    FS_LINK_RUN(l, s, FS_LOP_ALL_GATHER, what, total / (int64_t)es, b->dtype,
                fs_comm_all_gather(c, mine, buf, total / (int64_t)es, b->dtype));
    if (s == FS_OK) {
        for (int r = 0; r < c->world_size; r++) {
            const char *from = (const char *)buf + (size_t)r * (size_t)total;
            off = 0;
            for (int i = 0; i < n; i++) {
                const int64_t nb = b->part[i].size;
                memcpy((char *)b->part[i].recv + (size_t)r * (size_t)nb, from + off, (size_t)nb);
                off += nb;
            }
        }
    }
    env->release(env->ctx, h);
    return s;
}

/* ---------------------------------------------------------------------------
 * reduction buckets ([Note: reduction buckets] in engine.h) */

fs_status fs_link_reduce_scatter(fs_link *l, const char *what, const void *send, void *recv,
                                 int64_t recv_count, fs_dtype t, void *owner)
{
    fs_reduce_bucket *b = l->bucket;
    fs_status s;
    if (!b || l->dev) {
        FS_LINK_RUN(l, s, FS_LOP_REDUCE_SCATTER, what, recv_count, t,
                    fs_comm_reduce_scatter(l->comm, send, recv, recv_count, t, FS_RED_SUM));
        return s;
    }
    if (b->nparts == FS_BATCH_MAX_PARTS || (b->nparts && b->dtype != t)) {
        snprintf(l->comm->last_error, sizeof l->comm->last_error,
                 "a reduction bucket holds at most %d parts of one dtype: flush it first",
                 FS_BATCH_MAX_PARTS);
        return FS_ERR_INVALID_ARG;
    }
    record(b->part, &b->nparts, &b->dtype, &b->what, what, t,
           (fs_coalesced_part){send, recv, recv_count, owner});
    b->count += recv_count;
    return FS_OK;
}

fs_status fs_reduce_bucket_flush(fs_reduce_bucket *b, fs_link *l, const fs_env *env)
{
    fs_comm *c = l->comm;
    const int n = b->nparts, world = c->world_size;
    const int64_t total = b->count;
    const size_t es = fs_dtype_size(b->dtype);
    fs_status s;
    if (!n)
        return FS_OK;
    if (n == 1) { /* nothing to pack */
        FS_LINK_RUN(l, s, FS_LOP_REDUCE_SCATTER, b->what, total, b->dtype,
                    fs_comm_reduce_scatter(c, b->part[0].send, b->part[0].recv, total, b->dtype,
                                           FS_RED_SUM));
        return s;
    }
    char what[FS_LEDGER_UNIT];
    coalesced_name(what, b->what, n);
    void *buf, *h;
    if ((s = take_staging(env, c, total * (world + 1) * (int64_t)es, "bucketed reduce-scatter",
                          &buf, &h)) != FS_OK)
        return s;
    char *in = buf, *out = (char *)buf + (size_t)(total * world) * es;
    for (int r = 0; r < world; r++) { /* rank r's block: every part's rank-r block */
        char *to = in + (size_t)(r * total) * es;
        for (int i = 0; i < n; i++) {
            const size_t nb = (size_t)b->part[i].size * es;
            memcpy(to, (const char *)b->part[i].send + (size_t)r * nb, nb);
            to += nb;
        }
    }
    FS_LINK_RUN(l, s, FS_LOP_REDUCE_SCATTER, what, total, b->dtype,
                fs_comm_reduce_scatter(c, in, out, total, b->dtype, FS_RED_SUM));
    if (s == FS_OK) {
        const char *from = out;
        for (int i = 0; i < n; i++) {
            const size_t nb = (size_t)b->part[i].size * es;
            memcpy(b->part[i].recv, from, nb);
            from += nb;
        }
    }
    env->release(env->ctx, h);
    return s;
}
