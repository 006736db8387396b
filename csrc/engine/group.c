/* group.c - see group.h. */
#include "group.h"

#include <stdio.h>

void fs_group_words(char *err, size_t n, fs_status s, const char *fmt, va_list ap)
{
    err[0] = '\0';
    if (s != FS_ERR_HOST && fmt)
        vsnprintf(err, n, fmt, ap);
}

void fs_group_drop(const fs_env *env, void **handle)
{
    if (*handle)
        env->release(env->ctx, *handle);
    *handle = NULL;
}

fs_status fs_group_flush_bucket(fs_reduce_bucket *b, fs_link *l, const fs_env *env,
                                const fs_bucket_owners *o, int *failed)
{
    const int n = b->nparts;
    fs_status s = fs_reduce_bucket_flush(b, l, env);
    b->nparts = 0;
    b->count = 0;
    *failed = -1;
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
