/* fs_emu.h - just enough of the CUDA runtime and device builtins to compile
 * flatshard's .cu sources with a host C++ compiler, so that the tests can
 * run the very kernels on machines without a GPU.
 *
 * Device memory is host memory and every stream is the host: a launch runs
 * its whole grid before it returns. Blocks run one after another; the
 * threads of a block run as fibers (emu.cc), switching only at barriers, so
 * __syncthreads and the warp shuffles keep their meaning. Shared memory is a
 * function-local static (one block at a time uses it). Conversions round as
 * the device does (round to nearest even), through the CPU core's helpers.
 *
 * Not a CUDA implementation: what the sources do not use is absent, and a
 * kernel that uses something new fails to compile here first. */
#ifndef FS_EMU_H
#define FS_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmath>
#include <functional>

#include "fs_dtype.h"
#include "fs_emu_rt.h"

using std::isnan;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

/* ---------------------------------------------------------------------------
 * runtime (emu_rt.cc) */

/* Small on purpose: grids of a few blocks make every grid-stride loop go
 * round more than once. */
#define FS_EMU_SMS 2
#define FS_EMU_BLOCKS_PER_SM 2

#define cudaOccupancyMaxActiveBlocksPerMultiprocessor fs_emu_occupancy
template <typename K>
inline cudaError_t fs_emu_occupancy(int *n, K kernel, int threads, size_t smem)
{
    (void)kernel, (void)threads, (void)smem;
    *n = FS_EMU_BLOCKS_PER_SM;
    return cudaSuccess;
}

/* Runs `work` in stream order: now on the NULL stream, when the stream is
 * waited for otherwise. */
void fs_emu_enqueue(cudaStream_t s, std::function<void()> work);

/* ---------------------------------------------------------------------------
 * launch geometry and the fiber scheduler (emu.cc) */

struct dim3 {
    unsigned x, y, z;
};
extern dim3 fs_emu_threadIdx, fs_emu_blockIdx, fs_emu_blockDim, fs_emu_gridDim;
#define threadIdx fs_emu_threadIdx
#define blockIdx fs_emu_blockIdx
#define blockDim fs_emu_blockDim
#define gridDim fs_emu_gridDim

/* Runs body once per thread of a grid x block launch. */
void fs_emu_run(int grid, int block, const std::function<void()> &body);
/* Waits for the block (scope -1) or the calling thread's warp (scope 0). */
void fs_emu_barrier(int warp_scope);
/* The shuffle's exchange slot of thread t (8 bytes). */
void *fs_emu_slot(unsigned t);

/* A launch queues the whole grid on its stream; the arguments are copied
 * at the launch, as CUDA copies them. */
template <typename F> struct fs_emu_launcher {
    int grid, block;
    cudaStream_t stream;
    F kernel;
    template <typename... A> void operator()(A... args)
    {
        const int g = grid, b = block;
        F k = kernel;
        fs_emu_enqueue(stream, [=] { fs_emu_run(g, b, [&] { k(args...); }); });
    }
};

template <typename F>
fs_emu_launcher<F> fs_emu_launch(int grid, int block, cudaStream_t stream, F kernel)
{
    return fs_emu_launcher<F>{grid, block, stream, kernel};
}

#define FS_LAUNCH(kernel, grid, stream) \
    fs_emu_launch((grid), kThreads, (stream), [](auto... a_) { kernel(a_...); })

/* ---------------------------------------------------------------------------
 * device builtins */

inline void __syncthreads(void) { fs_emu_barrier(-1); }

template <typename T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta)
{
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    (void)mask; /* the sources shuffle whole warps */
    const unsigned t = threadIdx.x;
    memcpy(fs_emu_slot(t), &v, sizeof v);
    fs_emu_barrier(0);
    T r = v;
    if ((t & 31u) + delta < 32u && t + delta < blockDim.x)
        memcpy(&r, fs_emu_slot(t + delta), sizeof r);
    fs_emu_barrier(0); /* nobody overwrites a slot before every lane read it */
    return r;
}

/* Fibers never run at the same time: a plain update is atomic. */
inline double atomicAdd(double *p, double v)
{
    double old = *p;
    *p = old + v;
    return old;
}

inline unsigned long long atomicMax(unsigned long long *p, unsigned long long v)
{
    unsigned long long old = *p;
    if (v > old)
        *p = v;
    return old;
}

inline long long __double_as_longlong(double d)
{
    long long r;
    memcpy(&r, &d, sizeof r);
    return r;
}

struct alignas(16) float4 {
    float x, y, z, w;
};

/* ---------------------------------------------------------------------------
 * half and bfloat16 (cuda_fp16.h, cuda_bf16.h) */

[[noreturn]] void fs_emu_unsupported(const char *what);

/* CUDA's types also convert from double directly (one rounding, not two);
 * the sources only ever convert through float, so that is left out. */
struct __half {
    uint16_t x;
    __half() = default;
    explicit __half(double) { fs_emu_unsupported("double -> __half"); }
};
struct __nv_bfloat16 {
    uint16_t x;
    __nv_bfloat16() = default;
    explicit __nv_bfloat16(double) { fs_emu_unsupported("double -> __nv_bfloat16"); }
};

inline float __half2float(__half h) { return fs_f16_to_f32(h.x); }
inline float __bfloat162float(__nv_bfloat16 h) { return fs_bf16_to_f32(h.x); }

inline __half __float2half_rn(float f)
{
    __half h;
    h.x = fs_f32_to_f16(f);
    return h;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    __nv_bfloat16 h;
    h.x = fs_f32_to_bf16(f);
    return h;
}

#endif
