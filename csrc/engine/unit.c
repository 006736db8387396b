/* unit.c - see unit.h: a unit's groups, its state machine, and the gathers
 * and frees that follow from it. Gradient reductions are in unit_reduce.c.
 * No Python: what the host must do comes through u->core.env (engine.h). */
#include "unit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "copy.h"
#include "unit_internal.h"

/* ---------------------------------------------------------------------------
 * memory */

static fs_status take(fs_unit *u, int64_t numel, fs_dtype t, void **data, void **handle)
{
    int64_t nbytes = numel * (int64_t)fs_dtype_size(t);
    return u->core.env.take(u->core.env.ctx, nbytes ? nbytes : 1, 0, data, handle);
}

/* ---------------------------------------------------------------------------
 * life */

fs_status fs_unit_init(fs_unit *u, const char *name, fs_env env, fs_link link,
                       fs_link replicate, fs_strategy strategy, uint64_t grad_mask,
                       const fs_unit_group *groups, int ngroups, int offload)
{
    memset(u, 0, sizeof *u);
    fs_group_core_init(&u->core, name, env, link, replicate);
    u->offload = offload;
    if (strategy != FS_FULL_SHARD && strategy != FS_SHARD_GRAD_OP &&
        strategy != FS_NO_SHARD && strategy != FS_SHARD_OPTIM)
        return fs_group_fail(&u->core, FS_ERR_INVALID_ARG, "construction", -1,
                             "strategy %d is not FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or "
                             "SHARD_OPTIM", (int)strategy);
    if (ngroups < 0 || ngroups > 64)
        return fs_group_fail(&u->core, FS_ERR_INVALID_ARG, "construction", -1,
                             "at most 64 groups, got %d", ngroups);
    if (!(u->groups = calloc(ngroups ? (size_t)ngroups : 1, sizeof *u->groups)))
        return fs_group_fail(&u->core, FS_ERR_NO_MEMORY, "construction", -1, "out of host memory");
    memcpy(u->groups, groups, (size_t)ngroups * sizeof *groups);
    u->ngroups = ngroups;
    if (!(u->bucketed = calloc(ngroups ? (size_t)ngroups : 1, sizeof *u->bucketed)))
        return fs_group_fail(&u->core, FS_ERR_NO_MEMORY, "construction", -1, "out of host memory");
    u->cfg.strategy = strategy;
    u->cfg.grad_mask = grad_mask;
    fs_unit_fsm_init(&u->fsm);
    /* NO_SHARD buffers are always whole; sharded ones start sharded. Under
     * mixed precision NO_SHARD's compute buffer (lp) is a cast of the whole
     * shard, made at forward and freed after backward like SHARD_GRAD_OP's
     * gather: the state machine runs as SHARD_GRAD_OP, the data movement
     * stays NO_SHARD's (a local cast; an all-reduce for gradients). */
    u->replicated = strategy == FS_NO_SHARD;
    u->core.unsharded = u->replicated;
    const int world = link.comm->world_size;
    for (int i = 0; i < ngroups; i++) {
        fs_unit_group *g = &u->groups[i];
        g->lp_shard = g->red_out = g->lp_shard_h = g->red_out_h = NULL;
        if ((g->compute != g->dtype) != (g->lp != NULL) || !fs_dtype_is_float(g->reduce))
            return fs_group_fail(&u->core, FS_ERR_INVALID_ARG, "construction", i,
                                 "a compute dtype other than the parameters' needs an lp buffer");
        if (fs_dtype_size(g->dtype) == 0 || g->shard_numel < 0 ||
            g->padded_numel != g->shard_numel * (u->replicated ? 1 : world))
            return fs_group_fail(&u->core, FS_ERR_INVALID_ARG, "construction", i,
                                 "inconsistent sizes/dtype");
        if (g->lp && u->replicated) { /* lp, not the full buffer, is what moves */
            u->cfg.strategy = FS_SHARD_GRAD_OP;
            u->core.unsharded = 0;
        }
        fs_status s = FS_OK;
        if (g->lp && !u->replicated)
            s = take(u, g->shard_numel, g->compute, &g->lp_shard, &g->lp_shard_h);
        if (s == FS_OK && g->reduce != g->dtype)
            s = take(u, g->shard_numel, g->reduce, &g->red_out, &g->red_out_h);
        if (s != FS_OK)
            return fs_group_fail(&u->core, s, "construction", i, "out of memory");
        /* One rank with full == shard has nothing to move: only NO_SHARD fits. */
        if (!u->replicated && world == 1 && !g->lp && !offload)
            return fs_group_fail(&u->core, FS_ERR_INVALID_ARG, "construction", i,
                                 "one rank has nothing to shard; use NO_SHARD");
    }
    u->full_unsharded = u->replicated || u->core.unsharded; /* NO_SHARD: full is the shard */
    return FS_OK;
}

void fs_unit_destroy(fs_unit *u)
{
    for (int i = 0; i < u->ngroups; i++) {
        fs_unit_group *g = &u->groups[i];
        fs_group_drop(&u->core, &g->lp_shard_h);
        fs_group_drop(&u->core, &g->red_out_h);
    }
    if (u->core.env.release)
        fs_group_drop(&u->core, &u->scratch_h);
    if (u->bucketed) {
        for (int i = 0; i < u->ngroups; i++)
            fs_unit_cancel_bucketed(u, i);
        free(u->bucketed);
        u->bucketed = NULL;
    }
    free(u->groups);
    u->groups = NULL;
    u->ngroups = 0;
    fs_group_core_destroy(&u->core);
}

fs_status fs_unit_set_quant(fs_unit *u, fs_comm_quant q)
{
    if (q.grad_bits && (u->replicated || u->cfg.strategy == FS_SHARD_OPTIM))
        return fs_group_fail(&u->core, FS_ERR_INVALID_ARG, "comm_quant", -1,
                             "unit '%s': quantized gradient reduction needs a reduce-scatter; "
                             "NO_SHARD and SHARD_OPTIM all-reduce whole gradients (set "
                             "grads=None for them)", u->core.name);
    return fs_group_set_quant(&u->core, q);
}

void fs_unit_set_root(fs_unit *u, int is_root)
{
    u->cfg.is_root = is_root != 0;
}

fs_status fs_unit_event(fs_unit *u, fs_event ev, unsigned flags, int group, unsigned *actions)
{
    fs_unit_state before = u->fsm.state;
    fs_status s = fs_unit_step(&u->cfg, &u->fsm, ev, flags, group, u->core.unsharded, actions);
    if (s != FS_OK)
        return fs_group_fail(&u->core, s, "state machine", group,
                             "unit '%s': event %s (group %d) in state %s", u->core.name,
                             fs_event_name(ev), group, fs_unit_state_name(before));
    return FS_OK;
}

fs_status fs_unit_dispatch(fs_unit *u, fs_event ev, const fs_unit_event_work *w,
                           unsigned *actions, int *failed)
{
    unsigned act = 0;
    fs_status s = FS_OK;
    *failed = -1;
    *actions = 0;
    if (ev == FS_EV_FINALIZE)
        s = fs_unit_finish_reduce(u);
    if (s == FS_OK)
        s = fs_unit_event(u, ev, w->flags, w->group, &act);
    if (s == FS_OK && (w->nalong || (w->coalesce && (act & FS_ACT_UNSHARD))))
        s = fs_unit_unshard_along(u, (act & FS_ACT_UNSHARD) != 0, w->along, w->nalong, failed);
    else if (s == FS_OK && (act & FS_ACT_UNSHARD))
        s = fs_unit_unshard(u, 0, 0);
    if (s == FS_OK && (ev == FS_EV_PRE_FORWARD || ev == FS_EV_PRE_BACKWARD))
        s = fs_unit_wait(u);
    if (s == FS_OK && (act & FS_ACT_REDUCE_GRAD) && w->grad && w->out)
        s = fs_unit_reduce(u, w->group, w->grad, w->out, w->accumulate, w->defer, w->bucket);
    if (s == FS_OK && (act & FS_ACT_RESHARD))
        s = fs_unit_reshard(u);
    *actions = act;
    return s;
}

/* ---------------------------------------------------------------------------
 * gathers */

fs_status fs_unit_wait(fs_unit *u)
{
    return fs_group_wait_gather(&u->core, NULL, NULL); /* the gathers landed in place */
}

/* [Note: quantized collectives]: whether a gather moves quantized payloads:
 * compute copies of a sharded unit, when the unit's setting asks for it.
 * Without mixed precision the compute copy is then no full-precision copy
 * (full_unsharded stays 0 after it), though both live in `full`. */
static int quantized(const fs_unit *u, int full_precision)
{
    return !full_precision && !u->replicated && u->core.link.quant.weight_bits;
}

/* Gather every group's shard into `full` (full_precision) or into its
 * compute buffer (lp under mixed precision, cast first; else full).
 * allocate: give the gathered buffers their storage first (0: it is live).
 * keep: a deferred gather, whose per-gather buffers are held until waited. */
static fs_status gather_groups(fs_unit *u, int full_precision, int allocate, int keep)
{
    const fs_env *e = &u->core.env;
    fs_comm *c = u->core.link.comm;
    fs_status ws = fs_group_wait_steps(&u->core); /* [Note: step before gather] */
    if (ws != FS_OK)
        return ws;
    for (int i = 0; i < u->ngroups; i++) {
        fs_unit_group *g = &u->groups[i];
        int use_lp = g->lp && !full_precision;
        fs_dtype t = use_lp ? g->compute : g->dtype;
        void *storage = use_lp ? g->lp_storage : g->storage;
        int64_t nbytes = g->padded_numel * (int64_t)fs_dtype_size(t);
        void *sp, *dp;
        fs_status s;
        if (u->replicated) { /* NO_SHARD: no collective, the whole shard is cast */
            if (!use_lp)
                continue; /* the full buffer is the shard */
            if ((allocate && (s = e->set_storage(e->ctx, storage, nbytes, &dp)) != FS_OK) ||
                (s = e->data(e->ctx, g->shard, &sp)) != FS_OK ||
                (s = e->data(e->ctx, g->lp, &dp)) != FS_OK)
                return fs_group_fail(&u->core, s, "unshard", i, NULL);
            if ((s = fs_link_cast(&u->core.link, u->core.link.stream, dp, g->compute, sp,
                                  g->dtype, g->padded_numel)) != FS_OK)
                return fs_group_fail(&u->core, s, "unshard", i, "cast: %s", c->last_error);
            continue;
        }
        if ((allocate && (s = e->set_storage(e->ctx, storage, nbytes, &dp)) != FS_OK) ||
            (s = e->data(e->ctx, g->shard, &sp)) != FS_OK ||
            (s = e->data(e->ctx, use_lp ? g->lp : g->full, &dp)) != FS_OK)
            return fs_group_fail(&u->core, s, "unshard", i, NULL);
        s = FS_OK;
        void *staged = NULL; /* released after the gather (held if it is deferred) */
        /* A deferred gather of host shards copies and casts on the backend's
         * stream, after the caller's work so far: beside the caller's compute. */
        void *on = u->core.link.stream;
        if (u->offload) { /* the host shard, staged on the device for this gather */
            const fs_device_api *d = u->core.link.dev;
            void *stage;
            if ((s = take(u, g->shard_numel, g->dtype, &stage, &staged)) != FS_OK)
                return fs_group_fail(&u->core, s, "unshard", i, "out of device memory");
            if (keep && fs_held_add(&u->core.gather_held, staged) < 0) {
                fs_group_drop(&u->core, &staged);
                return fs_group_fail(&u->core, FS_ERR_NO_MEMORY, "unshard", i,
                                     "out of host memory");
            }
            if (keep) {
                staged = NULL; /* the held list owns it now */
                if ((s = d->follow_caller(c, c->last_error, sizeof c->last_error)) == FS_OK)
                    on = d->comm_stream(c);
            }
            if (s == FS_OK)
                s = d->copy(stage, sp, (size_t)g->shard_numel * fs_dtype_size(g->dtype), on,
                            c->last_error, sizeof c->last_error);
            sp = stage;
        }
        if (s == FS_OK && use_lp) { /* one pass: the master shard, cast to the compute dtype */
            s = fs_link_cast(&u->core.link, on, g->lp_shard, g->compute, sp, g->dtype,
                             g->shard_numel);
            sp = g->lp_shard;
        }
        /* Not in place: the shard is its own buffer, so that resharding can
         * drop the whole unsharded storage. With a batch on the link, it
         * lands at the flush; a quantized one lands now ([Note: quantized
         * collectives]: compute copies only). */
        if (s == FS_OK && quantized(u, full_precision))
            s = fs_link_all_gather_quant(&u->core.link, e, u->core.name, sp, dp, g->shard_numel,
                                         t);
        else if (s == FS_OK)
            s = fs_link_all_gather(&u->core.link, u->core.name, sp, dp, g->shard_numel, t);
        /* Not held: the caller's stream waits for the gather, and the
         * allocator reuses the block in that stream's order. */
        fs_group_drop(&u->core, &staged);
        if (s != FS_OK)
            return fs_group_fail_comm(&u->core, s, "all-gather", i, "all_gather: %s",
                                      c->last_error);
        u->core.n_all_gather++;
    }
    return FS_OK;
}

/* gather_groups, deferred on a device (a prefetch) or recorded in a host
 * batch: then marked ([Note: gather mark]). */
static fs_status gather(fs_unit *u, int full_precision, int defer)
{
    const fs_device_api *d = u->core.link.dev;
    fs_comm *c = u->core.link.comm;
    defer = defer && d;
    if (defer)
        d->set_defer(c, 1);
    fs_status s = gather_groups(u, full_precision, 1, defer);
    if (defer)
        d->set_defer(c, 0);
    if (s == FS_OK && (defer || (u->core.link.batch && !d)))
        s = fs_group_mark_gather(&u->core, defer);
    return s;
}

static int is_mixed(const fs_unit *u)
{
    return u->ngroups > 0 && u->groups[0].lp != NULL;
}

fs_status fs_unit_unshard(fs_unit *u, int full_precision, int prefetch)
{
    int mixed = is_mixed(u);
    const int lossy = quantized(u, 0); /* compute copies are not full precision */
    int *live = full_precision && (mixed || lossy) ? &u->full_unsharded : &u->core.unsharded;
    fs_status s;
    if (!prefetch && (s = fs_unit_wait(u)) != FS_OK)
        return s;
    if (*live)
        return FS_OK;
    if (!mixed && lossy && full_precision) {
        /* one buffer holds both: gathered exactly, it serves compute too */
        if ((s = u->core.unsharded ? gather_groups(u, 1, 0, 0) : gather(u, 1, 0)) != FS_OK)
            return s;
        u->core.unsharded = u->full_unsharded = 1;
        return FS_OK;
    }
    if ((s = gather(u, full_precision, prefetch && !full_precision)) != FS_OK)
        return s;
    *live = 1;
    if (!mixed && !lossy)
        u->full_unsharded = 1;
    return FS_OK;
}

/* The unit's side of fs_group_unshard_along (group.h); a unit's core is
 * its first member. */
static fs_group_core *member(const void *along, int i)
{
    return &((fs_unit *const *)along)[i]->core;
}

static int parts(const fs_group_core *c)
{
    const fs_unit *u = (const fs_unit *)c;
    return u->replicated ? 0 : u->ngroups; /* NO_SHARD: a local cast at most */
}

static fs_status unshard_compute(fs_group_core *c, int prefetch)
{
    return fs_unit_unshard((fs_unit *)c, 0, prefetch);
}

static fs_status wait_gather(fs_group_core *c)
{
    return fs_unit_wait((fs_unit *)c);
}

/* A gather recorded in a batch that failed: nothing was gathered, and the
 * compute buffers' storages give their bytes back. */
static void abandon(fs_group_core *c)
{
    fs_unit *u = (fs_unit *)c;
    for (int k = 0; k < u->ngroups; k++) {
        const fs_unit_group *g = &u->groups[k];
        void *storage = g->lp ? g->lp_storage : u->replicated ? NULL : g->storage, *none;
        if (storage)
            u->core.env.set_storage(u->core.env.ctx, storage, 0, &none);
    }
    fs_group_drop_gather(&u->core);
    u->core.unsharded = 0;
    if (!is_mixed(u))
        u->full_unsharded = u->replicated;
}

static const fs_gather_kind unit_kind = {member, parts, unshard_compute, wait_gather, abandon};

fs_status fs_unit_unshard_along(fs_unit *u, int own, fs_unit *const *along, int n,
                                int *failed)
{
    return fs_group_unshard_along(&unit_kind, &u->core, own, along, n, failed);
}

fs_status fs_unit_regather(fs_unit *u)
{
    if (u->cfg.strategy == FS_NO_SHARD) /* the full buffer is the shard itself */
        return FS_OK;
    fs_status s;
    if ((s = fs_unit_wait(u)) != FS_OK)
        return s;
    int mixed = is_mixed(u);
    if (mixed && u->full_unsharded && !u->replicated) {
        for (int i = 0; i < u->ngroups; i++) {
            void *none;
            if ((s = u->core.env.set_storage(u->core.env.ctx, u->groups[i].storage, 0,
                                             &none)) != FS_OK)
                return fs_group_fail(&u->core, s, "regather", i, NULL);
        }
        u->full_unsharded = 0;
    }
    if ((s = gather_groups(u, 0, !u->core.unsharded, 0)) != FS_OK)
        return s;
    u->core.unsharded = 1;
    if (!mixed)
        u->full_unsharded = !quantized(u, 0);
    return FS_OK;
}

fs_status fs_unit_reshard(fs_unit *u)
{
    if ((!u->core.unsharded && !u->full_unsharded) || u->cfg.strategy == FS_NO_SHARD ||
        u->cfg.strategy == FS_SHARD_OPTIM)
        return FS_OK;
    fs_status s;
    if ((s = fs_unit_wait(u)) != FS_OK)
        return s;
    for (int i = 0; i < u->ngroups; i++) {
        fs_unit_group *g = &u->groups[i];
        void *none;
        if ((!u->replicated &&
             (s = u->core.env.set_storage(u->core.env.ctx, g->storage, 0, &none)) != FS_OK) ||
            (g->lp && (s = u->core.env.set_storage(u->core.env.ctx, g->lp_storage, 0,
                                                   &none)) != FS_OK))
            return fs_group_fail(&u->core, s, "reshard", i, NULL);
    }
    u->core.unsharded = 0;
    u->full_unsharded = u->replicated; /* NO_SHARD's full buffer is the shard: kept */
    return FS_OK;
}

int64_t fs_unit_gathered_bytes(const fs_unit *u)
{
    int64_t n = 0;
    for (int i = 0; i < u->ngroups; i++)
        n += u->groups[i].padded_numel * (int64_t)fs_dtype_size(u->groups[i].compute);
    return n;
}
