/* storage.h - torch storages over the host pool's blocks ([Note: pooled
 * storage] in storage.c), and its staging memory. */
#ifndef FS_HOOKS_STORAGE_H
#define FS_HOOKS_STORAGE_H

#include "fs_py.h"

/* Give a gathered buffer's storage nbytes (from the host pool; a device's
 * through resize_), or take them away (0). -1 with an exception set on
 * failure. */
int fs_hooks_set_storage(PyObject *storage, int64_t nbytes, int on_device);
/* Host staging for one reduction, from the pool; NULL with an exception set. */
void *fs_hooks_take_staging(int64_t nbytes);
void fs_hooks_give_staging(void *p);
/* An UntypedStorage over a pool block (kept for the next request of its
 * size where cacheable), or over a zero-filled mapping of its own populated
 * by `threads` threads; NULL with an exception set. */
PyObject *fs_hooks_pooled_storage(int64_t nbytes, int cacheable);
PyObject *fs_hooks_mapped_storage(int64_t nbytes, int threads);

#endif
