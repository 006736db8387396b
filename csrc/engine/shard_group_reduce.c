/* shard_group_reduce.c - see shard_group.h: a fully_shard group's gradient reductions:
 * the reduce-scatter (staged, or straight from the gradient [Note: direct
 * layout]), the one-rank reduction in place, the replicas' all-reduce and the
 * HSDP partial sum, the divides of the rule (core/reduce_rule.h), deferral and
 * the reduction bucket. No Python. */
#include "shard_group_internal.h"

#include <stdlib.h>
#include <string.h>

/* a bucket part's owner (group.h), below */
static fs_status finish_part(fs_bucket_owner *o);
static void cancel_part(fs_bucket_owner *o);

/* ---------------------------------------------------------------------------
 * reduce */

/* A reduction without the replicas' all-reduce writes nothing. */
static int writes(const fs_shard_group *g)
{
    return !g->core.replicate.comm || g->all_reduce;
}

/* After the reduce-scatter [Note: reduce output]: across replicas (with the
 * partial sum), or into the partial sum; then a held output's divide. */
static fs_status collect(fs_shard_group *g)
{
    fs_link *l = &g->core.link;
    fs_status s = FS_OK;
    const size_t rs = fs_dtype_size(g->reduce);
    if (!writes(g)) {
        /* kept past the call: the next reductions add to it */
        const int add = g->partial_h != NULL;
        if (!add && (s = g->core.env.take(g->core.env.ctx, g->block_numel * (int64_t)rs, 0,
                                          &g->partial,
                                          &g->partial_h)) != FS_OK)
            return fs_group_fail(&g->core, s, "reduce-scatter", 0, "partial sum: out of memory");
        if ((s = fs_link_scale_accumulate(l, l->stream, g->partial, g->reduce, g->rs_out,
                                          g->reduce, g->block_numel, 1.0, add)) != FS_OK)
            return fs_group_fail(&g->core, s, "reduce-scatter", 0, "partial sum: %s",
                                 l->comm->last_error);
        return FS_OK;
    }
    if (g->partial_h) {
        s = fs_link_scale_accumulate(l, l->stream, g->rs_out, g->reduce, g->partial, g->reduce,
                                     g->block_numel, 1.0, 1);
        fs_group_drop(&g->core, &g->partial_h); /* the stream orders its reuse */
        if (s != FS_OK)
            return fs_group_fail(&g->core, s, "all-reduce", 0, "partial sum: %s",
                                 l->comm->last_error);
    }
    /* after the reduce-scatter on the caller's stream (a deferred one was
     * waited for first) */
    if ((s = fs_group_all_reduce_replicas(&g->core, 0, g->rs_out, g->block_numel, g->reduce, 0,
                                          NULL)) != FS_OK)
        return s;
    /* a hook reads what torch's reads: the collective's own divide done */
    if (g->held && g->divide.in_comm != 1.0 &&
        (s = fs_link_scale_accumulate(l, l->stream, g->rs_out, g->reduce, g->rs_out, g->reduce,
                                      g->block_numel, 1.0 / g->divide.in_comm, 0)) != FS_OK)
        return fs_group_fail(&g->core, s, "reduce-scatter", 0, "divide: %s", l->comm->last_error);
    return FS_OK;
}

/* What the reduce output was not divided by yet, then each sharded
 * gradient (fs_link_divide_out). The post divide is fused into the writes
 * only where it can be for every one of them; else it runs once, in place,
 * over the whole output. The collective's own divide stays fused, as the
 * collective would round it. */
static fs_status write_grads(fs_shard_group *g)
{
    fs_link *l = &g->core.link;
    fs_comm *c = l->comm;
    fs_status s = FS_OK;
    const int rank = c->rank;
    const size_t n = g->nparams > 0 ? (size_t)g->nparams : 1;
    if (!writes(g))
        return FS_OK;
    const double scale = g->held ? 1.0 : 1.0 / g->divide.in_comm;
    double post = g->divide.post;
    int fuses = 1;
    for (int i = 0; i < g->nparams; i++)
        fuses &= !g->outs[i] || fs_divide_fuses(g->out_t[i], g->reduce, g->accumulate[i]);
    if (post != 1.0 && !fuses) {
        if ((s = fs_link_scale_accumulate(l, l->stream, g->rs_out, g->reduce, g->rs_out,
                                          g->reduce, g->block_numel, 1.0 / post, 0)) != FS_OK)
            return fs_group_fail(&g->core, s, "reduce-scatter", 0, "divide: %s", c->last_error);
        post = 1.0;
    }
    const size_t rs = fs_dtype_size(g->reduce);
    for (int i = 0; i < g->nparams && s == FS_OK; i++) {
        const fs_dim0_entry *e = &g->entries[(size_t)rank * n + i];
        void *dst;
        if (!g->outs[i] || !e->local_rows || !e->row_numel)
            continue;
        if ((s = g->core.env.data(g->core.env.ctx, g->outs[i], &dst)) != FS_OK)
            return fs_group_fail(&g->core, s, "reduce-scatter", 0, NULL);
        /* dst == src: reduced in place [Note: direct layout] */
        char *src = (char *)g->rs_out + e->block_offset * rs;
        s = fs_link_divide_out(l, l->stream, dst, g->out_t[i], src, g->reduce,
                               e->local_rows * e->row_numel, scale, post, g->accumulate[i]);
        if (s != FS_OK)
            return fs_group_fail(&g->core, s, "reduce-scatter", 0, "gradient: %s", c->last_error);
        if (!g->accumulate[i] && dst != src)
            fs_shard_count_copy(g, FS_SHARD_REDUCE_OUT, g->out_t[i], g->reduce,
                                e->local_rows * e->row_numel);
    }
    return s;
}

static void release_reduction(fs_shard_group *g)
{
    fs_group_drop(&g->core, &g->rs_in_h);
    fs_group_drop(&g->core, &g->rs_out_h);
    for (int i = 0; i < g->nparams; i++)
        fs_group_drop(&g->core, &g->outs[i]);
    g->core.reduce_pending = g->reduce_deferred = 0;
}

/* One rank in the shard group [Note: direct layout]: each gradient summed
 * across the replicas in place (HSDP: one all-reduce each, in parameter
 * order on every rank), then scaled into its sharded gradient, in place when
 * that is the gradient itself. A gradient of another dtype than the reduce
 * dtype is cast first: into a new output of the reduce dtype, else into a
 * buffer of its own (as for a trainable parameter without a gradient:
 * zeros). */
static fs_status reduce_alone(fs_shard_group *g, void *const *grads, const fs_dtype *grad_t,
                              void *const *outs, const fs_dtype *out_t, const int *accumulate)
{
    const fs_env *e = &g->core.env;
    fs_link *l = &g->core.link;
    const size_t rs = fs_dtype_size(g->reduce);
    const fs_divide *d = &g->divide; /* [Note: divide rule]: pre, then the sum, then the rest */
    fs_status s = FS_OK;
    const char *why = NULL; /* the failed step's name, for the record */
    for (int i = 0; i < g->nparams && s == FS_OK; i++) {
        const int64_t numel = fs_shard_param_numel(&g->params[i]);
        void *src = NULL, *dst = NULL, *buf, *tmp_h = NULL;
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
            fs_shard_count_copy(g, FS_SHARD_REDUCE_IN, g->reduce, grad_t[i], numel);
            buf = dst;
        } else {
            if ((s = e->take(e->ctx, numel * (int64_t)rs, FS_TAKE_ZERO | FS_TAKE_TRANSIENT,
                             &buf, &tmp_h)) != FS_OK) {
                why = "out of memory";
                break;
            }
            if (src && (s = fs_link_cast(l, l->stream, buf, g->reduce, src, grad_t[i],
                                         numel)) != FS_OK)
                why = "copy-in";
            else if (src)
                fs_shard_count_copy(g, FS_SHARD_REDUCE_IN, g->reduce, grad_t[i], numel);
        }
        if (s == FS_OK && d->pre != 1.0 &&
            (s = fs_link_scale_accumulate(l, l->stream, buf, g->reduce, buf, g->reduce, numel,
                                          1.0 / d->pre, 0)) != FS_OK)
            why = "divide";
        if (s == FS_OK && (s = fs_group_all_reduce_replicas(&g->core, 0, buf, numel, g->reduce, 0,
                                                            NULL)) != FS_OK) {
            fs_group_drop(&g->core, &tmp_h);
            return s; /* recorded */
        }
        if (s == FS_OK && dst) {
            if ((s = fs_link_divide_out(l, l->stream, dst, out_t[i], buf, g->reduce, numel,
                                        1.0 / d->in_comm, d->post, accumulate[i])) != FS_OK)
                why = "gradient";
            else if (!accumulate[i] && dst != buf)
                fs_shard_count_copy(g, FS_SHARD_REDUCE_OUT, out_t[i], g->reduce, numel);
        }
        fs_group_drop(&g->core, &tmp_h);
    }
    if (s != FS_OK)
        return fs_group_fail(&g->core, s, "reduce-scatter", 0, why ? "%s: %s" : NULL, why,
                             l->comm->last_error);
    g->core.n_reduce++; /* the reduction torch issues (and counts) at one rank too */
    return FS_OK;
}

/* fs_shard_reduce but for its FS_SHARD_RESHARD */
static fs_status reduce(fs_shard_group *g, void *const *grads, const fs_dtype *grad_t,
                        void *const *outs, const fs_dtype *out_t, const int *accumulate,
                        double factor, unsigned flags, fs_reduce_bucket *bucket)
{
    const fs_env *e = &g->core.env;
    fs_link *l = &g->core.link;
    fs_comm *c = l->comm;
    const int world = c->world_size;
    const size_t n = g->nparams > 0 ? (size_t)g->nparams : 1, rs = fs_dtype_size(g->reduce);
    const int defer = (flags & FS_SHARD_DEFER) && l->dev;
    /* [Note: reduction buckets]: kept like a deferred one until the flush;
     * a quantized reduction ([Note: quantized collectives]) is issued now */
    const int bucketed = bucket && !l->dev && !l->quant.grad_bits;
    fs_status s;
    if (g->core.reduce_pending && (s = fs_shard_finish_reduce(g)) != FS_OK)
        return s;
    g->all_reduce = !(flags & FS_SHARD_NO_ALL_REDUCE);
    g->held = writes(g) && (flags & FS_SHARD_HOLD);
    if ((s = fs_divide_rule(FS_DIVIDE_FULLY_SHARD, g->reduce, world,
                            g->core.replicate.comm ? g->core.replicate.comm->world_size : 1, factor,
                            (flags & FS_SHARD_FORCE_SUM) != 0, &g->divide)) != FS_OK)
        return fs_group_fail(&g->core, s, "reduce-scatter", 0,
                             "group '%s': the gradient divide factor must be > 0 and "
                             "finite, got %g", g->core.name, factor);
    if (bucketed && (!writes(g) || g->held))
        return fs_group_fail(&g->core, FS_ERR_INVALID_ARG, "reduce-scatter", 0,
                             "a reduction into the HSDP partial sum, or held for a hook, "
                             "cannot wait in a bucket");
    /* (a partial sum kept from reductions without the all-reduce is added
     * to the reduce output first: the staged path) */
    if (world == 1 && writes(g) && !g->held && !bucketed && !g->partial_h)
        return reduce_alone(g, grads, grad_t, outs, out_t, accumulate);
    /* [Note: direct layout]: the gradient is the reduce-scatter input, a new
     * sharded gradient of the reduce dtype its output (held like taken
     * buffers while a deferred collective reads them) */
    const int direct = fs_shard_direct_layout(g) && !bucketed && writes(g) && !g->held;
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
        return fs_group_fail(&g->core, s, "reduce-scatter", 0,
                             s == FS_ERR_HOST ? NULL : "out of memory");
    }
    for (int i = 0; i < g->nparams; i++) {
        void *src;
        if (!grads[i] || direct_in)
            continue;
        if ((s = e->data(e->ctx, grads[i], &src)) != FS_OK) {
            release_reduction(g);
            return fs_group_fail(&g->core, s, "reduce-scatter", 0, NULL);
        }
        size_t gs = fs_dtype_size(grad_t[i]);
        const fs_shard_param *p = &g->params[i];
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
                return fs_group_fail(&g->core, s, "reduce-scatter", 0, "copy-in: %s",
                                     c->last_error);
            }
            fs_shard_count_copy(g, FS_SHARD_REDUCE_IN, g->reduce, grad_t[i], run * p->outer);
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
        return fs_group_fail(&g->core, s, "reduce-scatter", 0, "divide: %s", c->last_error);
    }
    void *ws;
    if ((s = fs_link_lend(e, l, g->reduce, g->block_numel * world, &ws)) != FS_OK) {
        release_reduction(g);
        return fs_group_fail(&g->core, s, "reduce-scatter", 0, "out of memory");
    }
    if (defer)
        l->dev->set_defer(c, 1);
    g->bucket_owner = (fs_bucket_owner){&g->core, 0, finish_part, cancel_part};
    l->bucket = bucketed ? bucket : NULL;
    if (l->quant.grad_bits)
        s = fs_link_reduce_scatter_quant(l, e, g->core.name, rs_in, g->rs_out, g->block_numel,
                                         g->reduce);
    else
        s = fs_link_reduce_scatter(l, g->core.name, rs_in, g->rs_out, g->block_numel, g->reduce,
                                   &g->bucket_owner);
    l->bucket = NULL;
    if (defer) {
        l->dev->set_defer(c, 0);
        if (s == FS_OK)
            s = l->dev->record(c, &g->core.reduce_event, c->last_error, sizeof c->last_error);
    }
    if (ws) /* a deferred collective reads it until waited for (g->ws_h) */
        fs_link_unlend(l);
    if (s != FS_OK) {
        fs_group_drop(&g->core, &ws);
        release_reduction(g);
        return fs_group_fail_comm(&g->core, s, "reduce-scatter", 0, "reduce_scatter: %s",
                                  c->last_error);
    }
    g->core.n_reduce++;
    g->core.reduce_pending = 1;
    if (bucketed) { /* the host flushes, then finishes (ws: none on the host) */
        g->reduce_deferred = g->in_bucket = 1;
        return FS_OK;
    }
    if (defer) {
        g->ws_h = ws;
        g->reduce_deferred = 1;
        g->core.n_deferred_reduce++;
        return FS_OK;
    }
    fs_group_drop(&g->core, &ws);
    fs_group_drop(&g->core, &g->rs_in_h);
    s = collect(g);
    if (s == FS_OK && g->held)
        return FS_OK; /* held: fs_shard_finish_reduce writes */
    if (s == FS_OK)
        s = write_grads(g);
    release_reduction(g);
    return s;
}

fs_status fs_shard_reduce(fs_shard_group *g, void *const *grads, const fs_dtype *grad_t,
                          void *const *outs, const fs_dtype *out_t, const int *accumulate,
                          double factor, unsigned flags, fs_reduce_bucket *bucket)
{
    fs_status s = reduce(g, grads, grad_t, outs, out_t, accumulate, factor, flags, bucket);
    if (s == FS_OK && (flags & FS_SHARD_RESHARD))
        s = fs_shard_reshard(g);
    return s;
}

fs_status fs_shard_wait_reduce(fs_shard_group *g)
{
    if (!g->reduce_deferred)
        return FS_OK;
    if (g->in_bucket)
        return fs_group_fail(&g->core, FS_ERR_INVALID_ARG, "reduce-scatter", 0,
                             "its reduce-scatter still waits in a bucket: flush the "
                             "bucket first");
    g->reduce_deferred = 0;
    fs_status s = fs_group_wait_mark(&g->core, g->core.reduce_event, "reduce-scatter",
                                     "a gradient reduction");
    fs_group_drop(&g->core, &g->ws_h);
    fs_group_drop(&g->core, &g->rs_in_h); /* the stream waited for the collective that read it */
    if (s == FS_OK)
        s = collect(g);
    if (s != FS_OK)
        release_reduction(g);
    return s;
}

fs_status fs_shard_finish_reduce(fs_shard_group *g)
{
    if (!g->core.reduce_pending)
        return FS_OK;
    fs_status s = fs_shard_wait_reduce(g);
    if (s != FS_OK)
        return s;
    s = write_grads(g);
    release_reduction(g);
    return s;
}

void *fs_shard_reduce_output(const fs_shard_group *g, int64_t *nbytes, void **owner)
{
    if (!g->core.reduce_pending || g->reduce_deferred || !g->rs_out_h)
        return NULL;
    *nbytes = g->block_numel * (int64_t)fs_dtype_size(g->reduce);
    *owner = g->rs_out_h;
    return g->rs_out;
}

/* The bucket part's owner (group.h): g's reduction finished after the flush,
 * or given up (its buffers back, nothing written). */
static fs_status finish_part(fs_bucket_owner *o)
{
    fs_shard_group *g = (fs_shard_group *)o->core; /* the core is the group's first member */
    g->in_bucket = 0;
    return fs_shard_finish_reduce(g);
}

static void cancel_part(fs_bucket_owner *o)
{
    fs_shard_group *g = (fs_shard_group *)o->core;
    g->in_bucket = 0;
    if (g->core.reduce_pending && !g->core.link.dev)
        release_reduction(g);
}

int fs_shard_has_partial(const fs_shard_group *g)
{
    return g->partial_h != NULL;
}

void fs_shard_drop_partial(fs_shard_group *g)
{
    fs_group_drop(&g->core, &g->partial_h);
    g->partial = NULL;
}

/* ---------------------------------------------------------------------------
 * accumulation without sync */

fs_status fs_shard_accumulate(fs_shard_group *g, void *src, fs_dtype src_t, void *dst,
                             fs_dtype dst_t, int64_t n, int add)
{
    const fs_env *e = &g->core.env;
    void *s_ptr, *d_ptr;
    fs_status s;
    if ((s = e->data(e->ctx, src, &s_ptr)) != FS_OK || (s = e->data(e->ctx, dst, &d_ptr)) != FS_OK)
        return fs_group_fail(&g->core, s, "accumulate", 0, NULL);
    if ((s = fs_link_scale_accumulate(&g->core.link, g->core.link.stream, d_ptr, dst_t, s_ptr,
                                      src_t, n, 1.0, add)) != FS_OK)
        return fs_group_fail(&g->core, s, "accumulate", 0, "%s", g->core.link.comm->last_error);
    if (!add && src_t != dst_t) /* the first of the sums [Note: accumulation dtype] */
        fs_shard_count_copy(g, FS_SHARD_CAST, dst_t, src_t, n);
    return FS_OK;
}
