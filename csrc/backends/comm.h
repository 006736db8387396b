/* comm.h - the collective backend interface of the C core.
 *
 * Six collectives over one group of ranks: all_gather, reduce_scatter,
 * all_reduce, broadcast and barrier, which sharding needs, and all_to_all,
 * the block exchange quantized reductions ride on. A backend fills an
 * fs_comm_ops table; the core calls through fs_comm_* (which check
 * arguments once, so backends need not). Backends:
 *   comm_shm.c       shared memory between the ranks of one host (the default
 *                    on CPU); no Python, no GIL. Its slot stores, plain or
 *                    streaming, are shm_staging.c's.
 *   comm_torch.c     any torch.distributed process group (gloo, ...), through a
 *                    Python callable; it takes the GIL for each call.
 *   cuda/comm_nccl.c NCCL on CUDA devices, in flatshard._C_cuda, ordered
 *                    against the caller's stream (fs_device.h).
 *
 * Buffer rules, restated where each call is made:
 *   all_gather:     recv holds world_size * count; rank r's send lands at
 *                   recv + r * count. In place when send == recv + rank * count.
 *   reduce_scatter: send holds world_size * recv_count; rank r receives the
 *                   reduction of every rank's send[r * recv_count ...].
 *   all_to_all:     send and recv hold world_size * count; send[r * count ...]
 *                   goes to rank r, which receives it at recv[rank * count ...].
 *                   Never in place (send and recv do not overlap).
 * Reductions of f16/bf16 accumulate in at least f32 where the backend
 * allows; FS_RED_AVG divides by world_size after the sum (never trusted to
 * the underlying library: gloo's AVG sums).
 */
#ifndef FS_COMM_H
#define FS_COMM_H

#include <stdint.h>
#include "fs_dtype.h"
#include "fs_status.h"

typedef enum { FS_RED_SUM = 0, FS_RED_AVG = 1 } fs_redop;

typedef struct fs_comm fs_comm;

/* What a failed collective met, where the backend can tell: the failure
 * note's fix line is chosen by it (runtime/diagnostics.py). */
typedef enum {
    FS_FAIL_OTHER = 0, /* unknown, or nothing the ranks' order explains */
    FS_FAIL_DEAD,      /* a rank's process ended */
    FS_FAIL_ABSENT,    /* a live rank never came to the collective (timeout) */
    FS_FAIL_DESYNC,    /* the ranks are in different collectives */
} fs_fail_kind;

typedef struct {
    const char *name;
    int needs_gil; /* the backend calls Python (torch); others run without the GIL */
    fs_status (*all_gather)(fs_comm *c, const void *send, void *recv, int64_t count, fs_dtype t);
    fs_status (*reduce_scatter)(fs_comm *c, const void *send, void *recv, int64_t recv_count,
                                fs_dtype t, fs_redop op);
    fs_status (*all_reduce)(fs_comm *c, void *buf, int64_t count, fs_dtype t, fs_redop op);
    fs_status (*broadcast)(fs_comm *c, void *buf, int64_t count, fs_dtype t, int root);
    fs_status (*barrier)(fs_comm *c);
    void (*destroy)(fs_comm *c);
    /* Tell the other ranks this one stopped (e.g. out of memory), so their
     * waits fail with `why` instead of timing out; NULL if the backend cannot. */
    void (*abort)(fs_comm *c, const char *why);
    /* The block exchange that quantized reductions ride on (engine/link_quant.c):
     * bytes in, bytes out, no arithmetic; NULL if the backend lacks it. */
    fs_status (*all_to_all)(fs_comm *c, const void *send, void *recv, int64_t count, fs_dtype t);
} fs_comm_ops;

struct fs_comm {
    const fs_comm_ops *ops;
    int rank;
    int world_size;
    void *impl;
    char last_error[512]; /* backend's own words for the last FS_ERR_BACKEND */
    fs_fail_kind last_fail; /* ... and what it met */
    /* What the collective being issued is for (a unit's name, a tag), set by
     * the caller around each call, or NULL; a backend that reports later
     * (the NCCL watchdog) copies it. */
    const char *what;
};

fs_status fs_comm_all_gather(fs_comm *c, const void *send, void *recv, int64_t count, fs_dtype t);
fs_status fs_comm_reduce_scatter(fs_comm *c, const void *send, void *recv, int64_t recv_count,
                                 fs_dtype t, fs_redop op);
fs_status fs_comm_all_reduce(fs_comm *c, void *buf, int64_t count, fs_dtype t, fs_redop op);
fs_status fs_comm_broadcast(fs_comm *c, void *buf, int64_t count, fs_dtype t, int root);
fs_status fs_comm_barrier(fs_comm *c);
fs_status fs_comm_all_to_all(fs_comm *c, const void *send, void *recv, int64_t count, fs_dtype t);
void fs_comm_destroy(fs_comm *c);

/* The shm backend cuts each rank's staging slot into this many sections,
 * used in turn by successive chunks (comm_shm.c, [Note: chunk pipeline]):
 * a chunk is at most slot_bytes / FS_SHM_SECTIONS. */
#define FS_SHM_SECTIONS 4

#endif
