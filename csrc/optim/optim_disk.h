/* optim_disk.h - Adam/AdamW with its moments in a file, streamed in chunks.
 *
 * The optimizer state of one step is read from one file and written to
 * another (never in place: the caller renames the new file over nothing and
 * keeps the old one for as long as a checkpoint refers to it). Each chunk of
 * `chunk_numel` elements is stored as its exp_avg followed by its exp_avg_sq,
 * so one pread and one pwrite move both moments of a chunk:
 *
 *   segment at file_offset:  [m(c0) v(c0)] [m(c1) v(c1)] ...   c_k <= chunk_numel
 *
 * A reader thread preads chunk k+1.. while the caller's thread updates chunk k
 * (optim_cpu.c's fused kernel) and a writer thread pwrites chunk k-1..; the
 * three share `nslots` chunk buffers (double buffering and then some), so
 * host memory holds nslots * 2 * chunk_numel floats whatever the model size.
 * Plain POSIX threads and pread/pwrite: no io_uring, no O_DIRECT (the page
 * cache is the caller's to drop).
 */
#ifndef FS_OPTIM_DISK_H
#define FS_OPTIM_DISK_H

#include <stdint.h>

#include "optim.h"

typedef struct {
    float *param;        /* (n) updated in place */
    const float *grad;   /* (n), or NULL: copy the moments through unchanged */
    int64_t n;
    int64_t file_offset; /* bytes: where this segment's first chunk pair starts */
    int64_t step;        /* this parameter's step after the update (1 on the first) */
} fs_disk_segment;

typedef struct {
    int fd_in;            /* the last step's state, or -1: the moments start at zero */
    int fd_out;           /* the new state */
    int64_t chunk_numel;  /* elements per chunk (> 0) */
    int nslots;           /* chunk buffers in flight (>= 2) */
    int threads;          /* threads of the fused update itself */
    /* out */
    int64_t bytes_read, bytes_written;
    int err;              /* errno of the first failed read or write, else 0 */
    int err_write;        /* 1 if that was a write */
} fs_disk_stream;

/* Bytes of a segment of n elements in the file (both moments). */
int64_t fs_disk_segment_bytes(int64_t n);

/* One step over `nsegs` segments. FS_ERR_BACKEND with s->err set on an I/O
 * error (a short file reads as EIO); the parameters of the chunks updated
 * before it are updated, the new file is incomplete. Releases nothing the
 * caller owns; call without the GIL. */
fs_status fs_disk_adam_step(fs_disk_stream *s, const fs_disk_segment *segs, int nsegs,
                            const fs_adam_hparams *h, fs_simd simd);

#endif
