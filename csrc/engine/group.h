/* group.h - what both kinds of engine group share: FSDP1's flat unit
 * (unit.h) and fully_shard's shard group (shard_group.h). A failure's words, a
 * handle given back, and a reduction bucket flushed and finished, or given
 * up, through its owners' callbacks ([Note: reduction buckets] in engine.h).
 *
 * Each group keeps its own failure record and its own reductions; what is
 * written here is the part whose logic is one for both. No Python. */
#ifndef FS_GROUP_H
#define FS_GROUP_H

#include <stdarg.h>
#include <stddef.h>

#include "engine.h"

/* A failure's words from fmt into err (n bytes): none for FS_ERR_HOST,
 * whose words the host keeps, nor for a NULL fmt. */
void fs_group_words(char *err, size_t n, fs_status s, const char *fmt, va_list ap);

/* A handle given back to the host and forgotten (NULL: nothing to do). */
void fs_group_drop(const fs_env *env, void **handle);

/* An owner's side of each bucketed part: finish writes what the flushed
 * reduce-scatter left for part i; cancel lets part i go and writes nothing. */
typedef struct {
    fs_status (*finish)(void *ctx, int part);
    void (*cancel)(void *ctx, int part);
    void *ctx;
} fs_bucket_owners;

/* The bucket flushed through l, then each part finished in order; after a
 * failed flush or finish, the parts not finished are cancelled. The bucket
 * is emptied. *failed: the part whose finish failed, or -1 (the flush
 * failed, its words in l->comm->last_error, or nothing did). */
fs_status fs_group_flush_bucket(fs_reduce_bucket *b, fs_link *l, const fs_env *env,
                                const fs_bucket_owners *o, int *failed);
/* The bucket given up without a collective: every part cancelled, the
 * bucket emptied. */
void fs_group_cancel_bucket(fs_reduce_bucket *b, const fs_bucket_owners *o);

#endif
