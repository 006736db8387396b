/* kernels.cuh - what the .cu files share: launch sizing, and element
 * loads, stores and conversions between flatshard's dtypes (fs_dtype.h).
 * Elementwise kernels are memory-bound: grid-stride loops with 64-bit
 * indices over a grid sized to fill the device.
 *
 * Launches go through FS_LAUNCH(kernel, grid, stream)(args...), kThreads
 * threads a block, no dynamic shared memory. Under nvcc it is the <<<>>>
 * launch. Any other C++ compiler builds the kernels as host code for the
 * tests (tests/cuda_emu/: the same sources, every block's threads run as
 * fibers), which then supplies FS_LAUNCH and the CUDA headers. */
#ifndef FS_KERNELS_CUH
#define FS_KERNELS_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fs_cuda.h"

#ifdef __CUDACC__
#define FS_LAUNCH(kernel, grid, stream) kernel<<<(grid), kThreads, 0, (stream)>>>
#endif

namespace {

constexpr int kThreads = 256;

/* One wave of resident blocks (SMs x blocks_per_sm), grid-stride loops
 * covering the rest: a second, partial wave would leave SMs idle at the end
 * of a memory-bound pass. blocks_per_sm is 8 for kernels light enough for
 * 8 x 256 threads per SM; heavier ones pass their occupancy (occupancy()). */
inline int grid_for(int64_t work, int blocks_per_sm = 8)
{
    static int sms[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64)
        dev = 0;
    if (sms[dev] == 0) {
        int n = 0;
        if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1)
            n = 132;
        sms[dev] = n;
    }
    int64_t want = (work + kThreads - 1) / kThreads;
    int64_t cap = (int64_t)sms[dev] * blocks_per_sm;
    return (int)(want < 1 ? 1 : want < cap ? want : cap);
}

/* Resident blocks of kThreads per SM for `kernel`, asked once (*cache). */
template <typename K> inline int occupancy(K kernel, int *cache)
{
    if (*cache == 0) {
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0) != cudaSuccess ||
            n < 1)
            n = 1;
        *cache = n;
    }
    return *cache;
}

inline cudaError_t launched()
{
    return cudaGetLastError();
}

/* ---------------------------------------------------------------------------
 * element conversions */

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double to_f(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ double from_f<double>(float v) { return v; }

template <typename D, typename S> __device__ __forceinline__ D convert(S v)
{
    /* Through f64 when either side is f64 (exact widening, one rounding). */
    if constexpr (sizeof(D) == 8 || sizeof(S) == 8)
        return sizeof(D) == 8 ? (D)(double)to_f(v) : from_f<D>((float)(double)to_f(v));
    else
        return from_f<D>(to_f(v));
}

/* Runtime-dtype access for the segment kernels (tables mix dtypes). */
__device__ __forceinline__ double load_any(const void *p, int t, int64_t i)
{
    switch (t) {
    case FS_F32: return ((const float *)p)[i];
    case FS_F16: return __half2float(((const __half *)p)[i]);
    case FS_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case FS_F64: return ((const double *)p)[i];
    default: return 0.0;
    }
}

__device__ __forceinline__ void store_any(void *p, int t, int64_t i, double v)
{
    switch (t) {
    case FS_F32: ((float *)p)[i] = (float)v; break;
    case FS_F16: ((__half *)p)[i] = __float2half_rn((float)v); break;
    case FS_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)v); break;
    case FS_F64: ((double *)p)[i] = v; break;
    default: break;
    }
}

/* dst[di] = src[si]: a raw copy for equal dtypes (any dtype, bit exact),
 * else a float conversion. A double holds every f32/f16/bf16 value exactly,
 * so going through it rounds once, like the direct conversion. */
__device__ __forceinline__ void copy_elem(void *dst, int dt, int64_t di, const void *src, int st,
                                          int64_t si)
{
    if (dt == st) {
        switch (dt) {
        case FS_F16: case FS_BF16:
            ((uint16_t *)dst)[di] = ((const uint16_t *)src)[si]; return;
        case FS_F32: case FS_I32:
            ((uint32_t *)dst)[di] = ((const uint32_t *)src)[si]; return;
        case FS_F64: case FS_I64:
            ((uint64_t *)dst)[di] = ((const uint64_t *)src)[si]; return;
        default:
            ((uint8_t *)dst)[di] = ((const uint8_t *)src)[si]; return;
        }
    }
    store_any(dst, dt, di, load_any(src, st, si));
}

__device__ __forceinline__ void zero_elem(void *dst, int dt, int64_t di)
{
    switch (dt) {
    case FS_F16: case FS_BF16: ((uint16_t *)dst)[di] = 0; return;
    case FS_F32: case FS_I32: ((uint32_t *)dst)[di] = 0; return;
    case FS_F64: case FS_I64: ((uint64_t *)dst)[di] = 0; return;
    default: ((uint8_t *)dst)[di] = 0; return;
    }
}

} // namespace

#endif
