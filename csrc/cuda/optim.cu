/* optim.cu - fused Adam/AdamW and SGD over one fp32 shard, and partial
 * norms (fs_cuda.h). The optimizer loop reads and writes every buffer once,
 * with 16-byte accesses when all of them are aligned. */
#include "kernels.cuh"

namespace {

/* ---------------------------------------------------------------------------
 * optimizers */

__device__ __forceinline__ void store_copy(void *copy, int t, int64_t i, float v)
{
    if (t == FS_BF16)
        ((__nv_bfloat16 *)copy)[i] = __float2bfloat16_rn(v);
    else
        ((__half *)copy)[i] = __float2half_rn(v);
}

struct adam_consts {
    float step_size, inv_bc2_sqrt, decay;
};

__host__ __device__ inline adam_consts adam_derive(float lr, float beta1, float beta2, float wd,
                                                   double step)
{
    adam_consts k;
    double bc1 = 1.0 - pow((double)beta1, step);
    double bc2 = 1.0 - pow((double)beta2, step);
    k.step_size = (float)(lr / bc1);
    k.inv_bc2_sqrt = (float)(1.0 / sqrt(bc2));
    k.decay = 1.0f - lr * wd;
    return k;
}

/* One element of optim_cpu.c's adam_scalar, same operations and order, the
 * same fused multiply-adds ([Note: one formula] there). */
__device__ __forceinline__ float adam_elem(const fs_cuda_adam_args &a, const adam_consts &k,
                                           float p, float g, float &m, float &v, float *mx,
                                           float inv_scale, bool scaled)
{
    if (scaled)
        g = g * inv_scale;
    if (a.maximize)
        g = -g;
    if (a.decoupled)
        p *= k.decay;
    else if (a.weight_decay != 0.0f)
        g = fmaf(a.weight_decay, p, g);
    m = fmaf(1.0f - a.beta1, g - m, m);
    v = fmaf(a.beta2, v, (1.0f - a.beta2) * g * g);
    float vv = v;
    if (mx) {
        vv = fmaxf(*mx, v);
        *mx = vv;
    }
    float denom = fmaf(sqrtf(vv), k.inv_bc2_sqrt, a.eps);
    return fmaf(-k.step_size, m / denom, p);
}

__global__ void adam_kernel(const fs_cuda_adam_args a, adam_consts k, int vec)
{
    if (a.found_inf && *a.found_inf != 0.0f)
        return;
    if (a.step_dev)
        k = adam_derive(a.lr, a.beta1, a.beta2, a.weight_decay, (double)*a.step_dev);
    const bool scaled = a.grad_scale != nullptr;
    const float inv_scale = scaled ? 1.0f / *a.grad_scale : 1.0f;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t done = 0;
    if (vec) { /* 16-byte loads and stores: every buffer is 16-byte aligned */
        const int64_t n4 = a.n / 4;
        for (int64_t q = tid; q < n4; q += stride) {
            float4 p = ((const float4 *)a.param)[q], g = ((const float4 *)a.grad)[q];
            float4 m = ((float4 *)a.exp_avg)[q], v = ((float4 *)a.exp_avg_sq)[q];
            float4 mx4;
            float *mxp = nullptr;
            if (a.max_exp_avg_sq) {
                mx4 = ((float4 *)a.max_exp_avg_sq)[q];
                mxp = &mx4.x;
            }
            float *pp = &p.x, *gp = &g.x, *mp = &m.x, *vp = &v.x;
#pragma unroll
            for (int e = 0; e < 4; e++)
                pp[e] = adam_elem(a, k, pp[e], gp[e], mp[e], vp[e], mxp ? mxp + e : nullptr,
                                  inv_scale, scaled);
            ((float4 *)a.param)[q] = p;
            ((float4 *)a.exp_avg)[q] = m;
            ((float4 *)a.exp_avg_sq)[q] = v;
            if (a.max_exp_avg_sq)
                ((float4 *)a.max_exp_avg_sq)[q] = mx4;
            if (a.copy) {
#pragma unroll
                for (int e = 0; e < 4; e++)
                    store_copy(a.copy, a.copy_dtype, q * 4 + e, pp[e]);
            }
        }
        done = n4 * 4;
    }
    for (int64_t i = done + tid; i < a.n; i += stride) {
        float m = a.exp_avg[i], v = a.exp_avg_sq[i];
        float p = adam_elem(a, k, a.param[i], a.grad[i], m, v,
                            a.max_exp_avg_sq ? a.max_exp_avg_sq + i : nullptr, inv_scale, scaled);
        a.exp_avg[i] = m;
        a.exp_avg_sq[i] = v;
        a.param[i] = p;
        if (a.copy)
            store_copy(a.copy, a.copy_dtype, i, p);
    }
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

__global__ void sgd_kernel(const fs_cuda_sgd_args a)
{
    if (a.found_inf && *a.found_inf != 0.0f)
        return;
    const float inv_scale = a.grad_scale ? 1.0f / *a.grad_scale : 1.0f;
    const float damp = 1.0f - a.dampening;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.n; i += stride) {
        float g = a.grad[i];
        if (a.grad_scale)
            g = g * inv_scale;
        if (a.maximize)
            g = -g;
        float p = a.param[i];
        if (a.weight_decay != 0.0f)
            g = fmaf(a.weight_decay, p, g);
        if (a.momentum_buf) {
            float buf = a.first_step ? g : fmaf(a.momentum, a.momentum_buf[i], damp * g);
            a.momentum_buf[i] = buf;
            g = a.nesterov ? fmaf(a.momentum, buf, g) : buf;
        }
        p = fmaf(-a.lr, g, p);
        a.param[i] = p;
        if (a.copy)
            store_copy(a.copy, a.copy_dtype, i, p);
    }
}

/* ---------------------------------------------------------------------------
 * norms */

__device__ __forceinline__ double warp_reduce(double v, int inf)
{
    for (int off = 16; off > 0; off >>= 1) {
        double o = __shfl_down_sync(0xffffffffu, v, off);
        v = inf ? (o > v || isnan(o) ? o : v) : v + o;
    }
    return v;
}

__global__ void norm_kernel(const void *x, int t, int64_t n, int inf, double *out)
{
    __shared__ double part[kThreads / 32];
    double acc = 0.0;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        double v = load_any(x, t, i);
        if (inf) {
            v = fabs(v);
            if (v > acc || isnan(v))
                acc = v;
        } else {
            acc += v * v;
        }
    }
    acc = warp_reduce(acc, inf);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x < 32) {
        acc = threadIdx.x < kThreads / 32 ? part[threadIdx.x] : 0.0;
        acc = warp_reduce(acc, inf);
        if (threadIdx.x == 0) {
            if (inf) /* non-negative doubles (NaN included, sign cleared) order as their bits */
                atomicMax((unsigned long long *)out, (unsigned long long)__double_as_longlong(
                                                         isnan(acc) ? fabs(acc) : acc));
            else
                atomicAdd(out, acc);
        }
    }
}

} // namespace

extern "C" cudaError_t fs_cuda_adam_step(const fs_cuda_adam_args *a, cudaStream_t stream)
{
    if (a->n < 0 || (!a->step_dev && a->step < 1) ||
        (a->copy && a->copy_dtype != FS_BF16 && a->copy_dtype != FS_F16))
        return cudaErrorInvalidValue;
    if (a->n && (!a->param || !a->grad || !a->exp_avg || !a->exp_avg_sq))
        return cudaErrorInvalidValue;
    if (a->n == 0)
        return cudaSuccess;
    adam_consts k = adam_derive(a->lr, a->beta1, a->beta2, a->weight_decay,
                                a->step_dev ? 1.0 : (double)a->step);
    int vec = aligned16(a->param) && aligned16(a->grad) && aligned16(a->exp_avg) &&
              aligned16(a->exp_avg_sq) && (!a->max_exp_avg_sq || aligned16(a->max_exp_avg_sq));
    static int per_sm; /* about 40 registers a thread: fewer than 8 blocks fit */
    const int grid = grid_for(vec ? a->n / 4 + 1 : a->n, occupancy(adam_kernel, &per_sm));
    FS_LAUNCH(adam_kernel, grid, stream)(*a, k, vec);
    return launched();
}

extern "C" cudaError_t fs_cuda_sgd_step(const fs_cuda_sgd_args *a, cudaStream_t stream)
{
    if (a->n < 0 || (a->copy && a->copy_dtype != FS_BF16 && a->copy_dtype != FS_F16))
        return cudaErrorInvalidValue;
    if (a->n && (!a->param || !a->grad))
        return cudaErrorInvalidValue;
    if (a->n == 0)
        return cudaSuccess;
    FS_LAUNCH(sgd_kernel, grid_for(a->n), stream)(*a);
    return launched();
}

extern "C" cudaError_t fs_cuda_norm_partial(const void *x, fs_dtype t, int64_t n, int inf,
                                            double *out, cudaStream_t stream)
{
    if (n < 0 || !fs_dtype_is_float(t) || !out || (n && !x))
        return cudaErrorInvalidValue;
    cudaError_t e = cudaMemsetAsync(out, 0, sizeof(double), stream);
    if (e != cudaSuccess || n == 0)
        return e;
    FS_LAUNCH(norm_kernel, grid_for(n), stream)(x, t, n, inf != 0, out);
    return launched();
}
