/* py_unit.h - the glue of the engine's groups: flatshard._C.Unit
 * (py_unit.c) and flatshard._C.ShardGroup (py_shard_group.c), what both
 * share (py_group.c), and the host table they give the engine (py_env.c):
 * Python objects and their lifetimes around the engine's fs_unit
 * (engine/unit.h) and fs_shard_group (engine/shard_group.h), which do the
 * work. */
#ifndef FS_PY_UNIT_H
#define FS_PY_UNIT_H

#include "fs_py.h"
#include "group.h"
#include "unit.h"

typedef struct GroupObject GroupObject;
/* An engine status as None, or the exception of its group (its own note). */
typedef PyObject *(*fs_glue_done)(GroupObject *self, fs_status s);

/* What a Unit and a ShardGroup share, first in both as PyObject_HEAD is
 * first in every object: the Python objects around the engine object, and
 * where its core (engine/group.h) is, which py_group.c reads. */
#define FS_GROUP_OBJECT_HEAD                                                           \
    PyObject_HEAD                                                                      \
    fs_group_core *core;   /* the engine object's core, inside this object */          \
    PyObject *name;                                                                    \
    CommObject *comm;                                                                  \
    CommObject *replicate; /* HSDP, HYBRID_SHARD: the Comm across replicas, or NULL */ \
    PyObject *empty;       /* device groups: empty(numel, dtype_code) -> tensor */     \
    fs_glue_done done;     /* an engine status as None or this type's exception */     \
    int ready;             /* the engine object was made (dealloc destroys it) */

struct GroupObject {
    FS_GROUP_OBJECT_HEAD
};

#define FS_GROUP(o) ((GroupObject *)(o))

/* [Note: unit plain events] (py_unit_events.c): which of an FSDP1 unit's
 * backward events may take the plain path, as Python decides them where
 * what they depend on changes (fsdp/unit.py UnitRuntime.hand_plain). Both
 * also mean: a host Comm, the unit in a tree (its root's Latch handed). */
enum {
    FS_UNIT_PLAIN_PRE_BACKWARD = 1,  /* no gather-ahead with the prefetch, no views to set */
    FS_UNIT_PLAIN_POST_BACKWARD = 2, /* gradient sync, flat shards (use_orig_params=False), no
                                      * bucket, no SHARD_OPTIM, no parameter offload, no
                                      * gradient NO_SHARD hands over as it is */
    FS_UNIT_PREFETCH_PRE = 4,        /* backward_prefetch BACKWARD_PRE (any path) */
    FS_UNIT_PREFETCH_POST = 8,       /* backward_prefetch BACKWARD_POST (any path) */
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
    PyObject *on_pre_backward;  /* on_pre_backward(owner, grad): the Python path */
    PyObject *on_post_backward; /* on_post_backward(owner, group, full): the Python path */
    PyObject *on_error;    /* on_error(owner, exc): raises (an allocation failure reported) */
    PyObject *run_hooks;   /* run_hooks(params): their post-accumulate-grad hooks */
    PyObject *empty_like;  /* torch.empty_like: a new shard gradient */
    PyObject *tensor;      /* torch.Tensor: the plain path's gradients are of it exactly */
    PyObject *weakrefs;
} UnitObject;

/* py_unit.c: None for FS_OK, else the unit's exception (its note names the
 * unit and operation). */
PyObject *fs_glue_unit_done(UnitObject *self, fs_status s);

/* py_shard_events.c: set the Latch `latch`; if it was not, its action
 * runs. 0, or -1 with an exception set. */
int fs_glue_latch_fire(PyObject *latch);

/* py_unit_events.c */
/* An error of an engine call the plain path made for `u`: handed to its
 * owner's on_error (which reports an allocation failure and raises); NULL. */
PyObject *fs_glue_unit_failed(UnitObject *u);
/* The prefetch before the unit that ran before u in forward (its gather
 * begun), where it is idle; 0, or -1 with an exception set. */
int fs_glue_unit_prefetch_previous(UnitObject *u);
/* What follows u's reshard in backward: the BACKWARD_POST prefetch, and on
 * the host the freed bytes counted for the heap trim. 0 or -1. */
int fs_glue_unit_released(UnitObject *u);
/* The bytes u's compute buffers hold while gathered. */
int64_t fs_glue_unit_gathered_bytes(const UnitObject *u);

/* py_group.c: the constructor's checks both types make, each naming the
 * argument and `type`: comm a flatshard._C.Comm, replicate None or a Comm
 * on the same device, empty a callable given exactly when comm is bound to
 * a device. -1 with TypeError set. */
int fs_glue_group_check(PyTypeObject *tp, const char *type, PyObject *comm, PyObject *replicate,
                        PyObject *empty);
/* The head set (new references to name, comm and, when not None,
 * replicate and empty) around `core`, or cleared. */
void fs_glue_group_init(GroupObject *self, fs_group_core *core, fs_glue_done done,
                        PyObject *name, PyObject *comm, PyObject *replicate, PyObject *empty);
void fs_glue_group_clear(GroupObject *self);
/* tp_traverse of the head (the type, name, Comms, empty): both types are in
 * the collector, for what they hold may lead back to them (a parameter's
 * gradient hook holds the Python state that holds the group). */
int fs_glue_group_traverse(GroupObject *self, visitproc visit, void *arg);
/* The streams of the group's Comms bound for one engine call; -1 with an
 * exception set. */
int fs_glue_group_bind(GroupObject *self);
/* The core's failure as an exception (fs_glue_failed) with `note` added
 * (may be NULL; its reference is given up here); collective: the ledger's
 * account too. NULL. */
PyObject *fs_glue_group_failed(GroupObject *self, fs_status s, int collective, PyObject *note);
/* `along` (op's argument) checked: a tuple of groups of self's type on
 * self's host Comm. Its size, or -1 with an exception set. */
Py_ssize_t fs_glue_group_along(GroupObject *self, PyObject *along, const char *op);
/* The methods flush_bucket(bucket, owners) and cancel_bucket(bucket,
 * owners) of both types ([Note: reduction buckets] in engine/engine.h):
 * owners, a tuple of groups of self's type, the owner of each part in
 * order (their own tables give the docs). A failed part is raised by its
 * owner's done. */
PyObject *fs_glue_group_flush_bucket(PyObject *self, PyObject *args);
PyObject *fs_glue_group_cancel_bucket(PyObject *self, PyObject *args);
/* tell_out_of_memory(what, err) of both types: the Comm aborted with this
 * rank's allocation failure, as an engine call's is ([Note: out of memory on
 * one rank] in py_group.c). */
PyObject *fs_glue_group_tell_out_of_memory(PyObject *self, PyObject *args);
#define FS_TELL_OUT_OF_MEMORY_DOC                                                           \
    "tell_out_of_memory(what, err): this rank's allocation for `what` failed with `err`:\n" \
    "the Comm is aborted so the other ranks' waits fail at once with it (shm)."
/* Getters both types share (their own tables give the docs). */
/* set_comm_quant's arguments (weight_bits, grad_bits, block) into q. */
int fs_glue_parse_quant(PyObject *args, fs_comm_quant *q);
#define FS_SET_COMM_QUANT_DOC                                                               \
    "set_comm_quant(weight_bits, grad_bits, block): quantized gathers (0 or 8 bits) and\n"  \
    "reductions (0, 8 or 4 bits) with one float32 scale per block values, from now on\n"    \
    "([Note: quantized collectives] in engine/engine.h)."
PyObject *fs_glue_group_get_name(GroupObject *self, void *closure);
PyObject *fs_glue_group_get_comm(GroupObject *self, void *closure);
PyObject *fs_glue_group_get_unsharded(GroupObject *self, void *closure);
PyObject *fs_glue_group_get_gather_pending(GroupObject *self, void *closure);
PyObject *fs_glue_group_get_reduce_pending(GroupObject *self, void *closure);
/* {all_gather, reduce, deferred_gather, deferred_reduce, post_gather}: the
 * core's counts (engine/group.h). */
PyObject *fs_glue_group_get_counts(GroupObject *self, void *closure);

/* An engine failure as an exception: err's words (a host failure keeps its
 * own exception), `note` added to it (may be NULL; a reference is not
 * taken), and the ledger's account when it failed in a collective. NULL. */
PyObject *fs_glue_failed(PyTypeObject *tp, fs_status s, const char *err, CommObject *comm,
                         int collective, PyObject *note);

/* py_bucket.c: the fs_reduce_bucket of a flatshard._C.ReduceBucket (any:
 * a type of this module), or NULL with a TypeError set. */
fs_reduce_bucket *fs_glue_bucket(PyTypeObject *any, PyObject *o);
/* args (bucket, owners) of self's `op`: the bucket, with *owners a tuple
 * as long as it holds parts, each of self's type and the owner of its
 * part; NULL with an exception set. */
fs_reduce_bucket *fs_glue_bucket_args(GroupObject *self, PyObject *args, const char *op,
                                      PyObject **owners);

/* py_pool.c, [Note: pooled storage]: give a gathered buffer's storage
 * nbytes (from the host pool; a device's through resize_), or take them
 * away (0). -1 with an exception set on failure. */
int fs_glue_set_storage(PyObject *storage, int64_t nbytes, int on_device);
/* Host staging for one reduction, from the pool; NULL with an exception set. */
void *fs_glue_take_staging(int64_t nbytes);
void fs_glue_give_staging(void *p);
/* The pool's module functions (pool_stats, pool_trim, ...). */
int fs_glue_pool_add(PyObject *module);
/* [Note: heap trim] (runtime/heap.py): nbytes of a unit's buffers went
 * back on the host; last: only the root is left. Trims the heap once
 * FS_HEAP_TRIM_BYTES have gone back since the last trim, or when last. */
void fs_glue_heap_freed(int64_t nbytes, int last);

#endif
