/* py_pool.h - the pool's module functions and the heap trim (py_pool.c). */
#ifndef FS_PY_POOL_H
#define FS_PY_POOL_H

#include "fs_py.h"

/* The pool's module functions (pool_stats, pool_trim, ...). */
int fs_glue_pool_add(PyObject *module, fs_mod_state *st);
/* [Note: heap trim] (runtime/heap.py): nbytes of a unit's buffers went
 * back on the host; last: only the root is left. Trims the heap once
 * FS_HEAP_TRIM_BYTES have gone back since the last trim, or when last. */
void fs_glue_heap_freed(int64_t nbytes, int last);

#endif
