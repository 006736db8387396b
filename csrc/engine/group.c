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

void fs_group_core_destroy(fs_group_core *c)
{
    fs_held_free(&c->held, &c->env);
    fs_held_free(&c->gather_held, &c->env);
    const fs_device_api *d = c->link.dev;
    if (d && c->gather_event)
        d->event_free(c->gather_event);
    if (d && c->reduce_event)
        d->event_free(c->reduce_event);
    c->gather_event = c->reduce_event = NULL;
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

fs_status fs_group_flush_bucket(fs_reduce_bucket *b, fs_group_core *c, int group,
                                const fs_bucket_owners *o, int *failed)
{
    const int n = b->nparts;
    fs_status s = fs_reduce_bucket_flush(b, &c->link, &c->env);
    b->nparts = 0;
    b->count = 0;
    *failed = -1;
    if (s != FS_OK)
        fs_group_fail_comm(c, s, "reduce-scatter", group, "bucketed reduce_scatter: %s",
                           c->link.comm->last_error);
    for (int i = 0; i < n; i++) {
        if (s != FS_OK)
            o->cancel(o->ctx, i);
        else if ((s = o->finish(o->ctx, i)) != FS_OK)
            *failed = i;
    }
    return s;
}

void fs_group_cancel_bucket(fs_reduce_bucket *b, const fs_bucket_owners *o)
{
    for (int i = 0; i < b->nparts; i++)
        o->cancel(o->ctx, i);
    b->nparts = 0;
    b->count = 0;
}
