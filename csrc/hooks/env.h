/* env.h - the engine's host table (engine.h) over torch (env.c). */
#ifndef FS_HOOKS_ENV_H
#define FS_HOOKS_ENV_H

#include "fs_py.h"

/* The table; `empty`: the address of the owner's allocator callable (NULL
 * there: host memory). */
fs_env fs_hooks_env(PyObject **empty);

#endif
