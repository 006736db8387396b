/* quant.cu - block-wise int8/int4 quantization on the device, the payload
 * and the rule of csrc/core/quant.h ([Note: quantized payload],
 * [Note: quantization rule]) bit for bit: the CPU kernels are the
 * reference (tests/test_cuda_kernels_emulated.py). One CUDA block per
 * quantization block (grid-stride over them): its threads find the absmax
 * together, thread 0 derives the scale, then each thread writes codes. */
#include "kernels.cuh"

namespace {

constexpr int kQuantBlockMultiple = 32; /* quant.h's FS_QUANT_BLOCK_MULTIPLE */
constexpr int64_t kQuantBlockMax = 4096;

__device__ __forceinline__ int code_of(float x, float inv, int qmax)
{
    float r = rintf(x * inv);
    r = r < (float)-qmax ? (float)-qmax : r > (float)qmax ? (float)qmax : r;
    return (int)r;
}

template <typename S>
__global__ void quantize_kernel(uint8_t *__restrict__ payload, const S *__restrict__ src,
                                int64_t n, int bits, int64_t block)
{
    __shared__ float amax[kThreads];
    __shared__ int bad[kThreads];
    __shared__ float inv_s;
    __shared__ int bad_s;
    const int qmax = bits == 8 ? 127 : 7;
    const int64_t nb = (n + block - 1) / block;
    float *scales = (float *)payload;
    uint8_t *codes = payload + 4 * nb;
    for (int64_t k = blockIdx.x; k < nb; k += gridDim.x) {
        const int64_t off = k * block, len = n - off < block ? n - off : block;
        const S *x = src + off;
        float m = 0.0f;
        int b = 0;
        for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
            float a = fabsf(to_f(x[i]));
            if (!(a < INFINITY))
                b = 1;
            else if (a > m)
                m = a;
        }
        amax[threadIdx.x] = m;
        bad[threadIdx.x] = b;
        __syncthreads();
        for (int w = kThreads / 2; w > 0; w /= 2) {
            if ((int)threadIdx.x < w) {
                amax[threadIdx.x] = fmaxf(amax[threadIdx.x], amax[threadIdx.x + w]);
                bad[threadIdx.x] |= bad[threadIdx.x + w];
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) { /* quant.c's block_scale */
            float s, inv = 0.0f;
            if (bad[0]) {
                s = NAN;
            } else {
                s = amax[0] / (float)qmax;
                float i = s > 0.0f ? 1.0f / s : 0.0f;
                if (!(s > 0.0f) || !(i < INFINITY))
                    s = 0.0f;
                else
                    inv = i;
            }
            scales[k] = s;
            inv_s = inv;
            bad_s = bad[0];
        }
        __syncthreads();
        const float inv = inv_s;
        if (bad_s) { /* zero codes: x * 0 would be NaN for the infinities */
            for (int64_t j = threadIdx.x; j < (bits == 8 ? len : (len + 1) / 2); j += blockDim.x)
                codes[(bits == 8 ? off : off / 2) + j] = 0;
        } else if (bits == 8) {
            for (int64_t i = threadIdx.x; i < len; i += blockDim.x)
                codes[off + i] = (uint8_t)(int8_t)code_of(to_f(x[i]), inv, qmax);
        } else {
            for (int64_t j = threadIdx.x; 2 * j < len; j += blockDim.x) {
                int lo = code_of(to_f(x[2 * j]), inv, qmax);
                int hi = 2 * j + 1 < len ? code_of(to_f(x[2 * j + 1]), inv, qmax) : 0;
                codes[off / 2 + j] = (uint8_t)((lo & 0xF) | ((hi & 0xF) << 4));
            }
        }
        __syncthreads(); /* the shared words are reused by the next block */
    }
}

template <typename D>
__global__ void dequantize_kernel(D *__restrict__ dst, const uint8_t *__restrict__ payload,
                                  int64_t n, int bits, int64_t block, int accumulate)
{
    const int64_t nb = (n + block - 1) / block;
    const float *scales = (const float *)payload;
    const uint8_t *codes = payload + 4 * nb;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int q;
        if (bits == 8) {
            q = (int8_t)codes[i];
        } else {
            int v = (codes[i >> 1] >> ((i & 1) * 4)) & 0xF;
            q = (v ^ 8) - 8;
        }
        float v = (float)q * scales[i / block];
        if (accumulate)
            v = to_f(dst[i]) + v;
        dst[i] = from_f<D>(v);
    }
}

bool valid(int bits, int64_t block, int64_t n)
{
    return (bits == 8 || bits == 4) && block > 0 && block % kQuantBlockMultiple == 0 &&
           block <= kQuantBlockMax && n >= 0;
}

} // namespace

extern "C" cudaError_t fs_cuda_quantize(void *payload, const void *src, fs_dtype t, int64_t n,
                                        int bits, int64_t block, cudaStream_t s)
{
    if (!valid(bits, block, n) || !fs_dtype_is_float(t))
        return cudaErrorInvalidValue;
    if (n == 0)
        return cudaSuccess;
    if (!payload || !src)
        return cudaErrorInvalidValue;
    const int64_t nb = (n + block - 1) / block;
    int g = grid_for(nb * kThreads);
    uint8_t *p = (uint8_t *)payload;
    switch (t) {
    case FS_F32: FS_LAUNCH(quantize_kernel, g, s)(p, (const float *)src, n, bits, block); break;
    case FS_F16: FS_LAUNCH(quantize_kernel, g, s)(p, (const __half *)src, n, bits, block); break;
    case FS_BF16:
        FS_LAUNCH(quantize_kernel, g, s)(p, (const __nv_bfloat16 *)src, n, bits, block);
        break;
    default: /* float64: quant.c rounds to float32 first; here through to_f's double */
        FS_LAUNCH(quantize_kernel, g, s)(p, (const double *)src, n, bits, block);
        break;
    }
    return launched();
}

extern "C" cudaError_t fs_cuda_dequantize(void *dst, fs_dtype dt, const void *payload, int64_t n,
                                          int bits, int64_t block, int accumulate,
                                          cudaStream_t s)
{
    if (!valid(bits, block, n) || !fs_dtype_is_float(dt) || (accumulate && dt != FS_F32))
        return cudaErrorInvalidValue;
    if (n == 0)
        return cudaSuccess;
    if (!payload || !dst)
        return cudaErrorInvalidValue;
    int g = grid_for(n);
    const uint8_t *p = (const uint8_t *)payload;
    switch (dt) {
    case FS_F32:
        FS_LAUNCH(dequantize_kernel, g, s)((float *)dst, p, n, bits, block, accumulate);
        break;
    case FS_F16: FS_LAUNCH(dequantize_kernel, g, s)((__half *)dst, p, n, bits, block, 0); break;
    case FS_BF16:
        FS_LAUNCH(dequantize_kernel, g, s)((__nv_bfloat16 *)dst, p, n, bits, block, 0);
        break;
    default: FS_LAUNCH(dequantize_kernel, g, s)((double *)dst, p, n, bits, block, 0); break;
    }
    return launched();
}
