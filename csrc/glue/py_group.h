/* py_group.h - what a flatshard._C.Unit and a flatshard._C.ShardGroup share
 * (py_group.c): the constructor's checks, the head's lifetime, binding the
 * Comms' streams for an engine call, an engine failure as an exception,
 * the bucket methods and getters both types' tables hold. */
#ifndef FS_PY_GROUP_H
#define FS_PY_GROUP_H

#include "group_object.h"

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

#endif
