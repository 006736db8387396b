/* shard_group.c - see shard_group.h: fully_shard's groups on the engine: their layout,
 * gathers and frees, and what shard_group_reduce.c shares (shard_group_internal.h).
 * Gradient reductions are in shard_group_reduce.c. No Python. */
#include "shard_group_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void fs_shard_count_copy(fs_shard_group *g, int kind, fs_dtype dt, fs_dtype st, int64_t n)
{
    g->copied_bytes[dt == st ? kind : FS_SHARD_CAST] +=
        (unsigned long long)n * fs_dtype_size(dt);
}

int fs_shard_direct_layout(const fs_shard_group *g)
{
    const int world = g->core.link.comm->world_size;
    if (world < 2 || g->nparams != 1 || !g->params[0].gathered)
        return 0;
    const fs_shard_param *p = &g->params[0];
    const fs_dim0_entry *e = &g->gentries[0];
    return p->outer == 1 && p->dim0 % world == 0 && p->full_offset == 0 &&
           e->block_offset == 0 && g->gather_block_numel == e->local_rows * p->row_numel &&
           g->block_numel == g->gather_block_numel;
}

fs_status fs_shard_init(fs_shard_group *g, const char *name, fs_env env, fs_link link,
                       fs_link replicate, int nparams, const int64_t *outer,
                       const int64_t *dim0, const int64_t *row_numel, const int64_t *gathered,
                       int64_t align, fs_dtype compute, fs_dtype reduce)
{
    memset(g, 0, sizeof *g);
    fs_group_core_init(&g->core, name, env, link, replicate);
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
        return fs_group_fail(&g->core, FS_ERR_NO_MEMORY, "construction", 0, "out of host memory");
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
        fs_shard_param *p = &g->params[i];
        p->outer = outer ? outer[i] : 1;
        p->dim0 = dim0[i];
        p->row_numel = row_numel[i];
        p->gathered = gathered[i] != 0;
        p->full_offset = grows[i];
    }
    free(rows);
    free(grows);
    if (s != FS_OK)
        return fs_group_fail(&g->core, s, "construction", 0, "bad parameter shapes or alignment");
    return FS_OK;
}

void fs_shard_destroy(fs_shard_group *g)
{
    if (g->core.env.release) {
        fs_group_drop(&g->core, &g->gathered_h);
        fs_group_drop(&g->core, &g->rs_in_h);
        fs_group_drop(&g->core, &g->rs_out_h);
        fs_group_drop(&g->core, &g->partial_h);
        for (int i = 0; i < g->nparams && g->outs; i++)
            fs_group_drop(&g->core, &g->outs[i]);
    }
    fs_group_core_destroy(&g->core);
    free(g->params);
    free(g->entries);
    free(g->gentries);
    free(g->outs);
    free(g->out_t);
    free(g->accumulate);
    memset(g, 0, sizeof *g);
}

void fs_shard_set_shards(fs_shard_group *g, void *const *shards, const fs_dtype *shard_t)
{
    int same = 1;
    for (int i = 0; i < g->nparams; i++) {
        g->params[i].shard = shards[i];
        g->params[i].shard_t = shard_t[i];
        same = same && (!g->params[i].gathered || shard_t[i] == g->compute);
    }
    g->aliased = g->core.link.comm->world_size == 1 && same;
}

void fs_shard_set_full(fs_shard_group *g, void *full, void *storage)
{
    g->full = full;
    g->storage = storage;
    g->core.unsharded = 0;
}

/* ---------------------------------------------------------------------------
 * gather */

/* Each rank's rows of every gathered parameter, from the gathered blocks
 * into the unsharded buffer. */
static fs_status copy_out(fs_shard_group *g, void *stream)
{
    const int world = g->core.link.comm->world_size;
    const size_t es = fs_dtype_size(g->compute);
    void *full;
    if (fs_shard_direct_layout(g)) /* gathered in place [Note: direct layout] */
        return FS_OK;
    fs_status s = g->core.env.data(g->core.env.ctx, g->full, &full);
    if (s != FS_OK)
        return fs_group_fail(&g->core, s, "unshard", 0, NULL);
    for (int i = 0; i < g->nparams; i++) {
        const fs_shard_param *p = &g->params[i];
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
            if ((s = fs_link_cast2d(&g->core.link, stream, dst, p->dim0 * p->row_numel, g->compute,
                                    src, rows * p->row_numel, g->compute, rows * p->row_numel,
                                    p->outer)) != FS_OK)
                return fs_group_fail(&g->core, s, "unshard", 0, "copy-out: %s",
                                     g->core.link.comm->last_error);
            fs_shard_count_copy(g, FS_SHARD_COPY_OUT, g->compute, g->compute,
                               p->outer * rows * p->row_numel);
        }
    }
    return FS_OK;
}

/* One rank [Note: direct layout]: nothing to gather; the host's unsharded
 * parameters are the shards (aliased), or each shard is cast into the
 * unsharded buffer. */
static fs_status unshard_alone(fs_shard_group *g)
{
    const fs_env *e = &g->core.env;
    const size_t es = fs_dtype_size(g->compute);
    void *full, *src;
    fs_status s;
    if (!g->aliased) {
        if ((s = e->set_storage(e->ctx, g->storage, g->full_alloc * (int64_t)es, &full)) !=
                FS_OK ||
            (s = e->data(e->ctx, g->full, &full)) != FS_OK)
            return fs_group_fail(&g->core, s, "unshard", 0, NULL);
        for (int i = 0; i < g->nparams; i++) {
            const fs_shard_param *p = &g->params[i];
            const int64_t n = fs_shard_param_numel(p);
            if (!p->gathered || !n)
                continue;
            if ((s = e->data(e->ctx, p->shard, &src)) != FS_OK ||
                (s = fs_link_cast(&g->core.link, g->core.link.stream,
                                  (char *)full + p->full_offset * es,
                                  g->compute, src, p->shard_t, n)) != FS_OK)
                return fs_group_fail(&g->core, s, "unshard", 0, s == FS_OK ? NULL : "cast: %s",
                                     g->core.link.comm->last_error);
            fs_shard_count_copy(g, FS_SHARD_COPY_OUT, g->compute, p->shard_t, n);
        }
    }
    g->core.n_all_gather++; /* the gather torch issues (and counts) at one rank too */
    g->core.unsharded = 1;
    return FS_OK;
}

/* [Note: direct layout]: the shard is the all-gather input (cast into this
 * rank's rows of the unsharded buffer first in another compute dtype), the
 * unsharded buffer its output. */
static fs_status gather_input(fs_shard_group *g, const void **send, void **recv)
{
    const fs_env *e = &g->core.env;
    const size_t es = fs_dtype_size(g->compute);
    const fs_dtype st = g->params[0].shard_t;
    void *full, *src;
    fs_status s;
    if ((s = e->data(e->ctx, g->params[0].shard, &src)) != FS_OK ||
        (s = e->data(e->ctx, g->full, &full)) != FS_OK)
        return fs_group_fail(&g->core, s, "unshard", 0, NULL);
    *send = src;
    *recv = full;
    if (st == g->compute || !g->gather_block_numel)
        return FS_OK;
    char *mine = (char *)full + (size_t)g->core.link.comm->rank * g->gather_block_numel * es;
    if ((s = fs_link_cast(&g->core.link, g->core.link.stream, mine, g->compute, src, st,
                          g->gather_block_numel)) != FS_OK)
        return fs_group_fail(&g->core, s, "unshard", 0, "cast: %s", g->core.link.comm->last_error);
    fs_shard_count_copy(g, FS_SHARD_COPY_IN, g->compute, st, g->gather_block_numel);
    *send = mine;
    return FS_OK;
}

/* In place: each rank's rows are cast straight into its own block of the
 * gathered buffer, which is the all-gather's input. The padding at a
 * block's end is never copied out, so it is left as it comes. */
static fs_status stage_gather_input(fs_shard_group *g, int defer, const void **send,
                                    void **recv)
{
    const fs_env *e = &g->core.env;
    fs_link *l = &g->core.link;
    fs_comm *c = l->comm;
    const size_t es = fs_dtype_size(g->compute);
    fs_status s;
    if ((s = e->take(e->ctx, g->gather_block_numel * c->world_size * (int64_t)es,
                     defer ? 0 : FS_TAKE_TRANSIENT, &g->gathered, &g->gathered_h)) != FS_OK)
        return fs_group_fail(&g->core, s, "unshard", 0, "out of memory");
    char *mine = (char *)g->gathered + (size_t)c->rank * g->gather_block_numel * es;
    for (int i = 0; i < g->nparams; i++) {
        const fs_dim0_entry *en = &g->gentries[i];
        const fs_shard_param *p = &g->params[i];
        void *src;
        if (!p->gathered || !en->local_rows || !en->row_numel)
            continue;
        if ((s = e->data(e->ctx, p->shard, &src)) != FS_OK ||
            (s = fs_link_cast(l, l->stream, mine + en->block_offset * es, g->compute, src,
                              p->shard_t, en->local_rows * en->row_numel)) != FS_OK) {
            fs_group_drop(&g->core, &g->gathered_h);
            return fs_group_fail(&g->core, s, "unshard", 0, s == FS_OK ? NULL : "copy-in: %s",
                                 c->last_error);
        }
        fs_shard_count_copy(g, FS_SHARD_COPY_IN, g->compute, p->shard_t,
                            en->local_rows * en->row_numel);
    }
    *send = mine;
    *recv = g->gathered;
    return FS_OK;
}

fs_status fs_shard_unshard(fs_shard_group *g, int defer)
{
    const fs_env *e = &g->core.env;
    fs_link *l = &g->core.link;
    fs_comm *c = l->comm;
    const int world = c->world_size;
    const size_t es = fs_dtype_size(g->compute);
    defer = defer && l->dev;
    /* [Note: coalesced gathers]: the copy-out waits for the batch's flush */
    const int batched = l->batch && !l->dev;
    fs_status s;
    if (g->core.unsharded) /* a pending gather is waited for, unless this is a prefetch too */
        return defer ? FS_OK : fs_shard_wait(g);
    if ((s = fs_group_wait_steps(&g->core)) != FS_OK) /* [Note: step before gather] */
        return s;
    if (world == 1)
        return unshard_alone(g);
    void *none;
    if ((s = e->set_storage(e->ctx, g->storage, g->full_alloc * (int64_t)es, &none)) != FS_OK)
        return fs_group_fail(&g->core, s, "unshard", 0, NULL);
    const void *send = NULL;
    void *recv = NULL;
    if ((s = fs_shard_direct_layout(g) ? gather_input(g, &send, &recv)
                                       : stage_gather_input(g, defer, &send, &recv)) != FS_OK)
        return s;
    if (defer)
        l->dev->set_defer(c, 1);
    if (l->quant.weight_bits) /* [Note: quantized collectives]: lands now */
        s = fs_link_all_gather_quant(l, e, g->core.name, send, recv, g->gather_block_numel,
                                     g->compute);
    else
        s = fs_link_all_gather(l, g->core.name, send, recv, g->gather_block_numel, g->compute);
    if (defer)
        l->dev->set_defer(c, 0);
    if (s != FS_OK) {
        fs_group_drop(&g->core, &g->gathered_h);
        return fs_group_fail_comm(&g->core, s, "all-gather", 0, "all_gather: %s", c->last_error);
    }
    if ((defer || batched) && (s = fs_group_mark_gather(&g->core, defer)) != FS_OK) {
        fs_group_drop(&g->core, &g->gathered_h);
        return s;
    }
    g->core.n_all_gather++;
    g->core.unsharded = 1;
    if (defer || batched)
        return FS_OK;
    s = copy_out(g, l->stream);
    fs_group_drop(&g->core, &g->gathered_h);
    return s;
}

/* The shard group's side of fs_group_unshard_along (group.h); a group's core
 * is its first member. */
static fs_group_core *member(const void *along, int i)
{
    return &((fs_shard_group *const *)along)[i]->core;
}

static int parts(const fs_group_core *c)
{
    return 1; /* one all-gather, or none at one rank (which gathers all the same) */
}

static fs_status unshard(fs_group_core *c, int prefetch)
{
    return fs_shard_unshard((fs_shard_group *)c, prefetch);
}

static fs_status wait_gather(fs_group_core *c)
{
    return fs_shard_wait((fs_shard_group *)c);
}

/* A gather recorded in a batch that failed: nothing was gathered. */
static void abandon(fs_group_core *c)
{
    fs_shard_group *g = (fs_shard_group *)c;
    void *none;
    fs_group_drop_gather(&g->core);
    fs_group_drop(&g->core, &g->gathered_h);
    if (!g->keep_storage)
        g->core.env.set_storage(g->core.env.ctx, g->storage, 0, &none);
    g->core.unsharded = 0;
}

static const fs_gather_kind shard_kind = {member, parts, unshard, wait_gather, abandon};

fs_status fs_shard_unshard_along(fs_shard_group *g, int own, fs_shard_group *const *along,
                                 int n, int *failed)
{
    return fs_group_unshard_along(&shard_kind, &g->core, own, along, n, failed);
}

fs_status fs_shard_unshard_from(fs_shard_group *g, fs_link *post, void *chunk)
{
    const fs_env *e = &g->core.env;
    const size_t es = fs_dtype_size(g->compute);
    void *src, *dst, *none;
    int64_t count; /* the all-gather puts each rank's chunk back where it was cut */
    fs_status s = fs_layout_dim0_post_chunk(g->full_alloc, post->comm->world_size,
                                            post->comm->rank, NULL, &count);
    if (s != FS_OK)
        return fs_group_fail(&g->core, s, "unshard", 0,
                             "a group of %d does not divide the unsharded buffer",
                             post->comm->world_size);
    if ((s = fs_shard_wait(g)) != FS_OK)
        return s;
    if (g->core.unsharded)
        return FS_OK;
    if ((s = e->set_storage(e->ctx, g->storage, g->full_alloc * (int64_t)es, &none)) != FS_OK ||
        (s = e->data(e->ctx, chunk, &src)) != FS_OK || (s = e->data(e->ctx, g->full,
                                                                    &dst)) != FS_OK)
        return fs_group_fail(&g->core, s, "unshard", 0, NULL);
    FS_LINK_RUN(post, s, FS_LOP_ALL_GATHER, g->core.name, count, g->compute,
                fs_comm_all_gather(post->comm, src, dst, count, g->compute));
    if (s == FS_OK) /* [Note: bytes sent]: the group's, though over the host's smaller link */
        fs_link_count_sent(&g->core.link, FS_LOP_ALL_GATHER, count, g->compute);
    if (s != FS_OK)
        return fs_group_fail_comm(&g->core, s, "all-gather", 0, "all_gather after forward: %s",
                                  post->comm->last_error);
    g->core.n_post_gather++;
    g->core.unsharded = 1;
    return FS_OK;
}

/* After a pending gather was waited for: the copy-out, then the gathered
 * blocks given back (the caller's stream orders their reuse). */
static fs_status copied_out(void *ctx)
{
    fs_shard_group *g = ctx;
    fs_status s = copy_out(g, g->core.link.stream);
    fs_group_drop(&g->core, &g->gathered_h);
    return s;
}

fs_status fs_shard_wait(fs_shard_group *g)
{
    return fs_group_wait_gather(&g->core, copied_out, g);
}

fs_status fs_shard_reshard(fs_shard_group *g)
{
    fs_status s = fs_shard_wait(g); /* its buffers go back only after the stream waited */
    if (s != FS_OK || !g->core.unsharded)
        return s;
    void *none;
    if (!g->keep_storage && /* [Note: kept storage] */
        (s = g->core.env.set_storage(g->core.env.ctx, g->storage, 0, &none)) != FS_OK)
        return fs_group_fail(&g->core, s, "reshard", 0, NULL);
    g->core.unsharded = 0;
    return FS_OK;
}

fs_status fs_shard_set_keep_storage(fs_shard_group *g, int keep)
{
    void *none;
    fs_status s;
    g->keep_storage = keep != 0;
    if (keep || g->core.unsharded || g->core.gather_pending || !g->storage)
        return FS_OK;
    if ((s = g->core.env.set_storage(g->core.env.ctx, g->storage, 0, &none)) != FS_OK)
        return fs_group_fail(&g->core, s, "reshard", 0, NULL);
    return FS_OK;
}
