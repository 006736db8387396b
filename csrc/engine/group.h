/* group.h - what both kinds of engine group share: FSDP1's flat unit
 * (unit.h) and fully_shard's shard group (shard_group.h) each embed one
 * fs_group_core, first, the state that means the same in both: the name,
 * the host table and the links, whether the unsharded buffers are live,
 * the marks of deferred work and what it holds, the collectives counted,
 * and the last failure. The helpers here are the only ones that record a
 * failure, give a handle back, mark or wait for a gather, sum across the
 * replicas, coalesce gathers into one batch ([Note: coalesced gathers] in
 * engine.h) or flush and give up a reduction bucket ([Note: reduction
 * buckets]).
 *
 * What differs between the layouts (their buffers, their gathers and
 * reductions, the unit's state machine) stays with each; where a shared
 * helper needs it, the kind hands it in as callbacks. No Python. */
#ifndef FS_GROUP_H
#define FS_GROUP_H

#include <stdarg.h>
#include <stddef.h>

#include "engine.h"

/* [Note: gather mark] A gather is pending (gather_pending) from when it is
 * issued without the caller's stream waiting for it (deferred on a device:
 * a prefetch, marked in gather_event) or recorded in a host batch, until a
 * wait for it succeeded (fs_group_wait_gather): then what reads its output
 * has run (a shard group's copy-out) and what it held (gather_held) is given
 * back. A failed wait leaves the mark and what it holds in place (the device
 * may still write them), so that a later call waits again; a gather given up
 * before it ran (its batch failed) is unmarked by fs_group_drop_gather. */

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
    int gather_pending;   /* [Note: gather mark] */
    void *reduce_event;
    int reduce_pending;   /* a reduction left to finish */
    void *scatter_event;  /* a deferred replicas' all-reduce waits for it: the shard
                             group's collective before (fs_group_all_reduce_replicas) */
    fs_held held;         /* what deferred reductions use, until waited for */
    fs_held gather_held;  /* what a deferred gather uses, until waited for */
    /* the collectives issued: every all-gather and reduction (a reduce-scatter,
     * or a unit's all-reduce of a whole gradient; one per reduction where one
     * rank moves nothing, as torch counts it), those of them left pending on
     * a device, and the gathers over a smaller group after forward */
    unsigned long long n_all_gather, n_reduce, n_deferred_gather, n_deferred_reduce,
        n_post_gather;
    /* the last failure */
    char err[512];        /* in words (none when the host reported it: FS_ERR_HOST) */
    const char *err_what; /* which operation failed ("all-gather", ...) */
    int err_group;        /* a unit's group, or 0 */
    int err_collective;   /* it failed in or around a collective (the ledger has it) */
    /* parameter offload, pipelined: what a gather waits for first, and for
     * which slot ([Note: step before gather] in offload_pipe.h); NULL: none */
    const struct fs_step_gate *gate;
    int gate_slot;
} fs_group_core;

/* [Note: step before gather]: a wait the host's pipelined optimizer
 * (offload_pipe.h) gives the groups; the engine calls nothing else of it. */
typedef struct fs_step_gate {
    void *ctx;
    /* until slot's steps have run, the caller's lock handed back around the wait */
    fs_status (*wait)(void *ctx, int slot, void *(*unlock)(void), void (*lock)(void *));
    const char *(*error)(void *ctx); /* the words of a failed step */
} fs_step_gate;

/* A core zeroed, then named and given its table and links. */
void fs_group_core_init(fs_group_core *c, const char *name, fs_env env, fs_link link,
                        fs_link replicate);
/* The held lists given back and freed, the marks freed. */
void fs_group_core_destroy(fs_group_core *c);
/* [Note: quantized collectives] in engine.h: the group's setting from now
 * on, checked (fs_comm_quant_check; a host link; a backend with an
 * all-to-all for gradients); on failure the record says why. */
fs_status fs_group_set_quant(fs_group_core *c, fs_comm_quant q);
/* [Note: bytes sent] over both links: gathers (*gather) and reductions. */
void fs_group_sent_bytes(const fs_group_core *c, unsigned long long *gather,
                         unsigned long long *reduce);
/* The ledger's and the errors' name from now on (cut to fit). */
void fs_group_rename(fs_group_core *c, const char *name);
/* [Note: out of memory on one rank] (glue/py_group.c): this rank's
 * allocation for `what` failed with `err`: `why` (nwhy bytes) says so,
 * naming the rank, the memory, the operation and the group, and the Comm is
 * aborted with it, so the peers' waits fail at once (a backend that cannot
 * abort leaves them to their timeout). A world of one has nobody to tell:
 * nothing done, 0; else 1. */
int fs_group_abort_out_of_memory(const fs_group_core *c, fs_comm *comm, int on_device,
                                 const char *what, const char *err, char *why, size_t nwhy);
/* From now on c's gathers wait for `gate`'s slot `slot` ([Note: step before
 * gather]); FS_ERR_INVALID_ARG (nothing changed) where c waits for
 * another pipe's gate. NULL detaches it. */
fs_status fs_group_attach_gate(fs_group_core *c, const struct fs_step_gate *gate, int slot);
/* The caller's current streams (fs_device.h: set_caller_stream) that the
 * engine calls to come enqueue on, the shard group's and the replicas'
 * (NULL on the host), bound by the host before each call. */
void fs_group_set_streams(fs_group_core *c, void *stream, void *replicate_stream);

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

/* ---------------------------------------------------------------------------
 * gathers */

/* [Note: step before gather] in offload_pipe.h: the steps of the group's
 * slot have run (the caller's lock handed back while waiting); nothing
 * without a gate. A failed step is recorded as the unshard's failure. */
fs_status fs_group_wait_steps(fs_group_core *c);

/* [Note: gather mark]: a gather just issued deferred (defer, a device: its
 * mark recorded) or recorded in a host batch (0), now pending. */
fs_status fs_group_mark_gather(fs_group_core *c, int defer);
/* [Note: gather mark]: nothing when none is pending; else the caller's
 * stream waits for it, then `then(ctx)` (NULL: nothing) reads its output,
 * and what it held is given back (also when `then` failed). */
fs_status fs_group_wait_gather(fs_group_core *c, fs_status (*then)(void *ctx), void *ctx);
/* A pending gather given up: unmarked, what it held given back. */
void fs_group_drop_gather(fs_group_core *c);

/* One kind's side of a batch gather (fs_group_unshard_along); each entry
 * gets a core of that kind (the kind's first member). */
typedef struct {
    /* member i of an along list (an array of the kind's objects) */
    fs_group_core *(*member)(const void *along, int i);
    /* the all-gathers its gather adds to a batch, at most; 0 for a group
     * whose gather moves nothing over the link, which does not join */
    int (*parts)(const fs_group_core *c);
    /* its gather, with the batch on its link: the caller's own a plain
     * unshard (which waits for a prefetch of its own when live), a member's
     * a prefetch */
    fs_status (*unshard)(fs_group_core *c, int prefetch);
    /* after the flush, for a group whose gather waited in the batch: what
     * reads its output (fs_group_wait_gather) */
    fs_status (*wait)(fs_group_core *c);
    /* after a failure, for a group that joined: not gathered, the bytes its
     * gather was given taken back */
    void (*abandon)(fs_group_core *c);
} fs_gather_kind;

/* [Note: coalesced gathers]: the caller's own group (when own) and the n
 * groups of `along` in order (k's kind, on the same comm) gathered in one
 * all-gather on the host. A member joins unless it is the caller's own,
 * gathered already, or moves nothing; the batch holds FS_BATCH_MAX_PARTS
 * all-gathers, the caller's own reserved: the first member that does not
 * fit ends it (the rest gather at their own event). After the flush each
 * group that joined is waited for. On any failure every group that joined
 * is abandoned, none is left marked gathered, and *failed is the index of
 * the member whose record says why, or -1 for the caller's own. On a
 * device nothing is batched: the gathers are issued one by one, the
 * members' as prefetches. */
fs_status fs_group_unshard_along(const fs_gather_kind *k, fs_group_core *own_core, int own,
                                 const void *along, int n, int *failed);

/* ---------------------------------------------------------------------------
 * reductions */

/* HSDP / HYBRID_SHARD: buf (count of t, written by the shard group's
 * reduce-scatter) summed in place across the replicas; nothing without
 * them. defer (a device): the replicas' stream first waits for the shard
 * group's collectives so far, the caller's stream does not wait for the
 * sum, *post is the replicas' stream (what reads buf follows there) and the
 * float32 workspace is held until waited for. On failure the record says
 * why (as the all-reduce of `group`). */
fs_status fs_group_all_reduce_replicas(fs_group_core *c, int group, void *buf, int64_t count,
                                       fs_dtype t, int defer, void **post);

/* [Note: reduction buckets]: a bucket part's owner (what it records as the
 * part's owner): the core whose record a failed finish fills, the group
 * (a unit's; 0 for shard groups) a failed flush is recorded against, and
 * how it finishes (writes what the flushed reduce-scatter left) or lets
 * the part go (writes nothing). Both let the part's handles go. */
typedef struct fs_bucket_owner {
    fs_group_core *core;
    int group;
    fs_status (*finish)(struct fs_bucket_owner *o);
    void (*cancel)(struct fs_bucket_owner *o);
} fs_bucket_owner;

/* The bucket flushed through c's link, then each part finished by its
 * owner in order; after a failed flush or finish, the parts not finished
 * are cancelled. The bucket is emptied. *failed: the part whose finish
 * failed (its owner's record says why), or -1 (the flush failed, recorded
 * in c against the first part's group, or nothing did). */
fs_status fs_group_flush_bucket(fs_reduce_bucket *b, fs_group_core *c, int *failed);
/* The bucket given up without a collective: every part cancelled, the
 * bucket emptied. */
void fs_group_cancel_bucket(fs_reduce_bucket *b);
/* Whether part i of b is one of c's. */
int fs_group_owns_part(const fs_group_core *c, const fs_reduce_bucket *b, int i);

#endif
