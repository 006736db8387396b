/* unit_internal.h - what unit.c, unit_reduce.c and shard_group.c share inside the
 * engine (not for the glue). */
#ifndef FS_UNIT_INTERNAL_H
#define FS_UNIT_INTERNAL_H

#include "unit.h"

/* Record a failure in u->err (fmt NULL or status FS_ERR_HOST: the host
 * reported it in its own way) and return s. */
fs_status fs_unit_fail(fs_unit *u, fs_status s, const char *what, int group, const char *fmt,
                       ...);
/* The same, for a failure in or around a collective. */
fs_status fs_unit_fail_comm(fs_unit *u, fs_status s, const char *what, int group,
                            const char *fmt, const char *detail);
/* copy.h's cast / scale_accumulate: the host loops, or the device table's
 * kernels enqueued on `stream`. */
fs_status fs_unit_cast(fs_unit *u, void *stream, void *dst, fs_dtype dt, const void *src,
                       fs_dtype st, int64_t n);
fs_status fs_unit_scale_accumulate(fs_unit *u, void *stream, void *dst, fs_dtype dt,
                                   const void *src, fs_dtype st, int64_t n, double scale,
                                   int accumulate);

#endif
