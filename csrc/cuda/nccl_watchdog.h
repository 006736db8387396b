/* nccl_watchdog.h - a thread per NCCL communicator that notices a collective
 * which never finishes (a peer died, stopped, or issued another collective)
 * and aborts the communicator, so that this rank fails with a message
 * naming the collective instead of hanging in whatever host call waits next
 * (torch's .item(), a synchronize). nccl_watchdog.c. */
#ifndef FS_NCCL_WATCHDOG_H
#define FS_NCCL_WATCHDOG_H

#include <stddef.h>
#include <cuda_runtime_api.h>

typedef struct fs_watchdog fs_watchdog;

/* Starts the thread: a collective not finished timeout_s after it was
 * issued calls abort_fn(ctx) from it (once), after which the verdict is set
 * and printed to stderr. NULL if the thread could not start (err says why). */
fs_watchdog *fs_watchdog_start(int device, int rank, double timeout_s,
                               void (*abort_fn)(void *ctx), void *ctx, char *err, size_t cap);
/* Watch what was just enqueued on `stream`: `op` for `what` (a unit's name,
 * a tag, or NULL). Called by the thread issuing collectives. */
void fs_watchdog_track(fs_watchdog *w, cudaStream_t stream, const char *op, const char *what);
/* 1 and the verdict in buf once the watchdog aborted, else 0. */
int fs_watchdog_fired(fs_watchdog *w, char *buf, size_t cap);
/* Stops and joins the thread; frees everything. NULL is allowed. */
void fs_watchdog_stop(fs_watchdog *w);

#endif
