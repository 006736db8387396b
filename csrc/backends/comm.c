/* comm.c - argument checks shared by every backend, then dispatch. */
#include "comm.h"

#include <stdio.h>

static fs_status bad(fs_comm *c, const char *what)
{
    snprintf(c->last_error, sizeof c->last_error, "%s", what);
    c->last_fail = FS_FAIL_OTHER;
    return FS_ERR_INVALID_ARG;
}

fs_status fs_comm_all_gather(fs_comm *c, const void *send, void *recv, int64_t count, fs_dtype t)
{
    if (count < 0 || fs_dtype_size(t) == 0)
        return bad(c, "all_gather: negative count or invalid dtype");
    if (count > 0 && (!send || !recv))
        return bad(c, "all_gather: null buffer");
    if (count == 0) /* every rank has the same count: nothing moves anywhere */
        return FS_OK;
    return c->ops->all_gather(c, send, recv, count, t);
}

fs_status fs_comm_reduce_scatter(fs_comm *c, const void *send, void *recv, int64_t recv_count,
                                 fs_dtype t, fs_redop op)
{
    if (recv_count < 0 || !fs_dtype_is_float(t))
        return bad(c, "reduce_scatter: negative count or non-float dtype");
    if (recv_count > 0 && (!send || !recv))
        return bad(c, "reduce_scatter: null buffer");
    if (op != FS_RED_SUM && op != FS_RED_AVG)
        return bad(c, "reduce_scatter: unknown reduction");
    if (recv_count == 0)
        return FS_OK;
    return c->ops->reduce_scatter(c, send, recv, recv_count, t, op);
}

fs_status fs_comm_all_reduce(fs_comm *c, void *buf, int64_t count, fs_dtype t, fs_redop op)
{
    if (count < 0 || !fs_dtype_is_float(t))
        return bad(c, "all_reduce: negative count or non-float dtype");
    if (count > 0 && !buf)
        return bad(c, "all_reduce: null buffer");
    if (op != FS_RED_SUM && op != FS_RED_AVG)
        return bad(c, "all_reduce: unknown reduction");
    if (count == 0)
        return FS_OK;
    return c->ops->all_reduce(c, buf, count, t, op);
}

fs_status fs_comm_broadcast(fs_comm *c, void *buf, int64_t count, fs_dtype t, int root)
{
    if (count < 0 || fs_dtype_size(t) == 0)
        return bad(c, "broadcast: negative count or invalid dtype");
    if (root < 0 || root >= c->world_size)
        return bad(c, "broadcast: root outside the group");
    if (count > 0 && !buf)
        return bad(c, "broadcast: null buffer");
    if (count == 0)
        return FS_OK;
    return c->ops->broadcast(c, buf, count, t, root);
}

fs_status fs_comm_barrier(fs_comm *c) { return c->ops->barrier(c); }

fs_status fs_comm_all_to_all(fs_comm *c, const void *send, void *recv, int64_t count, fs_dtype t)
{
    if (count < 0 || fs_dtype_size(t) == 0)
        return bad(c, "all_to_all: negative count or invalid dtype");
    if (count > 0 && (!send || !recv))
        return bad(c, "all_to_all: null buffer");
    const size_t nb = (size_t)count * fs_dtype_size(t) * (size_t)c->world_size;
    if (count > 0 && (const char *)send < (const char *)recv + nb &&
        (const char *)recv < (const char *)send + nb)
        return bad(c, "all_to_all: send and recv overlap");
    if (!c->ops->all_to_all) {
        snprintf(c->last_error, sizeof c->last_error, "all_to_all: the %s backend has none",
                 c->ops->name);
        c->last_fail = FS_FAIL_OTHER;
        return FS_ERR_UNSUPPORTED;
    }
    if (count == 0)
        return FS_OK;
    return c->ops->all_to_all(c, send, recv, count, t);
}

void fs_comm_destroy(fs_comm *c)
{
    if (c)
        c->ops->destroy(c);
}
