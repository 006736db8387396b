/* device_cuda.c - the CUDA device table (fs_device.h) that flatshard._C's
 * engine drives a device Comm's buffers through: the kernels of copy.cu
 * and the NCCL backend's stream, workspace and event setters, each CUDA
 * error mapped to a status with the runtime's own words. No Python:
 * glue/cuda/py_cuda.c exports the table as flatshard._C_cuda.device_api. */
#include <stdio.h>

#include "comm.h"
#include "fs_cuda.h"

/* Its name, which flatshard's Python layer keys on. The tests' host build of
 * this file (tests/cuda_emu/), whose "device" memory is host memory, sets
 * another. */
#ifndef FS_CUDA_DEVICE_NAME
#define FS_CUDA_DEVICE_NAME "cuda"
#endif

static fs_status dev_result(cudaError_t e, const char *op, char *err, size_t cap)
{
    if (e == cudaSuccess)
        return FS_OK;
    snprintf(err, cap, "CUDA %s: %s (%s)", op, cudaGetErrorName(e), cudaGetErrorString(e));
    return e == cudaErrorInvalidValue ? FS_ERR_INVALID_ARG : FS_ERR_BACKEND;
}

static fs_status dev_cast(void *dst, fs_dtype dt, const void *src, fs_dtype st, int64_t n,
                          void *stream, char *err, size_t cap)
{
    return dev_result(fs_cuda_cast(dst, dt, src, st, n, (cudaStream_t)stream), "cast", err, cap);
}

static fs_status dev_cast2d(void *dst, int64_t dst_pitch, fs_dtype dt, const void *src,
                            int64_t src_pitch, fs_dtype st, int64_t width, int64_t height,
                            void *stream, char *err, size_t cap)
{
    return dev_result(fs_cuda_cast2d(dst, dst_pitch, dt, src, src_pitch, st, width, height,
                                     (cudaStream_t)stream),
                      "cast2d", err, cap);
}

static fs_status dev_scale_accumulate(void *dst, fs_dtype dt, const void *src, fs_dtype st,
                                      int64_t n, double scale, int accumulate, void *stream,
                                      char *err, size_t cap)
{
    return dev_result(fs_cuda_scale_accumulate(dst, dt, src, st, n, scale, accumulate,
                                               (cudaStream_t)stream),
                      "scale_accumulate", err, cap);
}

static void dev_set_caller_stream(struct fs_comm *c, void *stream)
{
    fs_nccl_set_caller_stream(c, (cudaStream_t)stream);
}

static fs_status dev_record(struct fs_comm *c, void **event, char *err, size_t cap)
{
    fs_status s = fs_nccl_record(c, event);
    if (s != FS_OK)
        snprintf(err, cap, "%s", c->last_error);
    return s;
}

static fs_status dev_wait(void *event, void *stream, char *err, size_t cap)
{
    return dev_result(cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0),
                      "cudaStreamWaitEvent", err, cap);
}

static void dev_event_free(void *event)
{
    if (event)
        cudaEventDestroy((cudaEvent_t)event); /* at exit the runtime may be gone: ignored */
}

static void *dev_comm_stream(struct fs_comm *c) { return (void *)fs_nccl_stream(c); }

static fs_status dev_copy(void *dst, const void *src, size_t nbytes, void *stream, char *err,
                          size_t cap)
{
    if (!nbytes)
        return FS_OK;
    return dev_result(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault,
                                      (cudaStream_t)stream),
                      "cudaMemcpyAsync", err, cap);
}

static fs_status dev_synchronize(void *stream, char *err, size_t cap)
{
    return dev_result(cudaStreamSynchronize((cudaStream_t)stream), "cudaStreamSynchronize",
                      err, cap);
}

static fs_status dev_follow_caller(struct fs_comm *c, char *err, size_t cap)
{
    fs_status s = fs_nccl_follow_caller(c);
    if (s != FS_OK)
        snprintf(err, cap, "%s", c->last_error);
    return s;
}

const fs_device_api fs_cuda_device_api = {
    FS_DEVICE_API_VERSION, FS_CUDA_DEVICE_NAME, dev_cast, dev_scale_accumulate,
    dev_set_caller_stream, fs_nccl_set_workspace, fs_nccl_set_defer, dev_record, dev_wait,
    dev_event_free, dev_comm_stream, dev_copy, dev_synchronize, dev_follow_caller, dev_cast2d,
};
