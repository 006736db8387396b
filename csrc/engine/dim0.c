/* dim0.c - see dim0.h: fully_shard's groups on the engine. No Python. */
#include "dim0.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static fs_status fail(fs_dim0_group *g, fs_status s, const char *what, int collective,
                      const char *fmt, ...)
{
    g->err_what = what;
    g->err_collective = collective;
    va_list ap;
    va_start(ap, fmt);
    fs_group_words(g->err, sizeof g->err, s, fmt, ap);
    va_end(ap);
    return s;
}

/* [Note: copy counts]: n elements of dt written from st by a copy of `kind`
 * (a cast when the dtypes differ). */
static void count_copy(fs_dim0_group *g, int kind, fs_dtype dt, fs_dtype st, int64_t n)
{
    g->copied_bytes[dt == st ? kind : FS_DIM0_CAST] +=
        (unsigned long long)n * fs_dtype_size(dt);
}

static void drop(fs_dim0_group *g, void **h)
{
    fs_group_drop(&g->env, h);
}

fs_status fs_dim0_init(fs_dim0_group *g, const char *name, fs_env env, fs_link link,
                       fs_link replicate, int nparams, const int64_t *outer,
                       const int64_t *dim0, const int64_t *row_numel, const int *gathered,
                       int64_t align, fs_dtype compute, fs_dtype reduce)
{
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "%s", name);
    g->env = env;
    g->link = link;
    g->replicate = replicate;
    g->compute = compute;
    g->reduce = reduce;
    const int world = link.comm->world_size, rank = link.comm->rank;
    size_t n = nparams > 0 ? (size_t)nparams : 1;
    g->params = calloc(n, sizeof *g->params);
    g->entries = calloc(n * (size_t)world, sizeof *g->entries);
    g->gentries = calloc(n, sizeof *g->gentries);
    g->outs = calloc(n, sizeof *g->outs);
    g->out_t = calloc(n, sizeof *g->out_t);
    g->accumulate = calloc(n, sizeof *g->accumulate);
    int64_t *rows = calloc(n, sizeof *rows), *grows = calloc(n, sizeof *grows);
    if (!g->params || !g->entries || !g->gentries || !g->outs || !g->out_t || !g->accumulate ||
        !rows || !grows) {
        free(rows);
        free(grows);
        return fail(g, FS_ERR_NO_MEMORY, "construction", 0, "out of host memory");
    }
    g->nparams = nparams;
    fs_status s = FS_OK;
    /* the layout's rows: a row of the sharded dim across every outer run
     * (the gather leaves out the extensions' rows) */
    for (int i = 0; i < nparams && s == FS_OK; i++) {
        const int64_t o = outer ? outer[i] : 1;
        if (o < 0 || (o > 1 && row_numel[i] > INT64_MAX / o)) /* 0: an empty parameter */
            s = FS_ERR_INVALID_ARG;
        else
            rows[i] = o * row_numel[i];
        grows[i] = gathered[i] ? rows[i] : 0;
    }
    fs_dim0_layout lay;
    for (int r = 0; r < world && s == FS_OK; r++)
        s = fs_layout_dim0(dim0, rows, nparams, world, r, align, g->entries + (size_t)r * n,
                           &lay);
    if (s == FS_OK)
        g->block_numel = lay.block_numel;
    if (s == FS_OK)
        s = fs_layout_dim0(dim0, grows, nparams, world, rank, align, g->gentries, &lay);
    if (s == FS_OK)
        g->gather_block_numel = lay.block_numel;
    /* each gathered parameter whole in the unsharded buffer (rows: its
     * numels, grows: its offsets) */
    for (int i = 0; i < nparams && s == FS_OK; i++)
        rows[i] = dim0[i] < 0 || (grows[i] && dim0[i] > INT64_MAX / grows[i]) ? -1
                                                                               : dim0[i] * grows[i];
    if (s == FS_OK)
        s = fs_layout_dim0_unsharded(rows, nparams, world, align, grows, &g->full_alloc);
    for (int i = 0; i < nparams && s == FS_OK; i++) {
        fs_dim0_param *p = &g->params[i];
        p->outer = outer ? outer[i] : 1;
        p->dim0 = dim0[i];
        p->row_numel = row_numel[i];
        p->gathered = gathered[i];
        p->full_offset = grows[i];
    }
    free(rows);
    free(grows);
    if (s != FS_OK)
        return fail(g, s, "construction", 0, "bad parameter shapes or alignment");
    return FS_OK;
}

void fs_dim0_destroy(fs_dim0_group *g)
{
    if (g->env.release) {
        drop(g, &g->gathered_h);
        drop(g, &g->rs_in_h);
        drop(g, &g->rs_out_h);
        drop(g, &g->partial_h);
        for (int i = 0; i < g->nparams && g->outs; i++)
            drop(g, &g->outs[i]);
    }
    if (g->link.dev) {
        if (g->gather_event)
            g->link.dev->event_free(g->gather_event);
        if (g->reduce_event)
            g->link.dev->event_free(g->reduce_event);
    }
    free(g->params);
    free(g->entries);
    free(g->gentries);
    free(g->outs);
    free(g->out_t);
    free(g->accumulate);
    memset(g, 0, sizeof *g);
}

void fs_dim0_set_shards(fs_dim0_group *g, void *const *shards, const fs_dtype *shard_t)
{
    int same = 1;
    for (int i = 0; i < g->nparams; i++) {
        g->params[i].shard = shards[i];
        same = same && (!g->params[i].gathered || shard_t[i] == g->compute);
    }
    g->aliased = g->link.comm->world_size == 1 && same;
}

/* [Note: direct layout]: more than one rank, and the group one Shard(0)
 * parameter whose rows split evenly with no padding in a block: the
 * all-gather output is the unsharded parameter, the gradient the
 * reduce-scatter input. */
static int direct_layout(const fs_dim0_group *g)
{
    const int world = g->link.comm->world_size;
    if (world < 2 || g->nparams != 1 || !g->params[0].gathered)
        return 0;
    const fs_dim0_param *p = &g->params[0];
    const fs_dim0_entry *e = &g->gentries[0];
    return p->outer == 1 && p->dim0 % world == 0 && p->full_offset == 0 &&
           e->block_offset == 0 && g->gather_block_numel == e->local_rows * p->row_numel &&
           g->block_numel == g->gather_block_numel;
}

static int64_t param_numel(const fs_dim0_param *p)
{
    return p->outer * p->dim0 * p->row_numel;
}

void fs_dim0_set_full(fs_dim0_group *g, void *full, void *storage)
{
    g->full = full;
    g->storage = storage;
}

/* ---------------------------------------------------------------------------
 * gather */

/* Each rank's rows of every gathered parameter, from the gathered blocks
 * into the unsharded buffer. */
static fs_status copy_out(fs_dim0_group *g, void *stream)
{
    const int world = g->link.comm->world_size;
    const size_t es = fs_dtype_size(g->compute);
    void *full;
    if (direct_layout(g)) /* gathered in place [Note: direct layout] */
        return FS_OK;
    fs_status s = g->env.data(g->env.ctx, g->full, &full);
    if (s != FS_OK)
        return fail(g, s, "unshard", 0, NULL);
    for (int i = 0; i < g->nparams; i++) {
        const fs_dim0_param *p = &g->params[i];
        const fs_dim0_entry *e = &g->gentries[i];
        if (!p->gathered)
            continue;
        for (int r = 0; r < world; r++) {
            int64_t begin, rows;
            fs_dim0_rows(p->dim0, world, r, &begin, &rows);
            if (!rows || !p->row_numel)
                continue;
            const char *src = (const char *)g->gathered +
                              (r * g->gather_block_numel + e->block_offset) * es;
            char *dst = (char *)full + (p->full_offset + begin * p->row_numel) * es;
            /* outer runs of this rank's rows: packed in the block, dim0 rows
             * apart in the unsharded parameter */
            if ((s = fs_link_cast2d(&g->link, stream, dst, p->dim0 * p->row_numel, g->compute,
                                    src, rows * p->row_numel, g->compute, rows * p->row_numel,
                                    p->outer)) != FS_OK)
                return fail(g, s, "unshard", 0, "copy-out: %s", g->link.comm->last_error);
            count_copy(g, FS_DIM0_COPY_OUT, g->compute, g->compute,
                       p->outer * rows * p->row_numel);
        }
    }
    return FS_OK;
}

/* One rank [Note: direct layout]: nothing to gather; the host's unsharded
 * parameters are the shards (aliased), or each shard is cast into the
 * unsharded buffer. */
static fs_status unshard_alone(fs_dim0_group *g, const fs_dtype *shard_t)
{
    const fs_env *e = &g->env;
    const size_t es = fs_dtype_size(g->compute);
    void *full, *src;
    fs_status s;
    if (!g->aliased) {
        if ((s = e->set_storage(e->ctx, g->storage, g->full_alloc * (int64_t)es, &full)) !=
                FS_OK ||
            (s = e->data(e->ctx, g->full, &full)) != FS_OK)
            return fail(g, s, "unshard", 0, NULL);
        for (int i = 0; i < g->nparams; i++) {
            const fs_dim0_param *p = &g->params[i];
            const int64_t n = param_numel(p);
            if (!p->gathered || !n)
                continue;
            if ((s = e->data(e->ctx, p->shard, &src)) != FS_OK ||
                (s = fs_link_cast(&g->link, g->link.stream, (char *)full + p->full_offset * es,
                                  g->compute, src, shard_t[i], n)) != FS_OK)
                return fail(g, s, "unshard", 0, s == FS_OK ? NULL : "cast: %s",
                            g->link.comm->last_error);
            count_copy(g, FS_DIM0_COPY_OUT, g->compute, shard_t[i], n);
        }
    }
    g->n_all_gather++; /* the gather torch issues (and counts) at one rank too */
    g->unsharded = 1;
    return FS_OK;
}

/* [Note: direct layout]: the shard is the all-gather input (cast into this
 * rank's rows of the unsharded buffer first in another compute dtype), the
 * unsharded buffer its output. */
static fs_status gather_input(fs_dim0_group *g, const fs_dtype *shard_t, const void **send,
                              void **recv)
{
    const fs_env *e = &g->env;
    const size_t es = fs_dtype_size(g->compute);
    void *full, *src;
    fs_status s;
    if ((s = e->data(e->ctx, g->params[0].shard, &src)) != FS_OK ||
        (s = e->data(e->ctx, g->full, &full)) != FS_OK)
        return fail(g, s, "unshard", 0, NULL);
    *send = src;
    *recv = full;
    if (shard_t[0] == g->compute || !g->gather_block_numel)
        return FS_OK;
    char *mine = (char *)full + (size_t)g->link.comm->rank * g->gather_block_numel * es;
    if ((s = fs_link_cast(&g->link, g->link.stream, mine, g->compute, src, shard_t[0],
                          g->gather_block_numel)) != FS_OK)
        return fail(g, s, "unshard", 0, "cast: %s", g->link.comm->last_error);
    count_copy(g, FS_DIM0_COPY_IN, g->compute, shard_t[0], g->gather_block_numel);
    *send = mine;
    return FS_OK;
}

/* In place: each rank's rows are cast straight into its own block of the
 * gathered buffer, which is the all-gather's input. The padding at a
 * block's end is never copied out, so it is left as it comes. */
static fs_status stage_gather_input(fs_dim0_group *g, const fs_dtype *shard_t, int defer,
                                    const void **send, void **recv)
{
    const fs_env *e = &g->env;
    fs_link *l = &g->link;
    fs_comm *c = l->comm;
    const size_t es = fs_dtype_size(g->compute);
    fs_status s;
    if ((s = e->take(e->ctx, g->gather_block_numel * c->world_size * (int64_t)es,
                     defer ? 0 : FS_TAKE_TRANSIENT, &g->gathered, &g->gathered_h)) != FS_OK)
        return fail(g, s, "unshard", 0, "out of memory");
    char *mine = (char *)g->gathered + (size_t)c->rank * g->gather_block_numel * es;
    for (int i = 0; i < g->nparams; i++) {
        const fs_dim0_entry *en = &g->gentries[i];
        void *src;
        if (!g->params[i].gathered || !en->local_rows || !en->row_numel)
            continue;
        if ((s = e->data(e->ctx, g->params[i].shard, &src)) != FS_OK ||
            (s = fs_link_cast(l, l->stream, mine + en->block_offset * es, g->compute, src,
                              shard_t[i], en->local_rows * en->row_numel)) != FS_OK) {
            drop(g, &g->gathered_h);
            return fail(g, s, "unshard", 0, s == FS_OK ? NULL : "copy-in: %s",
                        c->last_error);
        }
        count_copy(g, FS_DIM0_COPY_IN, g->compute, shard_t[i], en->local_rows * en->row_numel);
    }
    *send = mine;
    *recv = g->gathered;
    return FS_OK;
}

fs_status fs_dim0_unshard(fs_dim0_group *g, const fs_dtype *shard_t, int defer)
{
    const fs_env *e = &g->env;
    fs_link *l = &g->link;
    fs_comm *c = l->comm;
    const int world = c->world_size;
    const size_t es = fs_dtype_size(g->compute);
    defer = defer && l->dev;
    /* [Note: coalesced gathers]: the copy-out waits for the batch's flush */
    const int batched = l->batch && !l->dev;
    fs_status s;
    if (g->unsharded) /* a pending gather is waited for, unless this is a prefetch too */
        return defer ? FS_OK : fs_dim0_wait(g);
    if (world == 1)
        return unshard_alone(g, shard_t);
    void *none;
    if ((s = e->set_storage(e->ctx, g->storage, g->full_alloc * (int64_t)es, &none)) != FS_OK)
        return fail(g, s, "unshard", 0, NULL);
    const void *send = NULL;
    void *recv = NULL;
    if ((s = direct_layout(g) ? gather_input(g, shard_t, &send, &recv)
                              : stage_gather_input(g, shard_t, defer, &send, &recv)) != FS_OK)
        return s;
    if (defer)
        l->dev->set_defer(c, 1);
    s = fs_link_all_gather(l, g->name, send, recv, g->gather_block_numel, g->compute);
    if (defer) {
        l->dev->set_defer(c, 0);
        if (s == FS_OK)
            s = l->dev->record(c, &g->gather_event, c->last_error, sizeof c->last_error);
    }
    if (s != FS_OK) {
        drop(g, &g->gathered_h);
        return fail(g, s, "all-gather", 1, "all_gather: %s", c->last_error);
    }
    g->n_all_gather++;
    g->unsharded = 1;
    if (defer || batched) {
        g->gather_pending = 1;
        g->n_deferred_gather += defer;
        return FS_OK;
    }
    s = copy_out(g, l->stream);
    drop(g, &g->gathered_h);
    return s;
}

/* A recorded gather whose batch failed: nothing was gathered. */
static void abandon(fs_dim0_group *g)
{
    if (!g->gather_pending || g->link.dev)
        return;
    void *none;
    g->gather_pending = 0;
    drop(g, &g->gathered_h);
    g->env.set_storage(g->env.ctx, g->storage, 0, &none);
    g->unsharded = 0;
}

fs_status fs_dim0_unshard_along(fs_dim0_group *g, const fs_dtype *own_t, int own,
                                fs_dim0_group *const *along, const fs_dtype *const *shard_t,
                                int n, int *failed)
{
    fs_gather_batch batch;
    batch.nparts = 0;
    batch.nbytes = 0;
    fs_status s = FS_OK;
    *failed = -1;
    g->link.batch = &batch;
    if (own && !g->unsharded)
        s = fs_dim0_unshard(g, own_t, 0);
    g->link.batch = NULL;
    for (int i = 0; i < n && s == FS_OK; i++) {
        if (along[i]->unsharded)
            continue;
        along[i]->link.batch = &batch;
        s = fs_dim0_unshard(along[i], shard_t[i], 0);
        along[i]->link.batch = NULL;
        if (s != FS_OK)
            *failed = i;
    }
    if (s == FS_OK && (s = fs_gather_batch_flush(&batch, &g->link, &g->env)) != FS_OK)
        s = fail(g, s, "all-gather", 1, "coalesced all_gather: %s", g->link.comm->last_error);
    /* the copy-outs, or after a failure the buffers back */
    for (int i = -1; i < n; i++) {
        fs_dim0_group *x = i < 0 ? g : along[i];
        if (s != FS_OK) {
            abandon(x);
        } else if ((s = fs_dim0_wait(x)) != FS_OK) {
            *failed = i;
        }
    }
    return s;
}

fs_status fs_dim0_unshard_from(fs_dim0_group *g, fs_link *post, void *chunk)
{
    const fs_env *e = &g->env;
    const size_t es = fs_dtype_size(g->compute);
    void *src, *dst, *none;
    int64_t count; /* the all-gather puts each rank's chunk back where it was cut */
    fs_status s = fs_layout_dim0_post_chunk(g->full_alloc, post->comm->world_size,
                                            post->comm->rank, NULL, &count);
    if (s != FS_OK)
        return fail(g, s, "unshard", 0, "a group of %d does not divide the unsharded buffer",
                    post->comm->world_size);
    if ((s = fs_dim0_wait(g)) != FS_OK)
        return s;
    if (g->unsharded)
        return FS_OK;
    if ((s = e->set_storage(e->ctx, g->storage, g->full_alloc * (int64_t)es, &none)) != FS_OK ||
        (s = e->data(e->ctx, chunk, &src)) != FS_OK || (s = e->data(e->ctx, g->full, &dst)) != FS_OK)
        return fail(g, s, "unshard", 0, NULL);
    FS_LINK_RUN(post, s, FS_LOP_ALL_GATHER, g->name, count, g->compute,
                fs_comm_all_gather(post->comm, src, dst, count, g->compute));
    if (s != FS_OK)
        return fail(g, s, "all-gather", 1, "all_gather after forward: %s",
                    post->comm->last_error);
    g->n_post_gather++;
    g->unsharded = 1;
    return FS_OK;
}

fs_status fs_dim0_wait(fs_dim0_group *g)
{
    if (!g->gather_pending)
        return FS_OK;
    fs_comm *c = g->link.comm;
    g->gather_pending = 0;
    fs_status s = g->link.dev ? g->link.dev->wait(g->gather_event, g->link.stream,
                                                  c->last_error, sizeof c->last_error)
                              : FS_OK; /* a host batch: flushed by now */
    if (s != FS_OK) {
        drop(g, &g->gathered_h);
        return fail(g, s, "unshard", 0, "waiting for a prefetched all-gather: %s",
                    c->last_error);
    }
    s = copy_out(g, g->link.stream);
    drop(g, &g->gathered_h); /* the caller's stream orders its reuse */
    return s;
}

fs_status fs_dim0_reshard(fs_dim0_group *g)
{
    fs_status s = fs_dim0_wait(g); /* its buffers go back only after the stream waited */
    if (s != FS_OK || !g->unsharded)
        return s;
    void *none;
    if ((s = g->env.set_storage(g->env.ctx, g->storage, 0, &none)) != FS_OK)
        return fail(g, s, "reshard", 0, NULL);
    g->unsharded = 0;
    return FS_OK;
}

/* ---------------------------------------------------------------------------
 * reduce */

static void unlend(fs_dim0_group *g, fs_link *l, void **h)
{
    if (*h)
        fs_link_unlend(l);
    drop(g, h);
}

/* A reduction without the replicas' all-reduce writes nothing. */
static int writes(const fs_dim0_group *g)
{
    return !g->replicate.comm || g->all_reduce;
}

/* After the reduce-scatter [Note: reduce output]: across replicas (with the
 * partial sum), or into the partial sum; then a held output's divide. */
static fs_status collect(fs_dim0_group *g)
{
    fs_link *l = &g->link;
    fs_status s = FS_OK;
    const size_t rs = fs_dtype_size(g->reduce);
    if (!writes(g)) {
        /* kept past the call: the next reductions add to it */
        const int add = g->partial_h != NULL;
        if (!add && (s = g->env.take(g->env.ctx, g->block_numel * (int64_t)rs, 0, &g->partial,
                                     &g->partial_h)) != FS_OK)
            return fail(g, s, "reduce-scatter", 0, "partial sum: out of memory");
        if ((s = fs_link_scale_accumulate(l, l->stream, g->partial, g->reduce, g->rs_out,
                                          g->reduce, g->block_numel, 1.0, add)) != FS_OK)
            return fail(g, s, "reduce-scatter", 0, "partial sum: %s", l->comm->last_error);
        return FS_OK;
    }
    if (g->replicate.comm) {
        fs_link *r = &g->replicate;
        void *ws;
        if (g->partial_h) {
            s = fs_link_scale_accumulate(l, l->stream, g->rs_out, g->reduce, g->partial,
                                         g->reduce, g->block_numel, 1.0, 1);
            drop(g, &g->partial_h); /* the stream orders its reuse */
            if (s != FS_OK)
                return fail(g, s, "all-reduce", 0, "partial sum: %s", l->comm->last_error);
        }
        if ((s = fs_link_lend(&g->env, r, g->reduce, g->block_numel, &ws)) != FS_OK)
            return fail(g, s, "all-reduce", 0, "out of memory");
        FS_LINK_RUN(r, s, FS_LOP_ALL_REDUCE, g->name, g->block_numel, g->reduce,
                    fs_comm_all_reduce(r->comm, g->rs_out, g->block_numel, g->reduce,
                                       FS_RED_SUM));
        unlend(g, r, &ws);
        if (s != FS_OK)
            return fail(g, s, "all-reduce", 1, "all_reduce across replicas: %s",
                        r->comm->last_error);
    }
    /* a hook reads what torch's reads: the collective's own divide done */
    if (g->held && g->divide.in_comm != 1.0 &&
        (s = fs_link_scale_accumulate(l, l->stream, g->rs_out, g->reduce, g->rs_out, g->reduce,
                                      g->block_numel, 1.0 / g->divide.in_comm, 0)) != FS_OK)
        return fail(g, s, "reduce-scatter", 0, "divide: %s", l->comm->last_error);
    return FS_OK;
}

/* What the reduce output was not divided by yet, then each sharded
 * gradient. The post divide runs in the reduce dtype before the cast and the
 * add, as torch's does; fused into them where that changes no bits: the same
 * dtype, and an add that rounds its product as the reduce dtype does (f32,
 * f64). The collective's own divide stays fused, as the collective would
 * round it. */
static fs_status write_grads(fs_dim0_group *g)
{
    fs_link *l = &g->link;
    fs_comm *c = l->comm;
    fs_status s = FS_OK;
    const int rank = c->rank;
    const size_t n = g->nparams > 0 ? (size_t)g->nparams : 1;
    if (!writes(g))
        return FS_OK;
    double scale = g->held ? 1.0 : 1.0 / g->divide.in_comm;
    if (g->divide.post != 1.0) {
        int same = 1;
        for (int i = 0; i < g->nparams; i++)
            same &= !g->outs[i] ||
                    (g->out_t[i] == g->reduce &&
                     (!g->accumulate[i] || g->reduce == FS_F32 || g->reduce == FS_F64));
        if (same) {
            scale /= g->divide.post;
        } else if ((s = fs_link_scale_accumulate(l, l->stream, g->rs_out, g->reduce, g->rs_out,
                                                 g->reduce, g->block_numel,
                                                 1.0 / g->divide.post, 0)) != FS_OK) {
            return fail(g, s, "reduce-scatter", 0, "divide: %s", c->last_error);
        }
    }
    const size_t rs = fs_dtype_size(g->reduce);
    for (int i = 0; i < g->nparams && s == FS_OK; i++) {
        const fs_dim0_entry *e = &g->entries[(size_t)rank * n + i];
        void *dst;
        if (!g->outs[i] || !e->local_rows || !e->row_numel)
            continue;
        if ((s = g->env.data(g->env.ctx, g->outs[i], &dst)) != FS_OK)
            return fail(g, s, "reduce-scatter", 0, NULL);
        const char *src = (const char *)g->rs_out + e->block_offset * rs;
        if (dst == src && scale == 1.0) /* reduced in place [Note: direct layout] */
            continue;
        s = fs_link_scale_accumulate(l, l->stream, dst, g->out_t[i], src, g->reduce,
                                     e->local_rows * e->row_numel, scale, g->accumulate[i]);
        if (s != FS_OK)
            return fail(g, s, "reduce-scatter", 0, "gradient: %s", c->last_error);
        if (!g->accumulate[i] && dst != src)
            count_copy(g, FS_DIM0_REDUCE_OUT, g->out_t[i], g->reduce,
                       e->local_rows * e->row_numel);
    }
    return s;
}

static void release_reduction(fs_dim0_group *g)
{
    drop(g, &g->rs_in_h);
    drop(g, &g->rs_out_h);
    for (int i = 0; i < g->nparams; i++)
        drop(g, &g->outs[i]);
    g->reduce_pending = g->reduce_deferred = 0;
}

/* One rank in the shard group [Note: direct layout]: each gradient summed
 * across the replicas in place (HSDP: one all-reduce each, in parameter
 * order on every rank), then scaled into its sharded gradient, in place when
 * that is the gradient itself. A gradient of another dtype than the reduce
 * dtype is cast first: into a new output of the reduce dtype, else into a
 * buffer of its own (as for a trainable parameter without a gradient:
 * zeros). */
static fs_status reduce_alone(fs_dim0_group *g, void *const *grads, const fs_dtype *grad_t,
                              void *const *outs, const fs_dtype *out_t, const int *accumulate)
{
    const fs_env *e = &g->env;
    fs_link *l = &g->link;
    fs_link *r = g->replicate.comm ? &g->replicate : NULL;
    const size_t rs = fs_dtype_size(g->reduce);
    const fs_divide *d = &g->divide; /* [Note: divide rule]: pre, then the sum, then the rest */
    fs_status s = FS_OK;
    const char *what = "reduce-scatter", *why = NULL;
    int collective = 0;
    for (int i = 0; i < g->nparams && s == FS_OK; i++) {
        const int64_t numel = param_numel(&g->params[i]);
        void *src = NULL, *dst = NULL, *buf, *tmp_h = NULL, *ws;
        if ((!grads[i] && !outs[i]) || !numel)
            continue;
        if ((grads[i] && (s = e->data(e->ctx, grads[i], &src)) != FS_OK) ||
            (outs[i] && (s = e->data(e->ctx, outs[i], &dst)) != FS_OK))
            break;
        if (src && grad_t[i] == g->reduce) {
            buf = src;
        } else if (src && dst && dst != src && !accumulate[i] && out_t[i] == g->reduce) {
            if ((s = fs_link_cast(l, l->stream, dst, g->reduce, src, grad_t[i], numel)) !=
                FS_OK) {
                why = "cast";
                break;
            }
            count_copy(g, FS_DIM0_REDUCE_IN, g->reduce, grad_t[i], numel);
            buf = dst;
        } else {
            if ((s = e->take(e->ctx, numel * (int64_t)rs, FS_TAKE_ZERO | FS_TAKE_TRANSIENT,
                             &buf, &tmp_h)) != FS_OK) {
                why = "out of memory";
                break;
            }
            if (src && (s = fs_link_cast(l, l->stream, buf, g->reduce, src, grad_t[i],
                                         numel)) != FS_OK) {
                drop(g, &tmp_h);
                why = "copy-in";
                break;
            }
            if (src)
                count_copy(g, FS_DIM0_REDUCE_IN, g->reduce, grad_t[i], numel);
        }
        if (d->pre != 1.0 && (s = fs_link_scale_accumulate(l, l->stream, buf, g->reduce, buf,
                                                           g->reduce, numel, 1.0 / d->pre, 0)) !=
                                 FS_OK) {
            drop(g, &tmp_h);
            why = "divide";
            break;
        }
        if (r && (s = fs_link_lend(e, r, g->reduce, numel, &ws)) == FS_OK) {
            FS_LINK_RUN(r, s, FS_LOP_ALL_REDUCE, g->name, numel, g->reduce,
                        fs_comm_all_reduce(r->comm, buf, numel, g->reduce, FS_RED_SUM));
            unlend(g, r, &ws);
            if (s != FS_OK) {
                what = "all-reduce";
                collective = 1;
                why = "all_reduce across replicas";
            }
        } else if (r) {
            why = "out of memory";
        }
        /* the post divide fused into the write where that changes no bits
         * (write_grads' rule) */
        double scale = 1.0 / d->in_comm;
        if (s == FS_OK && d->post != 1.0) {
            if (dst && out_t[i] == g->reduce &&
                (!accumulate[i] || g->reduce == FS_F32 || g->reduce == FS_F64))
                scale /= d->post;
            else if ((s = fs_link_scale_accumulate(l, l->stream, buf, g->reduce, buf, g->reduce,
                                                   numel, 1.0 / d->post, 0)) != FS_OK)
                why = "divide";
        }
        if (s == FS_OK && dst && !(dst == buf && scale == 1.0)) {
            s = fs_link_scale_accumulate(l, l->stream, dst, out_t[i], buf, g->reduce, numel,
                                         scale, accumulate[i]);
            if (s != FS_OK)
                why = "gradient";
            else if (!accumulate[i] && dst != buf)
                count_copy(g, FS_DIM0_REDUCE_OUT, out_t[i], g->reduce, numel);
        }
        drop(g, &tmp_h);
    }
    if (s != FS_OK)
        return fail(g, s, what, collective, why ? "%s: %s" : NULL, why,
                    (collective ? r : l)->comm->last_error);
    g->n_reduce_scatter++; /* the reduction torch issues (and counts) at one rank too */
    return FS_OK;
}

fs_status fs_dim0_reduce(fs_dim0_group *g, void *const *grads, const fs_dtype *grad_t,
                         void *const *outs, const fs_dtype *out_t, const int *accumulate,
                         double factor, unsigned flags)
{
    const fs_env *e = &g->env;
    fs_link *l = &g->link;
    fs_comm *c = l->comm;
    const int world = c->world_size;
    const size_t n = g->nparams > 0 ? (size_t)g->nparams : 1, rs = fs_dtype_size(g->reduce);
    const int defer = (flags & FS_DIM0_DEFER) && l->dev;
    /* [Note: reduction buckets]: kept like a deferred one until the flush */
    const int bucketed = l->bucket && !l->dev;
    fs_status s;
    if (g->reduce_pending && (s = fs_dim0_finish_reduce(g)) != FS_OK)
        return s;
    g->all_reduce = !(flags & FS_DIM0_NO_ALL_REDUCE);
    g->held = writes(g) && (flags & FS_DIM0_HOLD);
    if ((s = fs_divide_rule(FS_DIVIDE_FULLY_SHARD, g->reduce, world,
                            g->replicate.comm ? g->replicate.comm->world_size : 1, factor,
                            (flags & FS_DIM0_FORCE_SUM) != 0, &g->divide)) != FS_OK)
        return fail(g, s, "reduce-scatter", 0, "group '%s': the gradient divide factor must be "
                    "> 0 and finite, got %g", g->name, factor);
    if (bucketed && (!writes(g) || g->held))
        return fail(g, FS_ERR_INVALID_ARG, "reduce-scatter", 0, "a reduction into the HSDP "
                    "partial sum, or held for a hook, cannot wait in a bucket");
    /* (a partial sum kept from reductions without the all-reduce is added
     * to the reduce output first: the staged path) */
    if (world == 1 && writes(g) && !g->held && !bucketed && !g->partial_h)
        return reduce_alone(g, grads, grad_t, outs, out_t, accumulate);
    /* [Note: direct layout]: the gradient is the reduce-scatter input, a new
     * sharded gradient of the reduce dtype its output (held like taken
     * buffers while a deferred collective reads them) */
    const int direct = direct_layout(g) && !bucketed && writes(g) && !g->held;
    const int direct_in = direct && grads[0] && grad_t[0] == g->reduce;
    const int direct_out = direct && outs[0] && !accumulate[0] && out_t[0] == g->reduce;
    void *rs_in;
    /* zeroed: the padding, and the rows of parameters without a gradient;
     * a held rs_out outlives the call */
    if (direct_in) {
        g->rs_in_h = e->hold(e->ctx, grads[0]);
        s = e->data(e->ctx, grads[0], &rs_in);
    } else {
        s = e->take(e->ctx, g->block_numel * world * (int64_t)rs,
                    FS_TAKE_ZERO | (defer      ? 0
                                    : bucketed ? FS_TAKE_STAGING
                                               : FS_TAKE_TRANSIENT),
                    &rs_in, &g->rs_in_h);
    }
    if (s == FS_OK && direct_out) {
        g->rs_out_h = e->hold(e->ctx, outs[0]);
        s = e->data(e->ctx, outs[0], &g->rs_out);
    } else if (s == FS_OK) {
        s = e->take(e->ctx, g->block_numel * (int64_t)rs,
                    defer || g->held ? 0 : bucketed ? FS_TAKE_STAGING : FS_TAKE_TRANSIENT,
                    &g->rs_out, &g->rs_out_h);
    }
    if (s != FS_OK) {
        release_reduction(g);
        return fail(g, s, "reduce-scatter", 0, s == FS_ERR_HOST ? NULL : "out of memory");
    }
    for (int i = 0; i < g->nparams; i++) {
        void *src;
        if (!grads[i] || direct_in)
            continue;
        if ((s = e->data(e->ctx, grads[i], &src)) != FS_OK) {
            release_reduction(g);
            return fail(g, s, "reduce-scatter", 0, NULL);
        }
        size_t gs = fs_dtype_size(grad_t[i]);
        const fs_dim0_param *p = &g->params[i];
        for (int r = 0; r < world; r++) {
            const fs_dim0_entry *en = &g->entries[(size_t)r * n + i];
            if (!en->local_rows || !en->row_numel)
                continue;
            const int64_t run = en->local_rows * p->row_numel; /* per outer index */
            s = fs_link_cast2d(l, l->stream,
                               (char *)rs_in + (r * g->block_numel + en->block_offset) * rs, run,
                               g->reduce,
                               (const char *)src + en->local_row_begin * p->row_numel * gs,
                               p->dim0 * p->row_numel, grad_t[i], run, p->outer);
            if (s != FS_OK) {
                release_reduction(g);
                return fail(g, s, "reduce-scatter", 0, "copy-in: %s", c->last_error);
            }
            count_copy(g, FS_DIM0_REDUCE_IN, g->reduce, grad_t[i], run * p->outer);
        }
    }
    for (int i = 0; i < g->nparams; i++) {
        g->outs[i] = outs[i] ? e->hold(e->ctx, outs[i]) : NULL;
        g->out_t[i] = out_t[i];
        g->accumulate[i] = accumulate[i];
    }
    /* torch divides its reduce-scatter input in place, padding and all */
    if (g->divide.pre != 1.0 &&
        (s = fs_link_scale_accumulate(l, l->stream, rs_in, g->reduce, rs_in, g->reduce,
                                      g->block_numel * world, 1.0 / g->divide.pre, 0)) != FS_OK) {
        release_reduction(g);
        return fail(g, s, "reduce-scatter", 0, "divide: %s", c->last_error);
    }
    void *ws;
    if ((s = fs_link_lend(e, l, g->reduce, g->block_numel * world, &ws)) != FS_OK) {
        release_reduction(g);
        return fail(g, s, "reduce-scatter", 0, "out of memory");
    }
    if (defer)
        l->dev->set_defer(c, 1);
    s = fs_link_reduce_scatter(l, g->name, rs_in, g->rs_out, g->block_numel, g->reduce, g);
    if (defer) {
        l->dev->set_defer(c, 0);
        if (s == FS_OK)
            s = l->dev->record(c, &g->reduce_event, c->last_error, sizeof c->last_error);
    }
    if (ws) /* a deferred collective reads it until waited for (g->ws_h) */
        fs_link_unlend(l);
    if (s != FS_OK) {
        drop(g, &ws);
        release_reduction(g);
        return fail(g, s, "reduce-scatter", 1, "reduce_scatter: %s", c->last_error);
    }
    g->n_reduce_scatter++;
    g->reduce_pending = 1;
    if (bucketed) { /* the host flushes, then finishes (ws: none on the host) */
        g->reduce_deferred = g->in_bucket = 1;
        return FS_OK;
    }
    if (defer) {
        g->ws_h = ws;
        g->reduce_deferred = 1;
        g->n_deferred_reduce++;
        return FS_OK;
    }
    drop(g, &ws);
    drop(g, &g->rs_in_h);
    s = collect(g);
    if (s == FS_OK && g->held)
        return FS_OK; /* held: fs_dim0_finish_reduce writes */
    if (s == FS_OK)
        s = write_grads(g);
    release_reduction(g);
    return s;
}

fs_status fs_dim0_wait_reduce(fs_dim0_group *g)
{
    if (!g->reduce_deferred)
        return FS_OK;
    if (g->in_bucket)
        return fail(g, FS_ERR_INVALID_ARG, "reduce-scatter", 0, "its reduce-scatter still "
                    "waits in a bucket: flush the bucket first");
    fs_comm *c = g->link.comm;
    g->reduce_deferred = 0;
    fs_status s = g->link.dev ? g->link.dev->wait(g->reduce_event, g->link.stream,
                                                  c->last_error, sizeof c->last_error)
                              : FS_OK; /* a host bucket: flushed by now */
    drop(g, &g->ws_h);
    drop(g, &g->rs_in_h); /* the stream waited for the collective that read it */
    if (s != FS_OK)
        s = fail(g, s, "reduce-scatter", 0, "waiting for a gradient reduction: %s",
                 c->last_error);
    else
        s = collect(g);
    if (s != FS_OK)
        release_reduction(g);
    return s;
}

fs_status fs_dim0_finish_reduce(fs_dim0_group *g)
{
    if (!g->reduce_pending)
        return FS_OK;
    fs_status s = fs_dim0_wait_reduce(g);
    if (s != FS_OK)
        return s;
    s = write_grads(g);
    release_reduction(g);
    return s;
}

void fs_dim0_cancel_reduce(fs_dim0_group *g)
{
    g->in_bucket = 0;
    if (g->reduce_pending && !g->link.dev)
        release_reduction(g);
}

/* a bucket's parts: owners[i]'s reduction (group.h's callbacks) */
static fs_status finish_part(void *owners, int i)
{
    fs_dim0_group *g = ((fs_dim0_group *const *)owners)[i];
    g->in_bucket = 0;
    return fs_dim0_finish_reduce(g);
}

static void cancel_part(void *owners, int i)
{
    fs_dim0_cancel_reduce(((fs_dim0_group *const *)owners)[i]);
}

void fs_dim0_cancel_bucket(fs_reduce_bucket *b, fs_dim0_group *const *owners)
{
    const fs_bucket_owners o = {finish_part, cancel_part, (void *)owners};
    fs_group_cancel_bucket(b, &o);
}

fs_status fs_dim0_flush_bucket(fs_reduce_bucket *b, fs_dim0_group *g,
                               fs_dim0_group *const *owners, int *failed)
{
    const fs_bucket_owners o = {finish_part, cancel_part, (void *)owners};
    fs_status s = fs_group_flush_bucket(b, &g->link, &g->env, &o, failed);
    if (s != FS_OK && *failed < 0)
        fail(g, s, "reduce-scatter", 1, "bucketed reduce_scatter: %s", g->link.comm->last_error);
    return s;
}

void fs_dim0_drop_partial(fs_dim0_group *g)
{
    drop(g, &g->partial_h);
    g->partial = NULL;
}

/* ---------------------------------------------------------------------------
 * accumulation without sync */

fs_status fs_dim0_accumulate(fs_dim0_group *g, void *src, fs_dtype src_t, void *dst,
                             fs_dtype dst_t, int64_t n, int add)
{
    const fs_env *e = &g->env;
    void *s_ptr, *d_ptr;
    fs_status s;
    if ((s = e->data(e->ctx, src, &s_ptr)) != FS_OK || (s = e->data(e->ctx, dst, &d_ptr)) != FS_OK)
        return fail(g, s, "accumulate", 0, NULL);
    if ((s = fs_link_scale_accumulate(&g->link, g->link.stream, d_ptr, dst_t, s_ptr, src_t, n,
                                      1.0, add)) != FS_OK)
        return fail(g, s, "accumulate", 0, "%s", g->link.comm->last_error);
    if (!add && src_t != dst_t) /* the first of the sums [Note: accumulation dtype] */
        count_copy(g, FS_DIM0_CAST, dst_t, src_t, n);
    return FS_OK;
}
