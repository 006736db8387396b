/* link.c - what every engine object does on a link (engine.h): casts and
 * accumulations on the host or the device, float32 workspace for
 * low-precision reductions on a device, and the handles a deferred
 * collective holds. */
#include "engine.h"

#include <stdlib.h>

#include "copy.h"

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

fs_status fs_link_cast(const fs_link *l, void *stream, void *dst, fs_dtype dt, const void *src,
                       fs_dtype st, int64_t n)
{
    if (l->dev)
        return l->dev->cast(dst, dt, src, st, n, stream, l->comm->last_error,
                            sizeof l->comm->last_error);
    if (!l->unlock || n < FS_UNLOCK_NUMEL)
        return fs_cast(dst, dt, src, st, n);
    void *tok = l->unlock();
    fs_status s = fs_cast(dst, dt, src, st, n);
    l->lock(tok);
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
    void *tok = l->unlock && width * height >= FS_UNLOCK_NUMEL ? l->unlock() : NULL;
    fs_status s = FS_OK;
    for (int64_t j = 0; j < height && s == FS_OK; j++)
        s = fs_cast((char *)dst + (size_t)(j * dst_pitch) * ds, dt,
                    (const char *)src + (size_t)(j * src_pitch) * ss, st, width);
    if (l->unlock && width * height >= FS_UNLOCK_NUMEL)
        l->lock(tok);
    return s;
}

fs_status fs_link_scale_accumulate(const fs_link *l, void *stream, void *dst, fs_dtype dt,
                                   const void *src, fs_dtype st, int64_t n, double scale,
                                   int accumulate)
{
    if (l->dev)
        return l->dev->scale_accumulate(dst, dt, src, st, n, scale, accumulate, stream,
                                        l->comm->last_error, sizeof l->comm->last_error);
    if (!l->unlock || n < FS_UNLOCK_NUMEL)
        return fs_scale_accumulate(dst, dt, src, st, n, scale, accumulate);
    void *tok = l->unlock();
    fs_status s = fs_scale_accumulate(dst, dt, src, st, n, scale, accumulate);
    l->lock(tok);
    return s;
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
