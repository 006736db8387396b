/* fs_cuda.h - flatshard's CUDA side, callable from C: kernels on raw device
 * pointers and a stream, and the NCCL collective backend.
 *
 * Kernels mirror the CPU core (copy.h, optim.h, norm.h): same dtype codes,
 * same argument order, 64-bit element counts, f32 math (f64 for f64
 * buffers). They only enqueue work on `stream`: no host synchronisation and
 * no allocation; the caller owns every buffer (torch's caching allocator on
 * the Python side). Launchers return a cudaError_t (cudaSuccess, or
 * cudaErrorInvalidValue for a broken precondition), checked once after the
 * launch so a bad configuration surfaces at the call that caused it.
 */
#ifndef FS_CUDA_H
#define FS_CUDA_H

#include <stdint.h>
#include <cuda_runtime_api.h>

#include "fs_device.h"
#include "fs_dtype.h"
#include "fs_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* dst[i] = (dst_t)src[i], i < n; any float dtype to any float dtype, other
 * dtypes only to themselves (a device copy). */
cudaError_t fs_cuda_cast(void *dst, fs_dtype dst_t, const void *src, fs_dtype src_t, int64_t n,
                         cudaStream_t stream);

/* fs_cuda_cast of `height` rows of `width` elements: row j from
 * src + j * src_pitch to dst + j * dst_pitch (pitches in elements). */
cudaError_t fs_cuda_cast2d(void *dst, int64_t dst_pitch, fs_dtype dst_t, const void *src,
                           int64_t src_pitch, fs_dtype src_t, int64_t width, int64_t height,
                           cudaStream_t stream);

/* csrc/core/quant.h's fs_quantize / fs_dequantize on the device (quant.cu):
 * the same payload, the same bits. */
cudaError_t fs_cuda_quantize(void *payload, const void *src, fs_dtype t, int64_t n, int bits,
                             int64_t block, cudaStream_t stream);
cudaError_t fs_cuda_dequantize(void *dst, fs_dtype dst_t, const void *payload, int64_t n,
                               int bits, int64_t block, int accumulate, cudaStream_t stream);

/* dst[i] = (accumulate ? dst[i] : 0) + scale * src[i], in f32 (f64 for f64). */
cudaError_t fs_cuda_scale_accumulate(void *dst, fs_dtype dst_t, const void *src, fs_dtype src_t,
                                     int64_t n, double scale, int accumulate, cudaStream_t stream);

/* One contiguous run of elements between a tensor and a flat buffer:
 * flat[flat_offset + j] <-> ptr[ptr_offset + j], j < numel, cast between
 * `dtype` and the flat buffer's dtype. ptr == NULL in a pack means zeros
 * (the padding of [Note: padding] in layout.h). */
typedef struct {
    void *ptr;
    int64_t ptr_offset;
    int64_t flat_offset;
    int64_t numel;
    int32_t dtype;
} fs_cuda_segment;

/* Segments per launch: the table travels as a kernel argument (no upload, no
 * device-side table to allocate), and must stay under the 4 KiB argument
 * limit. A unit with more segments takes ceil(n / FS_CUDA_SEGMENTS) launches. */
#define FS_CUDA_SEGMENTS 64

/* pack: copy every segment into `flat` (copy-in before an all-gather, or
 * reduce-scatter input packing with the cast to the reduce dtype).
 * unpack: copy `flat` out to every segment (copy-out after an all-gather). */
cudaError_t fs_cuda_pack(void *flat, fs_dtype flat_t, const fs_cuda_segment *seg, int n,
                         cudaStream_t stream);
cudaError_t fs_cuda_unpack(const void *flat, fs_dtype flat_t, const fs_cuda_segment *seg, int n,
                           cudaStream_t stream);

/* Fused Adam/AdamW over one fp32 shard (optim.h's rule). Bias corrections
 * come from `step`, or from *step_dev (a float32 device scalar, torch's
 * fused-optimizer state['step'], already incremented) when step_dev != NULL.
 * found_inf (device float, or NULL): nonzero skips the update entirely.
 * grad_scale (device float, or NULL): gradients are divided by it. */
typedef struct {
    float *param;
    const float *grad;
    float *exp_avg;
    float *exp_avg_sq;
    float *max_exp_avg_sq; /* amsgrad, or NULL */
    void *copy;            /* bf16/fp16 copy of the updated param, or NULL */
    fs_dtype copy_dtype;
    int64_t n;
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;
    const float *step_dev;
    int decoupled, maximize;
    const float *found_inf;
    const float *grad_scale;
} fs_cuda_adam_args;

cudaError_t fs_cuda_adam_step(const fs_cuda_adam_args *a, cudaStream_t stream);

/* Fused SGD (optim.h's rule); first_step initialises the momentum buffer to
 * the gradient, as torch does. found_inf/grad_scale as for Adam. */
typedef struct {
    float *param;
    const float *grad;
    float *momentum_buf; /* NULL when momentum == 0 */
    void *copy;
    fs_dtype copy_dtype;
    int64_t n;
    float lr, momentum, dampening, weight_decay;
    int nesterov, maximize, first_step;
    const float *found_inf;
    const float *grad_scale;
} fs_cuda_sgd_args;

cudaError_t fs_cuda_sgd_step(const fs_cuda_sgd_args *a, cudaStream_t stream);

/* *out (a device double) = sum(x^2) (inf == 0) or max(|x|) (inf == 1), f64
 * accumulation, a NaN makes the result NaN. Enqueued; read it after the
 * stream has run. */
cudaError_t fs_cuda_norm_partial(const void *x, fs_dtype t, int64_t n, int inf, double *out,
                                 cudaStream_t stream);

/* ---------------------------------------------------------------------------
 * NCCL backend (comm_nccl.c): an fs_comm (comm.h) whose buffers are device
 * pointers. Each collective runs on the communicator's own stream, ordered
 * after the caller's stream by an event and making the caller's stream wait
 * for it by another: no host synchronisation. Memory the caller frees after
 * a call is reused by torch's allocator in the caller's stream order, which
 * already waits for the collective: no record_stream needed. */

/* Open libnccl (path, or "libnccl.so.2" from the default search path when
 * NULL). Idempotent; *version as ncclGetVersion's. */
fs_status fs_nccl_load(const char *path, int *version, char *err, size_t cap);
fs_status fs_nccl_unique_id(unsigned char out[128], char *err, size_t cap);

struct fs_comm;
/* Blocking: every rank of the group calls it with the same id. */
fs_status fs_comm_nccl_create(const unsigned char id[128], int rank, int world_size, int device,
                              double timeout_s, struct fs_comm **out, char *err, size_t cap);
/* Release the communicator (ncclCommDestroy once its work finished within
 * the timeout, else ncclCommAbort), its stream and events, keeping the
 * fs_comm itself until fs_comm_destroy: a flatshard._C.Comm that wraps it
 * (fs_device.h) may outlive the close, and its later calls are refused
 * ("the NCCL communicator is closed"), never a freed pointer's. */
void fs_nccl_close(struct fs_comm *c);
/* The stream the next collectives are ordered against (torch's current). */
void fs_nccl_set_caller_stream(struct fs_comm *c, cudaStream_t s);
/* f32 staging for bf16/f16 reductions (they accumulate in f32): the
 * caller's device memory, at least world_size * count * 4 bytes. */
void fs_nccl_set_workspace(struct fs_comm *c, void *ptr, size_t bytes);
cudaStream_t fs_nccl_stream(struct fs_comm *c);
/* Deferred collectives (fs_device.h): while set, the caller's stream does
 * not wait for them; fs_nccl_record marks what was issued so far in *event
 * (a cudaEvent_t, created on first use). */
void fs_nccl_set_defer(struct fs_comm *c, int defer);
fs_status fs_nccl_record(struct fs_comm *c, void **event);
/* The communicator's stream waits for the caller's work so far (what every
 * collective does first): for work enqueued there before a collective. */
fs_status fs_nccl_follow_caller(struct fs_comm *c);
/* Several collectives as one NCCL group (e.g. the all-gathers of units
 * prefetched together): start, issue, end. */
fs_status fs_nccl_group_start(struct fs_comm *c);
fs_status fs_nccl_group_end(struct fs_comm *c);
/* Wait until everything issued so far has finished, polling NCCL's
 * asynchronous error; gives up (and aborts the communicator, so the other
 * ranks fail instead of hanging) after timeout_s. */
fs_status fs_nccl_wait(struct fs_comm *c, double timeout_s);
int fs_nccl_version(void);

/* ---------------------------------------------------------------------------
 * For flatshard._C's engine (fs_device.h): the cast and accumulate kernels
 * and the NCCL stream/workspace setters as a device table (device_cuda.c),
 * which glue/cuda/py_cuda.c exports as a capsule (flatshard._C_cuda.device_api);
 * NcclComm.capsule() (glue/cuda/py_nccl.c) exports the communicator's
 * fs_comm*, which the engine drives through comm.h like any backend. */
extern const fs_device_api fs_cuda_device_api;

#ifdef __cplusplus
}
#endif

#endif
