/* fake_nccl.cc - a libnccl for the host build of csrc/cuda/: the NCCL entry
 * points flatshard opens (csrc/cuda/fs_nccl.h), over flatshard's own
 * shared-memory backend (csrc/backends/comm_shm.c), so the NCCL backend's C code runs
 * across processes without a GPU.
 *
 * Like NCCL, a collective is only queued on its stream (fs_emu_rt.h) and
 * runs when the stream is waited for; a failure while it runs becomes the
 * communicator's asynchronous error. The unique id carries the name of the
 * shared-memory segment. Faults for the tests come from fs_emu_fault. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fs_emu.h"
#include "fs_nccl.h"

extern "C" {
#include "comm_shm.h"
}

#define EXPORT extern "C" __attribute__((visibility("default")))

static const fs_dtype dtypes[] = {FS_U8,  FS_U8,  FS_I32, FS_I32, FS_I64,
                                  FS_I64, FS_F16, FS_F32, FS_F64, FS_BF16};

struct ncclComm {
    fs_comm *shm;
    int aborted;
    ncclResult_t async;
    char last[640];
};

static ncclResult_t fault(void)
{
    return (ncclResult_t)fs_emu_take_fault("nccl_fail");
}

static ncclResult_t run(ncclComm *c, cudaStream_t s, const char *op, ncclDataType_t dt,
                        std::function<fs_status(fs_comm *)> body)
{
    if (!c || dt < 0 || dt > 9)
        return ncclInvalidArgument;
    if (ncclResult_t r = fault())
        return r;
    fs_emu_enqueue(s, [=] {
        if (c->aborted || c->async != ncclSuccess)
            return;
        if (body(c->shm) != FS_OK) {
            c->async = ncclSystemError;
            snprintf(c->last, sizeof c->last, "%s: %s", op, c->shm->last_error);
        }
    });
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGetVersion(int *v)
{
    *v = 22703;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    static unsigned n;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "/fsfake-%d-%u-%ld", (int)getpid(), n++,
             (long)ts.tv_nsec);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRank(ncclComm **out, int n, ncclUniqueId id, int rank)
{
    if (ncclResult_t r = fault())
        return r;
    ncclComm *c = (ncclComm *)calloc(1, sizeof *c);
    char err[256] = "";
    fs_status s = FS_ERR_BACKEND;
    for (int tries = 0; tries < 20000; tries++) { /* rank 0 creates; the others attach */
        s = fs_comm_shm_create(id.internal, rank, n, 1 << 20, 60.0, FS_STAGE_AUTO, rank == 0,
                               NULL, &c->shm, err, sizeof err);
        if (s == FS_OK || rank == 0)
            break;
        usleep(1000);
    }
    if (s != FS_OK) {
        free(c);
        return ncclSystemError;
    }
    *out = c;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommDestroy(ncclComm *c)
{
    if (c->shm)
        fs_comm_destroy(c->shm);
    free(c);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommAbort(ncclComm *c)
{
    c->aborted = 1;
    if (c->shm && c->shm->ops->abort)
        c->shm->ops->abort(c->shm, "NCCL communicator aborted");
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm *c, ncclResult_t *a)
{
    if (int injected = fs_emu_fault_value("nccl_async")) {
        c->async = (ncclResult_t)injected;
        snprintf(c->last, sizeof c->last, "injected asynchronous error");
    }
    *a = c->async;
    return ncclSuccess;
}

EXPORT const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    }
    return "unknown result code";
}

EXPORT const char *ncclGetLastError(ncclComm *c) { return c ? c->last : ""; }

EXPORT ncclResult_t ncclAllGather(const void *send, void *recv, size_t count,
                                  ncclDataType_t dt, ncclComm *c, cudaStream_t s)
{
    return run(c, s, "ncclAllGather", dt, [=](fs_comm *shm) {
        const size_t bytes = count * fs_dtype_size(dtypes[dt]);
        return fs_comm_all_gather(shm, send, recv, (int64_t)bytes, FS_U8);
    });
}

EXPORT ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count,
                                      ncclDataType_t dt, ncclRedOp_t op, ncclComm *c,
                                      cudaStream_t s)
{
    if (op != ncclSum) /* flatshard only sums */
        return ncclInvalidArgument;
    return run(c, s, "ncclReduceScatter", dt, [=](fs_comm *shm) {
        return fs_comm_reduce_scatter(shm, send, recv, (int64_t)count, dtypes[dt], FS_RED_SUM);
    });
}

EXPORT ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count,
                                  ncclDataType_t dt, ncclRedOp_t op, ncclComm *c,
                                  cudaStream_t s)
{
    if (op != ncclSum)
        return ncclInvalidArgument;
    return run(c, s, "ncclAllReduce", dt, [=](fs_comm *shm) {
        if (send != recv)
            memmove(recv, send, count * fs_dtype_size(dtypes[dt]));
        return fs_comm_all_reduce(shm, recv, (int64_t)count, dtypes[dt], FS_RED_SUM);
    });
}

EXPORT ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count,
                                  ncclDataType_t dt, int root, ncclComm *c, cudaStream_t s)
{
    return run(c, s, "ncclBroadcast", dt, [=](fs_comm *shm) {
        const size_t bytes = count * fs_dtype_size(dtypes[dt]);
        if (shm->rank == root && send != recv)
            memmove(recv, send, bytes);
        return fs_comm_broadcast(shm, recv, (int64_t)bytes, FS_U8, root);
    });
}

EXPORT ncclResult_t ncclGroupStart(void) { return fault(); }
EXPORT ncclResult_t ncclGroupEnd(void) { return fault(); }
