/* py_unit.h - flatshard._C.Unit's glue (py_unit.c) and the host table it
 * gives the engine (py_env.c): Python objects and their lifetimes
 * around the engine's fs_unit (engine/unit.h), which does the work. */
#ifndef FS_PY_UNIT_H
#define FS_PY_UNIT_H

#include "fs_py.h"
#include "unit.h"

typedef struct {
    PyObject_HEAD
    fs_unit u;
    PyObject *name;
    CommObject *comm;
    CommObject *replicate; /* HYBRID_SHARD: the Comm across replicas, or NULL */
    PyObject *empty;       /* device units: empty(numel, dtype_code) -> tensor */
    PyObject **refs;       /* what the groups' handles point at, owned here */
    Py_ssize_t nrefs;
    int ready;             /* fs_unit_init ran (dealloc destroys it) */
} UnitObject;

/* py_env.c: the engine's host table over torch. `empty`: the address
 * of the owner's allocator callable (NULL there: host memory). */
fs_env fs_glue_env(PyObject **empty);

/* The streams of comm (and replicate, may be NULL) bound for one engine
 * call, into link (and rep). -1 with an exception set. */
int fs_glue_bind(CommObject *comm, CommObject *replicate, fs_link *link, fs_link *rep);
/* The engine's view of a Comm (an empty link for NULL). */
fs_link fs_glue_link(CommObject *comm);
/* An engine failure as an exception: err's words (a host failure keeps its
 * own exception), `note` added to it (may be NULL; a reference is not
 * taken), and the ledger's account when it failed in a collective. NULL. */
PyObject *fs_glue_failed(PyTypeObject *tp, fs_status s, const char *err, CommObject *comm,
                         int collective, PyObject *note);

/* py_bucket.c: the fs_reduce_bucket of a flatshard._C.ReduceBucket (any:
 * a type of this module), or NULL with a TypeError set. */
fs_reduce_bucket *fs_glue_bucket(PyTypeObject *any, PyObject *o);
/* args (bucket, owners): the bucket, with *owners a tuple as long as it
 * holds parts (whose owners the caller checks); NULL with an exception set. */
fs_reduce_bucket *fs_glue_bucket_args(PyTypeObject *any, PyObject *args, PyObject **owners);

/* py_pool.c, [Note: pooled storage]: give a gathered buffer's storage
 * nbytes (from the host pool; a device's through resize_), or take them
 * away (0). -1 with an exception set on failure. */
int fs_glue_set_storage(PyObject *storage, int64_t nbytes, int on_device);
/* Host staging for one reduction, from the pool; NULL with an exception set. */
void *fs_glue_take_staging(int64_t nbytes);
void fs_glue_give_staging(void *p);
/* The pool's module functions (pool_stats, pool_trim, ...). */
int fs_glue_pool_add(PyObject *module);

#endif
