/* py_pool.h - the host pool's storages and the heap trim (py_pool.c), as
 * the engine's host table (py_env.c) and the units' events use them. */
#ifndef FS_PY_POOL_H
#define FS_PY_POOL_H

#include "fs_py.h"

/* [Note: pooled storage]: give a gathered buffer's storage
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
