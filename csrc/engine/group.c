/* group.c - see group.h. */
#include "group.h"

#include <stdio.h>
#include <string.h>

void fs_group_core_init(fs_group_core *c, const char *name, fs_env env, fs_link link,
                        fs_link replicate)
{
    memset(c, 0, sizeof *c);
    snprintf(c->name, sizeof c->name, "%s", name);
    c->env = env;
    c->link = link;
    c->replicate = replicate;
}

fs_status fs_group_wait_steps(fs_group_core *c)
{
    if (!c->gate)
        return FS_OK;
    fs_status s = c->gate->wait(c->gate->ctx, c->gate_slot, c->link.unlock, c->link.lock);
    if (s != FS_OK)
        return fs_group_fail(c, s, "unshard", 0, "waiting for the offloaded optimizer step: %s",
                             c->gate->error(c->gate->ctx));
    return FS_OK;
}

void fs_group_core_destroy(fs_group_core *c)
{
    fs_held_free(&c->held, &c->env);
    fs_held_free(&c->gather_held, &c->env);
    const fs_device_api *d = c->link.dev;
    if (d && c->gather_event)
        d->event_free(c->gather_event);
    if (d && c->reduce_event)
        d->event_free(c->reduce_event);
    if (d && c->scatter_event)
        d->event_free(c->scatter_event);
    c->gather_event = c->reduce_event = c->scatter_event = NULL;
}

void fs_group_rename(fs_group_core *c, const char *name)
{
    snprintf(c->name, sizeof c->name, "%s", name);
}

fs_status fs_group_set_quant(fs_group_core *c, fs_comm_quant q)
{
    char err[200];
    if (!fs_comm_quant_check(&q, err, sizeof err))
        return fs_group_fail(c, FS_ERR_INVALID_ARG, "comm_quant", -1, "'%s': %s", c->name, err);
    if ((q.weight_bits || q.grad_bits) && c->link.dev)
        return fs_group_fail(c, FS_ERR_UNSUPPORTED, "comm_quant", -1,
                             "'%s': quantized collectives run on host links (shm, a torch "
                             "process group over CPU tensors); this group's link is on a "
                             "device (%s)", c->name, c->link.dev->name);
    if (q.grad_bits && !c->link.comm->ops->all_to_all)
        return fs_group_fail(c, FS_ERR_UNSUPPORTED, "comm_quant", -1,
                             "'%s': quantized gradients need an all-to-all, which the %s "
                             "backend lacks", c->name, c->link.comm->ops->name);
    c->link.quant = q;
    return FS_OK;
}

void fs_group_sent_bytes(const fs_group_core *c, unsigned long long *gather,
                         unsigned long long *reduce)
{
    *gather = c->link.sent_gather_bytes + c->replicate.sent_gather_bytes;
    *reduce = c->link.sent_reduce_bytes + c->replicate.sent_reduce_bytes;
}

void fs_group_set_streams(fs_group_core *c, void *stream, void *replicate_stream)
{
    c->link.stream = stream;
    c->replicate.stream = replicate_stream;
}

fs_status fs_group_fail(fs_group_core *c, fs_status s, const char *what, int group,
                        const char *fmt, ...)
{
    c->err_what = what;
    c->err_group = group;
    c->err_collective = 0;
    c->err[0] = '\0';
    if (s != FS_ERR_HOST && fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, sizeof c->err, fmt, ap);
        va_end(ap);
    }
    return s;
}

fs_status fs_group_collective(fs_group_core *c, fs_status s)
{
    c->err_collective = 1;
    return s;
}

void fs_group_drop(fs_group_core *c, void **handle)
{
    if (*handle)
        c->env.release(c->env.ctx, *handle);
    *handle = NULL;
}

fs_status fs_group_unlend(fs_group_core *c, fs_link *l, void **h, int defer)
{
    if (!*h)
        return FS_OK;
    fs_link_unlend(l);
    if (defer) {
        if (fs_held_add(&c->held, *h) < 0)
            return FS_ERR_NO_MEMORY;
        *h = NULL;
        return FS_OK;
    }
    fs_group_drop(c, h);
    return FS_OK;
}

fs_status fs_group_wait_mark(fs_group_core *c, void *event, const char *what,
                             const char *waiting_for)
{
    const fs_link *l = &c->link;
    if (!l->dev)
        return FS_OK;
    fs_comm *cm = l->comm;
    fs_status s = l->dev->wait(event, l->stream, cm->last_error, sizeof cm->last_error);
    if (s != FS_OK)
        return fs_group_fail(c, s, what, 0, "waiting for %s: %s", waiting_for, cm->last_error);
    return FS_OK;
}

/* ---------------------------------------------------------------------------
 * gathers ([Note: gather mark]) */

fs_status fs_group_mark_gather(fs_group_core *c, int defer)
{
    if (defer) {
        fs_comm *cm = c->link.comm;
        fs_status s = c->link.dev->record(cm, &c->gather_event, cm->last_error,
                                          sizeof cm->last_error);
        if (s != FS_OK)
            return fs_group_fail(c, s, "unshard", 0, "marking a prefetched all-gather: %s",
                                 cm->last_error);
        c->n_deferred_gather++;
    }
    c->gather_pending = 1;
    return FS_OK;
}

fs_status fs_group_wait_gather(fs_group_core *c, fs_status (*then)(void *ctx), void *ctx)
{
    if (!c->gather_pending)
        return FS_OK;
    fs_status s = fs_group_wait_mark(c, c->gather_event, "unshard", "a prefetched all-gather");
    if (s != FS_OK)
        return s;
    c->gather_pending = 0;
    if (then)
        s = then(ctx);
    /* the caller's stream orders the reuse of what the gather held */
    fs_held_release(&c->gather_held, &c->env);
    return s;
}

void fs_group_drop_gather(fs_group_core *c)
{
    c->gather_pending = 0;
    fs_held_release(&c->gather_held, &c->env);
}

fs_status fs_group_unshard_along(const fs_gather_kind *k, fs_group_core *own_core, int own,
                                 const void *along, int n, int *failed)
{
    /* [Note: coalesced gathers]: parts of n members recorded, flushed once */
    fs_gather_batch batch;
    batch.nparts = 0;
    batch.nbytes = 0;
    /* who joined, in order (the caller's own first): each member adds a part
     * at least */
    fs_group_core *joined[FS_BATCH_MAX_PARTS + 1];
    int index[FS_BATCH_MAX_PARTS + 1], njoined = 0;
    int parts = k->parts(own_core);
    fs_status s = FS_OK;
    *failed = -1;
    if (own) {
        if (!own_core->unsharded) {
            joined[njoined] = own_core;
            index[njoined++] = -1;
        }
        own_core->link.batch = &batch;
        s = k->unshard(own_core, 0);
        own_core->link.batch = NULL;
    }
    for (int i = 0; i < n && s == FS_OK; i++) {
        fs_group_core *c = k->member(along, i);
        const int p = k->parts(c);
        if (c == own_core || c->unsharded || !p)
            continue;
        if (parts + p > FS_BATCH_MAX_PARTS)
            break;
        parts += p;
        joined[njoined] = c;
        index[njoined++] = i;
        c->link.batch = &batch;
        s = k->unshard(c, 1);
        c->link.batch = NULL;
        if (s != FS_OK)
            *failed = i;
    }
    if (own_core->link.dev)
        return s; /* nothing was batched: each gather was issued on its own */
    /* nothing issued before the flush: every rank fails the same way or times out */
    if (s == FS_OK && (s = fs_gather_batch_flush(&batch, &own_core->link, &own_core->env)) !=
                          FS_OK)
        s = fs_group_fail_comm(own_core, s, "all-gather", 0, "coalesced all_gather: %s",
                               own_core->link.comm->last_error);
    /* what reads the gathered blocks, or after a failure the bytes back */
    for (int m = 0; m < njoined; m++) {
        if (s != FS_OK)
            k->abandon(joined[m]);
        else if ((s = k->wait(joined[m])) != FS_OK)
            *failed = index[m];
    }
    return s;
}

/* ---------------------------------------------------------------------------
 * reductions */

fs_status fs_group_all_reduce_replicas(fs_group_core *c, int group, void *buf, int64_t count,
                                       fs_dtype t, int defer, void **post)
{
    fs_link *r = &c->replicate;
    if (!r->comm)
        return FS_OK;
    const fs_device_api *d = c->link.dev;
    fs_comm *sc = c->link.comm, *rc = r->comm;
    fs_status s = FS_OK;
    void *ws;
    defer = defer && d;
    if (defer &&
        ((s = d->record(sc, &c->scatter_event, sc->last_error, sizeof sc->last_error)) != FS_OK ||
         (s = d->wait(c->scatter_event, d->comm_stream(rc), sc->last_error,
                      sizeof sc->last_error)) != FS_OK))
        return fs_group_fail(c, s, "all-reduce", group,
                             "ordering the replicas' all_reduce after the reduce_scatter: %s",
                             sc->last_error);
    if ((s = fs_link_lend(&c->env, r, t, count, &ws)) != FS_OK)
        return fs_group_fail(c, s, "all-reduce", group, "out of memory");
    if (defer)
        d->set_defer(rc, 1);
    FS_LINK_RUN(r, s, FS_LOP_ALL_REDUCE, c->name, count, t,
                fs_comm_all_reduce(rc, buf, count, t, FS_RED_SUM));
    if (defer) {
        d->set_defer(rc, 0);
        *post = d->comm_stream(rc); /* ws is read on the replicas' stream until waited for */
    }
    fs_status s2 = fs_group_unlend(c, r, &ws, defer);
    if (s != FS_OK)
        return fs_group_fail_comm(c, s, "all-reduce", group, "all_reduce across replicas: %s",
                                  rc->last_error);
    if (s2 != FS_OK)
        return fs_group_fail(c, s2, "all-reduce", group, "out of host memory");
    return FS_OK;
}

fs_status fs_group_flush_bucket(fs_reduce_bucket *b, fs_group_core *c, int *failed)
{
    const int n = b->nparts;
    const int group = n ? ((const fs_bucket_owner *)b->part[0].owner)->group : -1;
    fs_status s = fs_reduce_bucket_flush(b, &c->link, &c->env);
    b->nparts = 0;
    b->count = 0;
    *failed = -1;
    if (s != FS_OK)
        fs_group_fail_comm(c, s, "reduce-scatter", group, "bucketed reduce_scatter: %s",
                           c->link.comm->last_error);
    for (int i = 0; i < n; i++) {
        fs_bucket_owner *o = b->part[i].owner;
        if (s != FS_OK)
            o->cancel(o);
        else if ((s = o->finish(o)) != FS_OK)
            *failed = i;
    }
    return s;
}

void fs_group_cancel_bucket(fs_reduce_bucket *b)
{
    for (int i = 0; i < b->nparts; i++) {
        fs_bucket_owner *o = b->part[i].owner;
        o->cancel(o);
    }
    b->nparts = 0;
    b->count = 0;
}

int fs_group_owns_part(const fs_group_core *c, const fs_reduce_bucket *b, int i)
{
    return i >= 0 && i < b->nparts && ((const fs_bucket_owner *)b->part[i].owner)->core == c;
}

int fs_group_abort_out_of_memory(const fs_group_core *c, fs_comm *comm, int on_device,
                                 const char *what, const char *err, char *why, size_t nwhy)
{
    if (comm->world_size < 2)
        return 0;
    snprintf(why, nwhy, "flatshard: rank %d ran out of %s memory during %s of '%s': %s",
             comm->rank, on_device ? "device" : "host", what, c->name, err);
    if (comm->ops->abort)
        comm->ops->abort(comm, why);
    return 1;
}

fs_status fs_group_attach_gate(fs_group_core *c, const struct fs_step_gate *gate, int slot)
{
    if (gate && c->gate && c->gate != gate)
        return FS_ERR_INVALID_ARG;
    c->gate = gate;
    c->gate_slot = gate ? slot : 0;
    return FS_OK;
}
