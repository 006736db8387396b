/* py_bucket.h - flatshard._C.ReduceBucket (py_bucket.c) as the groups'
 * methods take it. */
#ifndef FS_PY_BUCKET_H
#define FS_PY_BUCKET_H

#include "group_object.h"

/* The fs_reduce_bucket of a flatshard._C.ReduceBucket (any:
 * a type of this module), or NULL with a TypeError set. */
fs_reduce_bucket *fs_glue_bucket(PyTypeObject *any, PyObject *o);
/* args (bucket, owners) of self's `op`: the bucket, with *owners a tuple
 * as long as it holds parts, each of self's type and the owner of its
 * part; NULL with an exception set. */
fs_reduce_bucket *fs_glue_bucket_args(GroupObject *self, PyObject *args, const char *op,
                                      PyObject **owners);

#endif
