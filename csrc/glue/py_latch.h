/* py_latch.h - flatshard._C.Latch (py_latch.c) as the events fire it. */
#ifndef FS_PY_LATCH_H
#define FS_PY_LATCH_H

#include "fs_py.h"

/* Set the Latch `latch` (a flatshard._C.Latch); if it was not, its action
 * runs. 0, or -1 with an exception set. */
int fs_glue_latch_fire(PyObject *latch);

#endif
