/* tensor.h - the two reads of a torch tensor that the hooks make per
 * parameter (tensor.c), written once. */
#ifndef FS_HOOKS_TENSOR_H
#define FS_HOOKS_TENSOR_H

#include "fs_py.h"

/* t.requires_grad: 1, 0, or -1 with an exception set. */
int fs_hooks_requires_grad(PyObject *t);
/* 1: t has post-accumulate-grad hooks (torch's _post_accumulate_grad_hooks);
 * 0: none; -1 with an exception set. */
int fs_hooks_grad_hooks_due(PyObject *t);

#endif
