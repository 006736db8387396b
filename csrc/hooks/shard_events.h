/* shard_events.h - a fully_shard group's events ([Note: event sequences] in
 * shard_events.c): the sequence each hook torch calls runs, over the
 * group's own fields (glue/shard_group_object.h). */
#ifndef FS_HOOKS_SHARD_EVENTS_H
#define FS_HOOKS_SHARD_EVENTS_H

#include "shard_group_object.h"

enum { FS_EVENT_PRE_FORWARD = 0, FS_EVENT_POST_FORWARD = 1, FS_EVENT_PRE_BACKWARD = 2 };

/* What an event's sequence does beyond its plain steps (fs_shard_event.opts,
 * handed by FSDPState.hand_options where what they follow changes):
 *   POST_FORWARD: RESHARD free the gathered parameters in C, else STEP call
 *     step() (an int reshard_after_forward's chunk, an extension's free);
 *     ROOT the root's end of forward (root_end()); CAST the output's cast.
 *   PRE_FORWARD, POST_FORWARD: WATCH the forward's inputs watched as with
 *     frozen parameters (a group reducing unused parameters: fsdp2/unused.py).
 *   PRE_FORWARD: BEGIN begin(args, kwargs) first (lazy init, the root's
 *     start of forward, the forward order's record, the input cast); the
 *     gather in C, else (STEP: a prefetch list, gather-ahead, async_op, a
 *     device, not lean) step(); PREFETCH_OUT prefetch() last.
 *   PRE_BACKWARD: GATHER gather again (unshard_in_backward), in C where it
 *     can, else (STEP: a prefetch list, gather-ahead, async_op, a device)
 *     step(); PREFETCH_IN / PREFETCH_OUT prefetch() inside / after the
 *     event's range (a device's implicit prefetch / the user's list). */
enum {
    FS_OPT_STEP = 1 << 0,
    FS_OPT_RESHARD = 1 << 1,
    FS_OPT_ROOT = 1 << 2,
    FS_OPT_CAST = 1 << 3,
    FS_OPT_GATHER = 1 << 4,
    FS_OPT_PREFETCH_IN = 1 << 5,
    FS_OPT_PREFETCH_OUT = 1 << 6,
    FS_OPT_BEGIN = 1 << 7,
    FS_OPT_WATCH = 1 << 8,
};

/* What an event hook was made with (flatshard._C.Event, glue/py_event.c,
 * holds it; Python sets group, latch and opts anew where they change).
 * The callables are the steps that need Python, each called only where its
 * option says so. */
typedef struct {
    int kind;                /* FS_EVENT_* */
    int opts;                /* FS_OPT_* */
    PyObject *group;         /* the ShardGroup, or None (a state without parameters) */
    PyObject *hook_grads;    /* hook_grads(): gradient hooks on the new unsharded parameters */
    PyObject *latch;         /* PRE_BACKWARD: the tree's Latch (NULL before lazy init) */
    PyObject *span;          /* span(): the event's range (a context), entered while one watches */
    PyObject *step;          /* FS_OPT_STEP: the reshard or gather Python does */
    PyObject *root_end;      /* POST_FORWARD, FS_OPT_ROOT: root_end() */
    PyObject *watching;      /* frozen parameters: PRE_FORWARD watching(args, kwargs) -> the
                              * inputs to use; POST_FORWARD watching() -> hook or None */
    PyObject *cast;          /* POST_FORWARD, FS_OPT_CAST: cast(output) -> output */
    PyObject *prefetch;      /* PRE_BACKWARD, FS_OPT_PREFETCH_*: prefetch() */
    PyObject *pre_backward;  /* POST_FORWARD: the hook for the outputs' gradients */
    PyObject *hook_outputs;  /* POST_FORWARD: hook_outputs(output, pre_backward), any output */
    PyObject *grad_enabled;  /* POST_FORWARD: torch.is_grad_enabled */
    PyObject *tensor;        /* POST_FORWARD: torch.Tensor (one plain output: hooked here) */
    PyObject *begin;         /* PRE_FORWARD, FS_OPT_BEGIN: begin(args, kwargs) -> the inputs
                              * to use, or None */
} fs_shard_event;

/* The event `ev` with torch's arguments: pre-forward (module, args, kwargs),
 * post-forward (module, args, output), pre-backward (grad): its one
 * sequence, its options ev->opts. */
PyObject *fs_hooks_shard_event(const fs_shard_event *ev, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames);
/* Parameter i's gradient arrived; once every trainable parameter's has, the
 * post-backward (fs_hooks_shard_post_backward). */
PyObject *fs_hooks_shard_arrive(ShardGroupObject *g, int i);
/* No gradient arrived yet in this backward. */
void fs_hooks_shard_clear_arrived(ShardGroupObject *g);
/* The post-backward's sequence, once this backward's arrivals are forgotten
 * ([Note: post-backward sequence] in shard_events.c). 0, or -1 with an
 * exception set. */
int fs_hooks_shard_post_backward(ShardGroupObject *g);
/* reduce_grads' reduction (its doc in glue/py_shard_group.c): None (Python
 * must hand the gradients), 0, 1 or 2; NULL with an exception set. */
PyObject *fs_hooks_shard_reduce(ShardGroupObject *g, PyObject *over, int defer, int reshard,
                                fs_reduce_bucket *bucket);

#endif
