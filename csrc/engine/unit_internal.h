/* unit_internal.h - what unit.c and unit_reduce.c share inside the engine
 * (not for the glue). */
#ifndef FS_UNIT_INTERNAL_H
#define FS_UNIT_INTERNAL_H

#include "unit.h"

/* copy.h's cast / scale_accumulate: the host loops, or the device table's
 * kernels enqueued on `stream`. */
fs_status fs_unit_cast(fs_unit *u, void *stream, void *dst, fs_dtype dt, const void *src,
                       fs_dtype st, int64_t n);
fs_status fs_unit_scale_accumulate(fs_unit *u, void *stream, void *dst, fs_dtype dt,
                                   const void *src, fs_dtype st, int64_t n, double scale,
                                   int accumulate);

#endif
