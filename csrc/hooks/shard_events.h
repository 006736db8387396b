/* shard_events.h - a fully_shard group's events ([Note: plain events] in
 * shard_events.c): the sequence each hook torch calls runs, over the
 * group's own fields (glue/shard_group_object.h). */
#ifndef FS_HOOKS_SHARD_EVENTS_H
#define FS_HOOKS_SHARD_EVENTS_H

#include "shard_group_object.h"

enum { FS_EVENT_PRE_FORWARD = 0, FS_EVENT_POST_FORWARD = 1, FS_EVENT_PRE_BACKWARD = 2 };

/* What an event hook was made with (flatshard._C.Event, glue/py_event.c,
 * holds it; Python sets group and latch anew where they change). */
typedef struct {
    int kind;                /* FS_EVENT_* */
    PyObject *group;         /* the ShardGroup (settable: a group made anew) */
    PyObject *fallback;      /* the state's Python hook, called with the same arguments */
    PyObject *hook_grads;    /* hook_grads(): gradient hooks on the new unsharded parameters */
    PyObject *latch;         /* PRE_BACKWARD: the tree's Latch (NULL before lazy init) */
    PyObject *pre_backward;  /* POST_FORWARD: the hook for the outputs' gradients */
    PyObject *hook_outputs;  /* POST_FORWARD: hook_outputs(output, pre_backward), any output */
    PyObject *grad_enabled;  /* POST_FORWARD: torch.is_grad_enabled */
    PyObject *tensor;        /* POST_FORWARD: torch.Tensor (one plain output: hooked here) */
} fs_shard_event;

/* The event `ev` with torch's arguments: pre-forward (module, args, kwargs),
 * post-forward (module, args, output), pre-backward (grad). The plain path
 * where it applies, else ev->fallback(*args). */
PyObject *fs_hooks_shard_event(const fs_shard_event *ev, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames);
/* Parameter i's gradient arrived; once every trainable parameter's has, the
 * post-backward (fs_hooks_shard_post_backward). */
PyObject *fs_hooks_shard_arrive(ShardGroupObject *g, int i);
/* No gradient arrived yet in this backward. */
void fs_hooks_shard_clear_arrived(ShardGroupObject *g);
/* The post-backward, once this backward's arrivals are forgotten: the plain
 * one where it applies now, else the state's (g->fallback(owner)). 0, or -1
 * with an exception set. */
int fs_hooks_shard_post_backward(ShardGroupObject *g);
/* reduce_grads' reduction (its doc in glue/py_shard_group.c): None (Python
 * must hand the gradients), 0, 1 or 2; NULL with an exception set. */
PyObject *fs_hooks_shard_reduce(ShardGroupObject *g, PyObject *over, int defer, int reshard,
                                fs_reduce_bucket *bucket);

#endif
