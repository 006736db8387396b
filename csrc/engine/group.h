/* group.h - what both kinds of engine group share: FSDP1's flat unit
 * (unit.h) and fully_shard's shard group (shard_group.h) each embed one
 * fs_group_core, the state that means the same in both: the name, the
 * host table and the links, whether the unsharded buffers are live, the
 * marks of deferred work and what it holds, the collectives counted, and
 * the last failure. The helpers here are the only ones that record a
 * failure, give a handle back, wait for a mark, or flush or give up a
 * reduction bucket through its owners' callbacks ([Note: reduction
 * buckets] in engine.h).
 *
 * What differs between the layouts (their buffers, their gathers and
 * reductions, the unit's state machine) stays with each. No Python. */
#ifndef FS_GROUP_H
#define FS_GROUP_H

#include <stdarg.h>
#include <stddef.h>

#include "engine.h"

typedef struct {
    char name[128];       /* the module path: the ledger's and the errors' name */
    fs_env env;
    fs_link link;         /* the shard group */
    fs_link replicate;    /* HSDP / HYBRID_SHARD: across replicas (comm NULL otherwise) */
    int unsharded;        /* the unsharded (compute) buffers are live and gathered,
                             maybe still pending */
    /* [Note: deferred collectives] in unit.h: on a device, the marks of work
     * the caller's stream has not waited for, and what that work uses */
    void *gather_event;
    int gather_pending;
    void *reduce_event;
    int reduce_pending;   /* a reduction left to finish */
    fs_held held;         /* what deferred reductions use, until waited for */
    fs_held gather_held;  /* what a deferred gather uses, until waited for */
    unsigned long long n_all_gather, n_reduce; /* the collectives issued */
    /* the last failure */
    char err[512];        /* in words (none when the host reported it: FS_ERR_HOST) */
    const char *err_what; /* which operation failed ("all-gather", ...) */
    int err_group;        /* a unit's group, or 0 */
    int err_collective;   /* it failed in or around a collective (the ledger has it) */
} fs_group_core;

/* A core zeroed, then named and given its table and links. */
void fs_group_core_init(fs_group_core *c, const char *name, fs_env env, fs_link link,
                        fs_link replicate);
/* The held lists given back and freed, the marks freed. */
void fs_group_core_destroy(fs_group_core *c);

/* Record a failure (the words from fmt: none for NULL or FS_ERR_HOST, the
 * host reported it in its own way) and return s. */
fs_status fs_group_fail(fs_group_core *c, fs_status s, const char *what, int group,
                        const char *fmt, ...);
/* The last failure marked as one in or around a collective; returns s. */
fs_status fs_group_collective(fs_group_core *c, fs_status s);
/* fs_group_fail, for a failure in or around a collective (c is evaluated
 * twice). */
#define fs_group_fail_comm(c, ...) fs_group_collective((c), fs_group_fail((c), __VA_ARGS__))

/* A handle given back to the host and forgotten (NULL: nothing to do). */
void fs_group_drop(fs_group_core *c, void **handle);
/* After a collective that used workspace *h on l (fs_link_lend): unlent,
 * and *h given back, or held when the collective is deferred (defer). */
fs_status fs_group_unlend(fs_group_core *c, fs_link *l, void **h, int defer);

/* The caller's stream waits for a mark on the device (a host batch or
 * bucket is flushed by then: nothing to wait for). On failure the record
 * says that `what` failed waiting for `waiting_for`. */
fs_status fs_group_wait_mark(fs_group_core *c, void *event, const char *what,
                             const char *waiting_for);

/* An owner's side of each bucketed part: finish writes what the flushed
 * reduce-scatter left for part i; cancel lets part i go and writes nothing. */
typedef struct {
    fs_status (*finish)(void *ctx, int part);
    void (*cancel)(void *ctx, int part);
    void *ctx;
} fs_bucket_owners;

/* The bucket flushed through c's link, then each part finished in order;
 * after a failed flush or finish, the parts not finished are cancelled. The
 * bucket is emptied. *failed: the part whose finish failed (its owner's
 * record says why), or -1 (the flush failed, recorded in c against
 * `group`, or nothing did). */
fs_status fs_group_flush_bucket(fs_reduce_bucket *b, fs_group_core *c, int group,
                                const fs_bucket_owners *o, int *failed);
/* The bucket given up without a collective: every part cancelled, the
 * bucket emptied. */
void fs_group_cancel_bucket(fs_reduce_bucket *b, const fs_bucket_owners *o);

#endif
