/* fs_emu_rt.h - the CUDA runtime API that flatshard's C and CUDA sources
 * call, over host memory, for the host build of csrc/cuda/ in the tests
 * (emu_rt.cc). Every name is mapped to an fs_emu_ one, so this build never
 * binds to a real CUDA runtime that happens to be loaded in the process.
 *
 * Streams are queues that run when something waits for them: the NULL
 * stream (the caller's, torch's current one in the tests) runs work at once;
 * a created stream (a communicator's) keeps its work until an event on it is
 * queried or waited for, or the stream is synchronised. Work read by the
 * caller without waiting for it is therefore stale, as it would be on a GPU,
 * and the tests see it. */
#ifndef FS_EMU_RT_H
#define FS_EMU_RT_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorCudartUnloading = 4,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorContextIsDestroyed = 709,
    cudaErrorLaunchFailure = 719,
} cudaError_t;

typedef struct fs_emu_stream *cudaStream_t;
typedef struct fs_emu_event *cudaEvent_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};
typedef enum cudaMemcpyKind cudaMemcpyKind;

enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
typedef enum cudaDeviceAttr cudaDeviceAttr;

#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02

#define cudaGetDevice fs_emu_cudaGetDevice
#define cudaSetDevice fs_emu_cudaSetDevice
#define cudaGetDeviceCount fs_emu_cudaGetDeviceCount
#define cudaDeviceGetAttribute fs_emu_cudaDeviceGetAttribute
#define cudaRuntimeGetVersion fs_emu_cudaRuntimeGetVersion
#define cudaDriverGetVersion fs_emu_cudaDriverGetVersion
#define cudaGetLastError fs_emu_cudaGetLastError
#define cudaGetErrorName fs_emu_cudaGetErrorName
#define cudaGetErrorString fs_emu_cudaGetErrorString
#define cudaMalloc fs_emu_cudaMalloc
#define cudaFree fs_emu_cudaFree
#define cudaMemcpyAsync fs_emu_cudaMemcpyAsync
#define cudaMemcpy2DAsync fs_emu_cudaMemcpy2DAsync
#define cudaMemsetAsync fs_emu_cudaMemsetAsync
#define cudaStreamCreateWithFlags fs_emu_cudaStreamCreateWithFlags
#define cudaStreamDestroy fs_emu_cudaStreamDestroy
#define cudaStreamSynchronize fs_emu_cudaStreamSynchronize
#define cudaStreamWaitEvent fs_emu_cudaStreamWaitEvent
#define cudaEventCreateWithFlags fs_emu_cudaEventCreateWithFlags
#define cudaEventDestroy fs_emu_cudaEventDestroy
#define cudaEventRecord fs_emu_cudaEventRecord
#define cudaEventQuery fs_emu_cudaEventQuery

cudaError_t cudaGetDevice(int *dev);
cudaError_t cudaSetDevice(int dev);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int dev);
cudaError_t cudaRuntimeGetVersion(int *v);
cudaError_t cudaDriverGetVersion(int *v);
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorName(cudaError_t e);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);

/* For the tests (ctypes): make `what` happen, `value` times or with
 * `value`; 0 clears it. "event_never_ready": created streams stop making
 * progress (a peer that never joins), events on them stay not ready.
 * "launch_error": the next cudaGetLastError returns cudaErrorLaunchFailure.
 * "event_error": querying an event on a created stream returns `value` (a
 * cudaError_t: a device fault, or the runtime unloading at exit).
 * Read by the fake NCCL (fake_nccl.cc): "nccl_fail" (the next NCCL call
 * returns `value`), "nccl_async" (the communicator reports `value` as an
 * asynchronous error). */
void fs_emu_fault(const char *what, int value);
int fs_emu_fault_value(const char *what);
/* Reads and clears a one-shot fault. */
int fs_emu_take_fault(const char *what);
/* Work queued on created streams and not yet run (for the tests). */
long fs_emu_pending(void);

#ifdef __cplusplus
}
#endif

#endif
