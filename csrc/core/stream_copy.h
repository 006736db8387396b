/* stream_copy.h - copies whose destination nobody reads soon.
 *
 * A plain store to a line that is not in the cache first reads the line
 * (read for ownership), and evicts something else to make room: a copy of a
 * buffer larger than the cache then moves its destination's bytes twice and
 * flushes the working set. Non-temporal ("streaming") stores write whole
 * lines straight to memory instead. They are right only where nobody reads
 * the destination soon (a collective's output larger than the cache); for
 * anything that fits, the plain copy keeps it cached for its reader.
 *
 * The instruction set is chosen at run time (fs_simd, reduce.h); the plain
 * path is memcpy, the reference in tests. Both give the same bytes. The
 * streaming path ends with a store fence, so the copy is complete and
 * ordered before anything the caller publishes after it.
 */
#ifndef FS_STREAM_COPY_H
#define FS_STREAM_COPY_H

#include <stddef.h>
#include "reduce.h"

/* dst[0..n) = src[0..n); the buffers must not overlap. simd below AVX2 (or
 * a CPU without it) is memcpy. */
void fs_copy_stream(void *dst, const void *src, size_t n, fs_simd simd);

#endif
