/* copy.cu - cast, scaled accumulation, and the segment copies that move
 * every parameter of a unit in one launch (fs_cuda.h). */
#include "kernels.cuh"

namespace {

/* ---------------------------------------------------------------------------
 * cast, scale_accumulate */

template <typename D, typename S>
__global__ void cast_kernel(D *__restrict__ dst, const S *__restrict__ src, int64_t n)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = convert<D, S>(src[i]);
}

template <typename D>
cudaError_t cast_from(void *dst, const void *src, fs_dtype src_t, int64_t n, cudaStream_t s)
{
    int g = grid_for(n);
    D *d = (D *)dst;
    switch (src_t) {
    case FS_F32: FS_LAUNCH(cast_kernel, g, s)(d, (const float *)src, n); break;
    case FS_F16: FS_LAUNCH(cast_kernel, g, s)(d, (const __half *)src, n); break;
    case FS_BF16: FS_LAUNCH(cast_kernel, g, s)(d, (const __nv_bfloat16 *)src, n); break;
    case FS_F64: FS_LAUNCH(cast_kernel, g, s)(d, (const double *)src, n); break;
    default: return cudaErrorInvalidValue;
    }
    return launched();
}

/* rows of `width` elements, `height` of them, at element pitches */
template <typename D, typename S>
__global__ void cast2d_kernel(D *__restrict__ dst, int64_t dst_pitch, const S *__restrict__ src,
                              int64_t src_pitch, int64_t width, int64_t n)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int64_t row = i / width, col = i - row * width;
        dst[row * dst_pitch + col] = convert<D, S>(src[row * src_pitch + col]);
    }
}

template <typename D>
cudaError_t cast2d_from(void *dst, int64_t dp, const void *src, int64_t sp, fs_dtype src_t,
                        int64_t width, int64_t height, cudaStream_t s)
{
    const int64_t n = width * height;
    int g = grid_for(n);
    D *d = (D *)dst;
    switch (src_t) {
    case FS_F32: FS_LAUNCH(cast2d_kernel, g, s)(d, dp, (const float *)src, sp, width, n); break;
    case FS_F16: FS_LAUNCH(cast2d_kernel, g, s)(d, dp, (const __half *)src, sp, width, n); break;
    case FS_BF16:
        FS_LAUNCH(cast2d_kernel, g, s)(d, dp, (const __nv_bfloat16 *)src, sp, width, n);
        break;
    case FS_F64: FS_LAUNCH(cast2d_kernel, g, s)(d, dp, (const double *)src, sp, width, n); break;
    default: return cudaErrorInvalidValue;
    }
    return launched();
}

__global__ void scale_acc_f32(float *dst, const float *src, int64_t n, float k, int acc)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = acc ? dst[i] + k * src[i] : k * src[i]; /* no 0 + x: -0 stays -0 */
}

__global__ void scale_acc_any(void *dst, int dt, const void *src, int st, int64_t n, double k,
                              int acc)
{
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const bool wide = dt == FS_F64 && st == FS_F64;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        double v;
        if (wide) {
            v = k * load_any(src, st, i);
            if (acc)
                v += load_any(dst, dt, i);
        } else { /* f32 math, as the CPU core */
            float f = (float)k * (float)load_any(src, st, i);
            if (acc)
                f += (float)load_any(dst, dt, i);
            v = f;
        }
        store_any(dst, dt, i, v);
    }
}

/* ---------------------------------------------------------------------------
 * segments: one launch moves every parameter of a unit */

struct seg_table {
    fs_cuda_segment seg[FS_CUDA_SEGMENTS];
    int n;
};

__global__ void segments_kernel(const seg_table tab, void *flat, int flat_t, int unpack)
{
    __shared__ fs_cuda_segment seg[FS_CUDA_SEGMENTS];
    __shared__ int64_t prefix[FS_CUDA_SEGMENTS + 1];
    const int n = tab.n;
    if (threadIdx.x == 0) {
        int64_t sum = 0;
        for (int k = 0; k < n; k++) {
            prefix[k] = sum;
            sum += tab.seg[k].numel;
        }
        prefix[n] = sum;
    }
    for (int k = threadIdx.x; k < n; k += blockDim.x)
        seg[k] = tab.seg[k];
    __syncthreads();
    const int64_t total = prefix[n];
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        /* The last segment starting at or before i (empty ones are skipped
         * because a later segment with the same start wins). */
        int lo = 0, hi = n - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (prefix[mid] <= i)
                lo = mid;
            else
                hi = mid - 1;
        }
        const fs_cuda_segment &s = seg[lo];
        const int64_t j = i - prefix[lo];
        if (unpack)
            copy_elem(s.ptr, s.dtype, s.ptr_offset + j, flat, flat_t, s.flat_offset + j);
        else if (s.ptr)
            copy_elem(flat, flat_t, s.flat_offset + j, s.ptr, s.dtype, s.ptr_offset + j);
        else
            zero_elem(flat, flat_t, s.flat_offset + j);
    }
}

cudaError_t segments(void *flat, fs_dtype flat_t, const fs_cuda_segment *seg, int n, int unpack,
                     cudaStream_t stream)
{
    if (n < 0 || !fs_dtype_size(flat_t) || (n > 0 && (!seg || !flat)))
        return cudaErrorInvalidValue;
    for (int base = 0; base < n; base += FS_CUDA_SEGMENTS) {
        seg_table tab;
        tab.n = n - base < FS_CUDA_SEGMENTS ? n - base : FS_CUDA_SEGMENTS;
        int64_t total = 0;
        for (int k = 0; k < tab.n; k++) {
            const fs_cuda_segment *s = &seg[base + k];
            if (s->numel < 0 || s->ptr_offset < 0 || s->flat_offset < 0 ||
                !fs_dtype_size((fs_dtype)s->dtype) || (unpack && !s->ptr && s->numel))
                return cudaErrorInvalidValue;
            if ((s->dtype != flat_t) && (!fs_dtype_is_float((fs_dtype)s->dtype) ||
                                         !fs_dtype_is_float(flat_t)))
                return cudaErrorInvalidValue;
            tab.seg[k] = *s;
            total += s->numel;
        }
        if (total == 0)
            continue;
        FS_LAUNCH(segments_kernel, grid_for(total), stream)(tab, flat, flat_t, unpack);
        cudaError_t e = launched();
        if (e != cudaSuccess)
            return e;
    }
    return cudaSuccess;
}

} // namespace

extern "C" cudaError_t fs_cuda_cast(void *dst, fs_dtype dst_t, const void *src, fs_dtype src_t,
                                    int64_t n, cudaStream_t stream)
{
    if (n < 0 || !fs_dtype_size(dst_t) || !fs_dtype_size(src_t) || (n && (!dst || !src)))
        return cudaErrorInvalidValue;
    if (n == 0)
        return cudaSuccess;
    if (dst_t == src_t)
        return cudaMemcpyAsync(dst, src, (size_t)n * fs_dtype_size(dst_t), cudaMemcpyDeviceToDevice,
                               stream);
    switch (dst_t) {
    case FS_F32: return cast_from<float>(dst, src, src_t, n, stream);
    case FS_F16: return cast_from<__half>(dst, src, src_t, n, stream);
    case FS_BF16: return cast_from<__nv_bfloat16>(dst, src, src_t, n, stream);
    case FS_F64: return cast_from<double>(dst, src, src_t, n, stream);
    default: return cudaErrorInvalidValue;
    }
}

extern "C" cudaError_t fs_cuda_cast2d(void *dst, int64_t dst_pitch, fs_dtype dst_t,
                                      const void *src, int64_t src_pitch, fs_dtype src_t,
                                      int64_t width, int64_t height, cudaStream_t stream)
{
    if (width < 0 || height < 0 || dst_pitch < width || src_pitch < width ||
        !fs_dtype_size(dst_t) || !fs_dtype_size(src_t) || (width && height && (!dst || !src)))
        return cudaErrorInvalidValue;
    if (!width || !height)
        return cudaSuccess;
    if (height == 1)
        return fs_cuda_cast(dst, dst_t, src, src_t, width, stream);
    if (dst_t == src_t) {
        const size_t es = fs_dtype_size(dst_t);
        return cudaMemcpy2DAsync(dst, (size_t)dst_pitch * es, src, (size_t)src_pitch * es,
                                 (size_t)width * es, (size_t)height, cudaMemcpyDeviceToDevice,
                                 stream);
    }
    switch (dst_t) {
    case FS_F32: return cast2d_from<float>(dst, dst_pitch, src, src_pitch, src_t, width, height, stream);
    case FS_F16: return cast2d_from<__half>(dst, dst_pitch, src, src_pitch, src_t, width, height, stream);
    case FS_BF16:
        return cast2d_from<__nv_bfloat16>(dst, dst_pitch, src, src_pitch, src_t, width, height,
                                          stream);
    case FS_F64: return cast2d_from<double>(dst, dst_pitch, src, src_pitch, src_t, width, height, stream);
    default: return cudaErrorInvalidValue;
    }
}

extern "C" cudaError_t fs_cuda_scale_accumulate(void *dst, fs_dtype dst_t, const void *src,
                                                fs_dtype src_t, int64_t n, double scale,
                                                int accumulate, cudaStream_t stream)
{
    if (n < 0 || !fs_dtype_is_float(dst_t) || !fs_dtype_is_float(src_t) || (n && (!dst || !src)))
        return cudaErrorInvalidValue;
    if (n == 0)
        return cudaSuccess;
    if (dst_t == FS_F32 && src_t == FS_F32)
        FS_LAUNCH(scale_acc_f32, grid_for(n), stream)((float *)dst, (const float *)src, n,
                                                      (float)scale, accumulate);
    else
        FS_LAUNCH(scale_acc_any, grid_for(n), stream)(dst, dst_t, src, src_t, n, scale,
                                                      accumulate);
    return launched();
}

extern "C" cudaError_t fs_cuda_pack(void *flat, fs_dtype flat_t, const fs_cuda_segment *seg, int n,
                                    cudaStream_t stream)
{
    return segments(flat, flat_t, seg, n, 0, stream);
}

extern "C" cudaError_t fs_cuda_unpack(const void *flat, fs_dtype flat_t,
                                      const fs_cuda_segment *seg, int n, cudaStream_t stream)
{
    return segments((void *)flat, flat_t, seg, n, 1, stream);
}
