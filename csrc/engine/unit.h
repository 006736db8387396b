/* unit.h - FSDP1's unit: one wrapped module's flat groups, sharded between
 * uses and gathered just in time, driven by its state machine (unit_fsm.h).
 *
 * One engine for every strategy: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD,
 * ZERO1 (whole parameters and gradients, the optimizer state sharded),
 * hybrid (a second link across replicas), on the host and through a device
 * table, with CPU offload of the shards. fully_shard's per-parameter groups
 * are shard_group.h's: they share the group core (group.h), the links
 * (link.c) and the backends with units, not the state machine (a group's
 * order comes from fully_shard's hooks).
 *
 * Memory ([Note: freeing without invalidating]): a group's unsharded buffer
 * is a host storage whose bytes come and go through env->set_storage; the
 * views of it the host made (parameters, tensors autograd saved) stay valid
 * across reshard/unshard because the storage object is kept. The shard is
 * persistent; so are the compute-dtype shard and the reduction output the
 * engine takes once (env->take) under mixed precision.
 *
 * [Note: mixed precision] With a compute dtype other than the parameters',
 * the shard stays the full-precision master and forward/backward run on
 * `lp`: the shard is cast in one pass into lp_shard and that is gathered, so
 * the collective moves the low-precision bytes. `full` (full precision) is
 * gathered only on request (summon, state dicts). Gradients arrive in the
 * compute dtype, are reduced in the reduce dtype and accumulated into the
 * full-precision shard gradient.
 *
 * [Note: deferred collectives] On a device, a prefetch issues its gathers
 * without making the caller's stream wait, and marks them ([Note: gather
 * mark] in group.h); the caller's stream waits for the mark where the
 * buffers are next used (fs_unit_wait, a plain unshard, reshard). A
 * deferred reduction enqueues the work after the collective (divide, cast,
 * accumulate) on the backend's stream and holds every buffer it touches
 * until fs_unit_finish_reduce. */
#ifndef FS_UNIT_H
#define FS_UNIT_H

#include "engine.h"
#include "group.h"
#include "unit_fsm.h"

typedef struct {
    void *shard;          /* tensor handle: 1-D, shard_numel of dtype (persistent) */
    void *full;           /* tensor handle: padded_numel of dtype; the shard under NO_SHARD */
    void *storage;        /* storage handle of full */
    void *lp;             /* tensor handle: padded_numel of compute, or NULL */
    void *lp_storage;     /* storage handle of lp */
    int64_t shard_numel;
    int64_t padded_numel;
    fs_dtype dtype;       /* parameters, shard, full, shard gradient */
    fs_dtype compute;     /* lp's dtype (== dtype without mixed precision) */
    fs_dtype reduce;      /* gradient reduction dtype */
    void *lp_shard;       /* shard_numel of compute: the all-gather input */
    void *lp_shard_h;
    void *red_out;        /* shard_numel of reduce, when it differs from dtype */
    void *red_out_h;
} fs_unit_group;

/* A group's reduction waiting in a host bucket ([Note: reduction buckets]
 * in engine.h): the bucket part's owner, and what finishing it needs. */
typedef struct {
    fs_bucket_owner owner; /* this unit's core and group (group.h) */
    int pending;
    void *out;            /* tensor handle (held): the gradient written at the finish */
    void *grad;           /* tensor handle (held): the reduce-scatter's input, or NULL */
    void *send_h;         /* taken: the input cast to the reduce dtype, or NULL */
    void *land;           /* where the reduce-scatter lands (out's data, red_out, land_h) */
    void *land_h;         /* taken for it, or NULL */
    fs_dtype land_t;
    double post;          /* the divide the rule left for after the collective */
    int accumulate;
} fs_unit_bucketed;

typedef struct {
    fs_group_core core;   /* name, links, live buffers, marks, counts, failure (group.h) */
    fs_unit_cfg cfg;
    fs_unit_fsm fsm;
    int ngroups;
    fs_unit_group *groups;
    int replicated;       /* NO_SHARD: every rank's shard is the whole buffer */
    int offload;          /* shards and their gradients in host memory (CPUOffload) */
    int full_unsharded;   /* the full-precision buffers are live and gathered */
    void *scratch;        /* reduce-scatter landing area when accumulating */
    void *scratch_h;
    int64_t scratch_bytes;
    int host_pending;     /* offload: a copy to host memory the host has not waited for */
    fs_unit_bucketed *bucketed; /* ngroups: reductions waiting in a host bucket */
} fs_unit;

/* Strategy and groups are checked here; on failure u->core.err says why. The
 * groups array is copied; its handles belong to the unit from now on (the
 * host keeps them alive until fs_unit_destroy). */
fs_status fs_unit_init(fs_unit *u, const char *name, fs_env env, fs_link link,
                       fs_link replicate, fs_strategy strategy, uint64_t grad_mask,
                       const fs_unit_group *groups, int ngroups, int offload);
void fs_unit_destroy(fs_unit *u);

/* [Note: quantized collectives] in engine.h: u's gathers and reductions
 * from now on (group.h: fs_group_set_quant's checks, and a reduction that
 * is a reduce-scatter: not NO_SHARD's nor SHARD_OPTIM's). */
fs_status fs_unit_set_quant(fs_unit *u, fs_comm_quant q);

/* Whether u is the root unit, which is not resharded after forward
 * (unit_fsm.h: the configuration's is_root). */
void fs_unit_set_root(fs_unit *u, int is_root);

/* The state machine (unit_fsm.h), on this unit's configuration. */
fs_status fs_unit_event(fs_unit *u, fs_event ev, unsigned flags, int group, unsigned *actions);

/* Gather every group: the compute buffers, or the full-precision ones
 * (full_precision: summon, state dicts). A no-op when live, but for waiting
 * on a prefetch. prefetch: on a device, do not make the caller's stream wait
 * until fs_unit_wait, a plain unshard or reshard. */
fs_status fs_unit_unshard(fs_unit *u, int full_precision, int prefetch);
/* The compute buffers of u (when own) and of the units in along (the same
 * host comm) gathered in one all-gather (group.h: fs_group_unshard_along
 * chooses which join: not live, not NO_SHARD, within the batch's parts),
 * the along units as fs_unit_unshard's prefetch. On failure none is left
 * marked live and *failed is the index in along of the unit whose err says
 * why, or -1 for u. */
fs_status fs_unit_unshard_along(fs_unit *u, int own, fs_unit *const *along, int n,
                                int *failed);
/* Gather the compute buffers again into their live storage (ZERO1 after an
 * optimizer step, after a state dict load); a live full-precision gather
 * under mixed precision is stale then, and is freed. */
fs_status fs_unit_regather(fs_unit *u);
/* The caller's stream waits for a prefetched gather ([Note: gather mark]). */
fs_status fs_unit_wait(fs_unit *u);
/* Free every unsharded buffer (no-op if sharded, NO_SHARD or ZERO1). */
fs_status fs_unit_reshard(fs_unit *u);

/* Average the unsharded gradient `grad` (padded_numel of compute) over the
 * group into `out`: the shard gradient (shard_numel of dtype), or under
 * ZERO1 the whole gradient (padded_numel of dtype). out = (accumulate ? out :
 * 0) + mean. `grad` is scratch, left undefined. Both are tensor handles; a
 * deferred reduction (defer, on a device) holds them until
 * fs_unit_finish_reduce. bucket (a host link; NULL: none): a bucketable
 * unit's reduce-scatter joins it ([Note: reduction buckets] in engine.h)
 * with &u->bucketed[group].owner as its owner, and `out` is written when
 * the bucket is flushed (group.h: fs_group_flush_bucket). */
fs_status fs_unit_reduce(fs_unit *u, int group, void *grad, void *out, int accumulate,
                         int defer, fs_reduce_bucket *bucket);
/* What is left of the deferred reductions: the caller's stream waits for
 * them (and the host for an offload's copy to host memory), and their
 * buffers are given back. */
fs_status fs_unit_finish_reduce(fs_unit *u);
/* Whether fs_unit_finish_reduce has anything to do. */
int fs_unit_reducing(const fs_unit *u);
/* Whether u's reductions can wait in a bucket: a host link, reduce-scattered
 * (not NO_SHARD's or SHARD_OPTIM's all-reduce), no replicas, no offload, not
 * quantized (engine.h); the others reduce at once. */
int fs_unit_bucketable(const fs_unit *u);
/* The bytes u's compute buffers hold while gathered (padded, in each
 * group's compute dtype): what a reshard gives back. */
int64_t fs_unit_gathered_bytes(const fs_unit *u);

/* What one event asks of the engine besides the state machine's step. */
typedef struct {
    unsigned flags;          /* FS_EVF_* (unit_fsm.h) */
    int group;               /* the group a post-backward reduces, else -1 */
    void *grad, *out;        /* tensor handles for fs_unit_reduce (both, or no reduction) */
    int accumulate, defer;   /* fs_unit_reduce's */
    fs_reduce_bucket *bucket; /* the reduction joins it (a host link), or NULL */
    fs_unit *const *along;   /* units gathered in the same all-gather (a host link) */
    int nalong;
    int coalesce;            /* gather through a batch even with no along units */
} fs_unit_event_work;

/* An event, whole: the end of backward first finishes deferred
 * reductions; then the state machine's step (fs_unit_event), and the work
 * its actions leave to the engine, in this order: the gather (with along's
 * [Note: coalesced gathers]), the wait for it after a pre-forward or
 * pre-backward, the reduction (FS_ACT_REDUCE_GRAD, w->grad and w->out
 * given), the reshard.
 * *actions: the FS_ACT_* bits, for the host's own work (views, hooks). On
 * failure *failed is the index in along of the unit whose err says why, or
 * -1 for u. */
fs_status fs_unit_dispatch(fs_unit *u, fs_event ev, const fs_unit_event_work *w,
                           unsigned *actions, int *failed);

#endif
