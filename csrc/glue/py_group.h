/* py_group.h - what a flatshard._C.Unit and a flatshard._C.ShardGroup share
 * (py_group.c): the constructor's checks, the head's lifetime, binding the
 * Comms' streams for an engine call, an engine failure as an exception,
 * the bucket methods and getters both types' tables hold. */
#ifndef FS_PY_GROUP_H
#define FS_PY_GROUP_H

#include "group_object.h"

#include <stddef.h>

/* The constructor's checks both types make, each naming the
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
/* op's bucket argument (None, or a ReduceBucket for a host Comm without
 * defer) into *out (NULL for None); -1 with an exception set. */
int fs_glue_group_bucket_arg(GroupObject *self, PyObject *o, int defer, const char *op,
                             fs_reduce_bucket **out);
/* The methods flush_bucket(bucket, owners) and cancel_bucket(bucket,
 * owners) of both types ([Note: reduction buckets] in engine/engine.h):
 * owners, a tuple of groups of self's type, the owner of each part in
 * order. A failed part is raised by its owner's done. */
PyObject *fs_glue_group_flush_bucket(PyObject *self, PyObject *args);
PyObject *fs_glue_group_cancel_bucket(PyObject *self, PyObject *args);
/* tell_out_of_memory(what, err) of both types: the Comm aborted with this
 * rank's allocation failure, as an engine call's is ([Note: out of memory on
 * one rank] in py_group.c). */
PyObject *fs_glue_group_tell_out_of_memory(PyObject *self, PyObject *args);
/* The int flag of the core at offset `closure` (fs_group_core), as a bool. */
PyObject *fs_glue_group_get_flag(GroupObject *self, void *closure);
/* The methods and getters both types' tables hold, first. */
#define FS_GROUP_METHODS                                                                     \
    {"flush_bucket", fs_glue_group_flush_bucket, METH_VARARGS,                               \
     "flush_bucket(bucket, owners): the reduce-scatters in the bucket as one, then each\n"   \
     "reduction finished (its gradients written). owners: the owner of each of its\n"       \
     "reductions, in the order they joined it. After a failure none is left waiting."},    \
    {"cancel_bucket", fs_glue_group_cancel_bucket, METH_VARARGS,                             \
     "cancel_bucket(bucket, owners): give the bucket up without a collective (a backward\n" \
     "that did not finish): its reductions are dropped, nothing is written."},             \
    {"tell_out_of_memory", fs_glue_group_tell_out_of_memory, METH_VARARGS,                   \
     "tell_out_of_memory(what, err): this rank's allocation for `what` failed with\n"       \
     "`err`: the Comm is aborted so the other ranks' waits fail at once with it (shm)."}
#define FS_GROUP_GETSET                                                                      \
    {"is_unsharded", (getter)fs_glue_group_get_flag, NULL,                                   \
     "the unsharded buffers are live and gathered (maybe still pending)",                    \
     (void *)offsetof(fs_group_core, unsharded)},                                            \
    {"gather_pending", (getter)fs_glue_group_get_flag, NULL,                                 \
     "a deferred gather (a prefetch) the current stream has not waited for yet",             \
     (void *)offsetof(fs_group_core, gather_pending)},                                       \
    {"reduce_pending", (getter)fs_glue_group_get_flag, NULL,                                 \
     "a reduction left to finish (deferred, or held by a hook)",                             \
     (void *)offsetof(fs_group_core, reduce_pending)},                                       \
    {"counts", (getter)fs_glue_group_get_counts, NULL, "collectives issued", NULL}
/* set_comm_quant's arguments (weight_bits, grad_bits, block) into q. */
int fs_glue_parse_quant(PyObject *args, fs_comm_quant *q);
#define FS_SET_COMM_QUANT_DOC                                                               \
    "set_comm_quant(weight_bits, grad_bits, block): quantized gathers (0 or 8 bits) and\n"  \
    "reductions (0, 8 or 4 bits) with one float32 scale per block values, from now on\n"    \
    "([Note: quantized collectives] in engine/engine.h)."
PyObject *fs_glue_group_get_name(GroupObject *self, void *closure);
PyObject *fs_glue_group_get_comm(GroupObject *self, void *closure);
/* {all_gather, reduce, deferred_gather, deferred_reduce, post_gather}: the
 * core's counts (engine/group.h). */
PyObject *fs_glue_group_get_counts(GroupObject *self, void *closure);

#endif
