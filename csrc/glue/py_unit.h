/* py_unit.h - flatshard._C.Unit's glue (py_unit.c) and the host table it
 * gives the engine (py_unit_env.c): Python objects and their lifetimes
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

/* py_unit_env.c: the engine's host table over torch. `empty`: the address
 * of the owner's allocator callable (NULL there: host memory). */
fs_env fs_glue_env(PyObject **empty);

/* py_unit_pool.c, [Note: pooled storage]: give a gathered buffer's storage
 * nbytes (from the host pool; a device's through resize_), or take them
 * away (0). -1 with an exception set on failure. */
int fs_glue_set_storage(PyObject *storage, int64_t nbytes, int on_device);
/* Host staging for one reduction, from the pool; NULL with an exception set. */
void *fs_glue_take_staging(int64_t nbytes);
void fs_glue_give_staging(void *p);
/* The pool's module functions (pool_stats, pool_trim, ...). */
int fs_glue_pool_add(PyObject *module);

#endif
