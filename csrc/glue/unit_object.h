/* unit_object.h - flatshard._C.Unit's object: the engine's fs_unit
 * (engine/unit.h) and what Python handed around it. The layout only, shared
 * by its type (py_unit.c), its hook type (py_unit_hook.c) and its events
 * (hooks/unit_events.c). */
#ifndef FS_UNIT_OBJECT_H
#define FS_UNIT_OBJECT_H

#include "group_object.h"
#include "unit.h"

/* [Note: unit plain events] (hooks/unit_events.c): what an FSDP1 unit's
 * backward events do, as Python decides it where what it depends on changes
 * (fsdp/unit.py UnitRuntime.hand_plain). The C steps also mean: a host
 * Comm, the unit in a tree (its root's Latch handed). */
enum {
    FS_UNIT_PLAIN_PRE_BACKWARD = 1,  /* the pre-backward's gather in C: no gather-ahead with
                                      * the prefetch (else on_pre_backward, Python's) */
    FS_UNIT_PLAIN_POST_BACKWARD = 2, /* gradient sync, flat shards (use_orig_params=False), no
                                      * bucket, no SHARD_OPTIM, no parameter offload, no
                                      * gradient NO_SHARD hands over as it is */
    FS_UNIT_PREFETCH_PRE = 4,        /* backward_prefetch BACKWARD_PRE (any path) */
    FS_UNIT_PREFETCH_POST = 8,       /* backward_prefetch BACKWARD_POST (any path) */
    FS_UNIT_VIEWS = 16,              /* the pre-backward sets the unsharded views (views()) */
};

typedef struct {
    FS_GROUP_OBJECT_HEAD
    fs_unit u;
    PyObject **refs;       /* what the groups' handles point at, owned here */
    Py_ssize_t nrefs;
    /* [Note: unit plain events]: what Python handed */
    int plain;             /* FS_UNIT_PLAIN_*, FS_UNIT_PREFETCH_* */
    PyObject *latch;       /* a weak reference to the root's Latch (the end of backward
                            * queued), or NULL: held weakly, since the Latch leads to the
                            * root and its model, and an OffloadPipe holds its Units */
    PyObject *prev;        /* the Unit that ran before this one in the last forward, or NULL */
    PyObject *owner;       /* a weak reference to the Python unit (UnitRuntime), or NULL */
    PyObject *on_pre_backward;  /* on_pre_backward(owner) -> actions: Python's gather */
    PyObject *views;       /* views(owner): the unsharded views set (FS_UNIT_VIEWS) */
    PyObject *on_post_backward; /* on_post_backward(owner, group, full): the Python path */
    PyObject *on_error;    /* on_error(owner, exc): raises (an allocation failure reported) */
    PyObject *run_hooks;   /* run_hooks(params): their post-accumulate-grad hooks */
    PyObject *empty_like;  /* torch.empty_like: a new shard gradient */
    PyObject *tensor;      /* torch.Tensor: the plain path's gradients are of it exactly */
    PyObject *weakrefs;
} UnitObject;

#endif
