/* unit_reduce.c - a unit's gradient reductions: the unsharded gradient
 * averaged over the group into the shard gradient (reduce-scatter), or into
 * the whole gradient (all-reduce: NO_SHARD, SHARD_OPTIM), in the reduce
 * dtype, across replicas too under HYBRID_SHARD, deferred on a device
 * ([Note: deferred collectives] in unit.h), copied out to host memory under
 * parameter offload. */
#include <stdio.h>
#include <stdlib.h>

#include "reduce_rule.h"
#include "unit_internal.h"

/* a bucket part's owner (group.h), below */
static fs_status finish_part(fs_bucket_owner *o);
static void cancel_part(fs_bucket_owner *o);

int fs_unit_reducing(const fs_unit *u)
{
    return u->core.reduce_pending || u->host_pending;
}

fs_status fs_unit_finish_reduce(fs_unit *u)
{
    if (!fs_unit_reducing(u))
        return FS_OK;
    fs_comm *c = u->core.link.comm;
    fs_status s = FS_OK;
    if (u->core.reduce_pending &&
        (s = fs_group_wait_mark(&u->core, u->core.reduce_event, "reduce-scatter",
                                "a gradient reduction")) != FS_OK)
        return s;
    /* offload: the host (its optimizer) reads the gradients copied out */
    if (u->host_pending &&
        (s = u->core.link.dev->synchronize(u->core.link.stream, c->last_error,
                                           sizeof c->last_error)) != FS_OK)
        return fs_group_fail(&u->core, s, "reduce-scatter", 0,
                             "waiting for a gradient reduction: %s", c->last_error);
    u->core.reduce_pending = u->host_pending = 0;
    fs_held_release(&u->core.held, &u->core.env);
    return FS_OK;
}

/* Where an accumulating reduce-scatter lands: u->scratch, grown to nbytes.
 * A deferred reduction may still read the old scratch: it is held. */
static fs_status scratch(fs_unit *u, int64_t nbytes, int defer)
{
    if (nbytes <= u->scratch_bytes)
        return FS_OK;
    if (u->scratch_h) {
        if (defer) {
            if (fs_held_add(&u->core.held, u->scratch_h) < 0)
                return FS_ERR_NO_MEMORY;
        } else {
            u->core.env.release(u->core.env.ctx, u->scratch_h);
        }
        u->scratch_h = NULL;
        u->scratch = NULL;
        u->scratch_bytes = 0;
    }
    fs_status s = u->core.env.take(u->core.env.ctx, nbytes ? nbytes : 1, 0, &u->scratch,
                                   &u->scratch_h);
    if (s == FS_OK)
        u->scratch_bytes = nbytes;
    return s;
}

fs_status fs_unit_reduce(fs_unit *u, int gi, void *grad, void *out, int accumulate, int defer,
                         fs_reduce_bucket *bucket)
{
    if (gi < 0 || gi >= u->ngroups)
        return fs_group_fail(&u->core, FS_ERR_INVALID_ARG, "reduce-scatter", gi,
                             "unit '%s': no group %d", u->core.name, gi);
    const fs_env *e = &u->core.env;
    const fs_device_api *d = u->core.link.dev;
    defer = defer && d;
    fs_unit_group *g = &u->groups[gi];
    fs_comm *c = u->core.link.comm;
    const int whole = u->replicated || u->cfg.strategy == FS_SHARD_OPTIM; /* all-reduce */
    const char *what = whole ? "all-reduce" : "reduce-scatter";
    /* [Note: reduction buckets]: recorded; the steps after it wait for the
     * flush, so what they read is held until then (as on a device) */
    fs_unit_bucketed *pend = bucket && fs_unit_bucketable(u) ? &u->bucketed[gi] : NULL;
    if (pend && pend->pending)
        return fs_group_fail(&u->core, FS_ERR_INVALID_ARG, what, gi, "unit '%s': group %d's last "
                             "reduction still waits in a bucket: flush it first", u->core.name, gi);
    void *gp, *op;
    fs_status s;
    if ((s = e->data(e->ctx, grad, &gp)) != FS_OK || (s = e->data(e->ctx, out, &op)) != FS_OK)
        return fs_group_fail(&u->core, s, what, gi, NULL);
    void *pre = u->core.link.stream;                  /* before the collective */
    void *post = defer ? d->comm_stream(c) : pre; /* after it */
    /* the elements `out` gets: SHARD_OPTIM keeps the whole gradient */
    const int64_t out_numel = u->cfg.strategy == FS_SHARD_OPTIM ? g->padded_numel : g->shard_numel;
    /* offload: reduce into device memory, then copy to the host gradient */
    void *host_op = NULL, *dev_out_h = NULL;
    if (u->offload) {
        if (accumulate)
            return fs_group_fail(&u->core, FS_ERR_INVALID_ARG, what, gi,
                                 "unit '%s': with parameter offload, gradients are not "
                                 "accumulated across backward passes", u->core.name);
        host_op = op;
        if ((s = e->take(e->ctx, out_numel * (int64_t)fs_dtype_size(g->dtype), 0, &op,
                         &dev_out_h)) != FS_OK)
            return fs_group_fail(&u->core, s, what, gi, "out of device memory");
    }
    /* the mean over every rank holding a replica of this shard too, divided
     * before and after the sum as torch's FSDP1 divides ([Note: divide rule]) */
    fs_divide dv;
    if ((s = fs_divide_rule(FS_DIVIDE_FLAT, g->reduce, c->world_size,
                            u->core.replicate.comm ? u->core.replicate.comm->world_size : 1, 0.0, 0,
                            &dv)) != FS_OK)
        return fs_group_fail(&u->core, s, what, gi, "unit '%s': no divide rule for reduce dtype %s",
                             u->core.name, fs_dtype_name(g->reduce));
    void *red_in_h = NULL, *ws_h = NULL; /* per-reduction buffers */
    int recorded = 0; /* a failure the step that failed recorded itself */
    /* The gradient arrives in the compute dtype; the collective runs in the
     * reduce dtype: the cast, then the pre divide in the reduce dtype (one
     * pass where the cast is exact: the same dtype or a wider one)
     * ([Note: mixed precision]). */
    void *src = gp;
    if (g->reduce != g->compute || dv.pre != 1.0) {
        void *dst = gp;
        const int exact = g->reduce == g->compute ||
                          fs_dtype_size(g->reduce) > fs_dtype_size(g->compute);
        if (g->reduce != g->compute)
            s = e->take(e->ctx, g->padded_numel * (int64_t)fs_dtype_size(g->reduce),
                        pend ? FS_TAKE_STAGING : FS_TAKE_TRANSIENT, &dst, &red_in_h);
        if (s == FS_OK)
            s = fs_link_scale_accumulate(&u->core.link, pre, dst, g->reduce, gp, g->compute,
                                         g->padded_numel, exact ? 1.0 / dv.pre : 1.0, 0);
        if (s == FS_OK && !exact && dv.pre != 1.0)
            s = fs_link_scale_accumulate(&u->core.link, pre, dst, g->reduce, dst, g->reduce,
                                         g->padded_numel, 1.0 / dv.pre, 0);
        src = dst;
    }
    if (s == FS_OK && (!whole || c->world_size > 1))
        s = fs_link_lend(&u->core.env, &u->core.link, g->reduce, g->padded_numel, &ws_h);
    if (defer)
        d->set_defer(c, 1);
    if (s != FS_OK) {
    } else if (whole) { /* summed in the reduce dtype, in place */
        if (c->world_size > 1) /* one rank's sum is its own gradient */
            FS_LINK_RUN(&u->core.link, s, FS_LOP_ALL_REDUCE, u->core.name, g->padded_numel,
                        g->reduce,
                        fs_comm_all_reduce(c, src, g->padded_numel, g->reduce, FS_RED_SUM));
        if (s == FS_OK)
            s = fs_link_divide_out(&u->core.link, post, op, g->dtype, src, g->reduce, out_numel,
                                   1.0, dv.post, accumulate);
    } else {
        /* Where the reduce-scatter lands: the shard gradient itself when it
         * starts empty and keeps the dtype; else a buffer added into it. */
        void *land = op, *land_h = NULL;
        fs_dtype lt = g->dtype;
        if (g->reduce != g->dtype) {
            land = g->red_out;
            lt = g->reduce;
        } else if (accumulate && pend) { /* the unit's scratch may wait in the bucket already */
            s = e->take(e->ctx, g->shard_numel * (int64_t)fs_dtype_size(g->dtype),
                        FS_TAKE_STAGING, &land, &land_h);
        } else if (accumulate) {
            if ((s = scratch(u, g->shard_numel * (int64_t)fs_dtype_size(g->dtype), defer)) ==
                FS_OK)
                land = u->scratch;
        }
        if (s == FS_OK && pend) {
            u->core.link.bucket = bucket;
            s = fs_link_reduce_scatter(&u->core.link, u->core.name, src, land, g->shard_numel, lt,
                                       &pend->owner);
            u->core.link.bucket = NULL;
            if (s == FS_OK) {
                *pend = (fs_unit_bucketed){{&u->core, gi, finish_part, cancel_part}, 1,
                                           e->hold(e->ctx, out),
                                           red_in_h ? NULL : e->hold(e->ctx, grad), red_in_h,
                                           land, land_h, lt, dv.post, accumulate};
                red_in_h = land_h = NULL;
            }
            if (land_h)
                e->release(e->ctx, land_h);
            if (ws_h) /* none on the host */
                fs_link_unlend(&u->core.link);
            if (red_in_h)
                e->release(e->ctx, red_in_h);
            if (s != FS_OK)
                return fs_group_fail_comm(&u->core, s, what, gi, "gradient reduction: %s",
                                          c->last_error);
            u->core.n_reduce++;
            return FS_OK;
        }
        if (s == FS_OK && u->core.link.quant.grad_bits) /* [Note: quantized collectives] */
            s = fs_link_reduce_scatter_quant(&u->core.link, e, u->core.name, src, land,
                                             g->shard_numel, lt);
        else if (s == FS_OK)
            FS_LINK_RUN(&u->core.link, s, FS_LOP_REDUCE_SCATTER, u->core.name, g->shard_numel, lt,
                        fs_comm_reduce_scatter(c, src, land, g->shard_numel, lt, FS_RED_SUM));
        if (s == FS_OK && (s = fs_group_all_reduce_replicas(&u->core, gi, land, g->shard_numel,
                                                             lt, defer, &post)) != FS_OK)
            recorded = 1;
        if (s == FS_OK)
            s = fs_link_divide_out(&u->core.link, post, op, g->dtype, land, lt, g->shard_numel,
                                   1.0, dv.post, accumulate);
    }
    if (s == FS_OK && host_op) {
        s = d->copy(host_op, op, (size_t)out_numel * fs_dtype_size(g->dtype), post,
                    c->last_error, sizeof c->last_error);
        u->host_pending = 1; /* the host waits before reading it (fs_unit_finish_reduce) */
    }
    fs_status ws_s = fs_group_unlend(&u->core, &u->core.link, &ws_h, defer && s == FS_OK);
    if (s == FS_OK)
        s = ws_s;
    if (defer) {
        d->set_defer(c, 0);
        /* the mark goes on the stream the last of the work went to */
        fs_comm *last = u->core.replicate.comm && !whole ? u->core.replicate.comm : c;
        if (s == FS_OK)
            s = d->record(last, &u->core.reduce_event, c->last_error, sizeof c->last_error);
        if (s == FS_OK) { /* what the enqueued work reads and writes stays alive */
            u->core.reduce_pending = 1;
            u->core.n_deferred_reduce++;
            void *hg = e->hold(e->ctx, grad), *ho = e->hold(e->ctx, out);
            if (fs_held_add(&u->core.held, hg) < 0 || fs_held_add(&u->core.held, ho) < 0 ||
                fs_held_add(&u->core.held, red_in_h) < 0 || fs_held_add(&u->core.held,
                                                                        dev_out_h) < 0)
                s = FS_ERR_NO_MEMORY; /* not reached in practice; the handles leak */
            red_in_h = dev_out_h = NULL;
        }
    }
    if (red_in_h)
        e->release(e->ctx, red_in_h);
    if (dev_out_h)
        e->release(e->ctx, dev_out_h);
    if (s != FS_OK)
        return recorded ? s : fs_group_fail_comm(&u->core, s, what, gi, "gradient reduction: %s",
                                                 c->last_error);
    u->core.n_reduce++;
    return FS_OK;
}

/* ---------------------------------------------------------------------------
 * reductions in a host bucket ([Note: reduction buckets] in engine.h) */

int fs_unit_bucketable(const fs_unit *u)
{
    return !u->core.link.dev && !u->replicated && u->cfg.strategy != FS_SHARD_OPTIM &&
           !u->core.replicate.comm && !u->offload && !u->core.link.quant.grad_bits;
}

static void let_go(fs_unit *u, fs_unit_bucketed *p)
{
    const fs_env *e = &u->core.env;
    void *hs[4] = {p->out, p->grad, p->send_h, p->land_h};
    *p = (fs_unit_bucketed){0};
    for (int i = 0; i < 4; i++)
        if (hs[i])
            e->release(e->ctx, hs[i]);
}

/* The bucket's part owner's finish (group.h): `out` written from where the
 * flushed reduce-scatter landed, the handles let go. */
static fs_status finish_part(fs_bucket_owner *o)
{
    fs_unit *u = (fs_unit *)o->core; /* the core is the unit's first member */
    const int gi = o->group;
    fs_unit_bucketed *p = &u->bucketed[gi];
    if (!p->pending)
        return FS_OK;
    fs_unit_group *g = &u->groups[gi];
    void *op;
    fs_status s = u->core.env.data(u->core.env.ctx, p->out, &op);
    if (s == FS_OK)
        s = fs_link_divide_out(&u->core.link, u->core.link.stream, op, g->dtype, p->land,
                               p->land_t, g->shard_numel, 1.0, p->post, p->accumulate);
    let_go(u, p);
    if (s != FS_OK)
        return fs_group_fail(&u->core, s, "reduce-scatter", gi,
                             s == FS_ERR_HOST ? NULL : "gradient after a bucketed reduction: %s",
                             u->core.link.comm->last_error);
    return FS_OK;
}

static void cancel_part(fs_bucket_owner *o)
{
    fs_unit_cancel_bucketed((fs_unit *)o->core, o->group);
}

void fs_unit_cancel_bucketed(fs_unit *u, int gi)
{
    if (u->bucketed[gi].pending)
        let_go(u, &u->bucketed[gi]);
}
