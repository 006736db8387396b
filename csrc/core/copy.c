/* copy.c - see copy.h. */
#include "copy.h"

#include <string.h>

/* ---------------------------------------------------------------------------
 * element loads and stores through f32 (f64 keeps its own path) */

static inline float load_f(const void *p, fs_dtype t, int64_t i)
{
    switch (t) {
    case FS_F32: return ((const float *)p)[i];
    case FS_F16: return fs_f16_to_f32(((const uint16_t *)p)[i]);
    case FS_BF16: return fs_bf16_to_f32(((const uint16_t *)p)[i]);
    case FS_F64: return (float)((const double *)p)[i];
    default: return 0.0f;
    }
}

static inline void store_f(void *p, fs_dtype t, int64_t i, float v)
{
    switch (t) {
    case FS_F32: ((float *)p)[i] = v; break;
    case FS_F16: ((uint16_t *)p)[i] = fs_f32_to_f16(v); break;
    case FS_BF16: ((uint16_t *)p)[i] = fs_f32_to_bf16(v); break;
    case FS_F64: ((double *)p)[i] = v; break;
    default: break;
    }
}

fs_status fs_cast(void *dst, fs_dtype dst_t, const void *src, fs_dtype src_t, int64_t n)
{
    if (n < 0 || fs_dtype_size(dst_t) == 0 || fs_dtype_size(src_t) == 0)
        return FS_ERR_INVALID_ARG;
    if (n == 0)
        return FS_OK;
    if (!dst || !src) /* e.g. a tensor subclass's data_ptr() */
        return FS_ERR_INVALID_ARG;
    if (dst_t == src_t) {
        memmove(dst, src, (size_t)n * fs_dtype_size(dst_t));
        return FS_OK;
    }
    if (!fs_dtype_is_float(dst_t) || !fs_dtype_is_float(src_t))
        return FS_ERR_UNSUPPORTED;
    if (dst_t == FS_F64) { /* widen without passing through f32 */
        double *d = dst;
        for (int64_t i = 0; i < n; i++)
            d[i] = (double)load_f(src, src_t, i);
        return FS_OK;
    }
    if (src_t == FS_F64) {
        const double *s = src;
        for (int64_t i = 0; i < n; i++)
            store_f(dst, dst_t, i, (float)s[i]);
        return FS_OK;
    }
    if (src_t == FS_F32) {
        const float *s = src;
        uint16_t *d = dst;
        if (dst_t == FS_BF16)
            for (int64_t i = 0; i < n; i++) d[i] = fs_f32_to_bf16(s[i]);
        else
            for (int64_t i = 0; i < n; i++) d[i] = fs_f32_to_f16(s[i]);
        return FS_OK;
    }
    for (int64_t i = 0; i < n; i++)
        store_f(dst, dst_t, i, load_f(src, src_t, i));
    return FS_OK;
}

fs_status fs_zero(void *dst, fs_dtype t, int64_t n)
{
    if (n < 0 || fs_dtype_size(t) == 0 || (n && !dst))
        return FS_ERR_INVALID_ARG;
    if (n)
        memset(dst, 0, (size_t)n * fs_dtype_size(t));
    return FS_OK;
}

fs_status fs_scale_accumulate(void *dst, fs_dtype dst_t, const void *src, fs_dtype src_t,
                              int64_t n, double scale, int accumulate)
{
    if (n < 0 || !fs_dtype_is_float(dst_t) || !fs_dtype_is_float(src_t) ||
        (n && (!dst || !src)))
        return FS_ERR_INVALID_ARG;
    if (dst_t == FS_F32 && src_t == FS_F32) { /* the hot path: vectorised */
        float *d = dst;
        const float *s = src;
        const float k = (float)scale;
        if (accumulate)
            for (int64_t i = 0; i < n; i++) d[i] += k * s[i];
        else
            for (int64_t i = 0; i < n; i++) d[i] = k * s[i];
        return FS_OK;
    }
    if (dst_t == FS_F64 && src_t == FS_F64) {
        double *d = dst;
        const double *s = src;
        if (accumulate)
            for (int64_t i = 0; i < n; i++) d[i] += scale * s[i];
        else
            for (int64_t i = 0; i < n; i++) d[i] = scale * s[i];
        return FS_OK;
    }
    const float k = (float)scale;
    for (int64_t i = 0; i < n; i++) {
        float v = k * load_f(src, src_t, i);
        if (accumulate)
            v += load_f(dst, dst_t, i);
        store_f(dst, dst_t, i, v);
    }
    return FS_OK;
}

fs_status fs_gather_pieces(void *dst, fs_dtype dst_t, int64_t dst_numel, const fs_piece *pieces,
                           int64_t n)
{
    size_t es = fs_dtype_size(dst_t);
    if (es == 0 || dst_numel < 0 || (dst_numel && !dst))
        return FS_ERR_INVALID_ARG;
    /* Pieces arrive in flat order (layout.c emits them so); zero the gaps
     * between them as we go instead of a second pass over the buffer. */
    int64_t covered = 0;
    for (int64_t i = 0; i < n; i++) {
        const fs_piece *p = &pieces[i];
        if (p->numel < 0 || p->dst_offset < covered || p->dst_offset + p->numel > dst_numel ||
            (p->numel && !p->src))
            return FS_ERR_INVALID_ARG;
        FS_CHECK(fs_zero((char *)dst + covered * es, dst_t, p->dst_offset - covered));
        size_t ss = fs_dtype_size(p->src_t);
        FS_CHECK(fs_cast((char *)dst + p->dst_offset * es, dst_t,
                         (const char *)p->src + p->src_offset * ss, p->src_t, p->numel));
        covered = p->dst_offset + p->numel;
    }
    return fs_zero((char *)dst + covered * es, dst_t, dst_numel - covered);
}

fs_status fs_dim0_copy_out(void *dst, fs_dtype dst_t, const void *gathered, fs_dtype t,
                           int64_t world_size, int64_t block_numel, const fs_dim0_entry *e)
{
    size_t es = fs_dtype_size(t), ds = fs_dtype_size(dst_t);
    int64_t out = 0;
    if (e->dim0 > 0 && e->row_numel > 0 && (!dst || !gathered))
        return FS_ERR_INVALID_ARG; /* offsets below would turn NULL into a wild pointer */
    for (int64_t r = 0; r < world_size; r++) {
        int64_t b, rows;
        fs_dim0_rows(e->dim0, world_size, r, &b, &rows);
        int64_t numel = rows * e->row_numel;
        const char *src = (const char *)gathered + (r * block_numel + e->block_offset) * es;
        FS_CHECK(fs_cast((char *)dst + out * ds, dst_t, src, t, numel));
        out += numel;
    }
    return FS_OK;
}

fs_status fs_dim0_copy_in(void *block, fs_dtype t, const void *src, fs_dtype src_t,
                          const fs_dim0_entry *e)
{
    size_t es = fs_dtype_size(t), ss = fs_dtype_size(src_t);
    char *chunk = (char *)block + e->block_offset * es;
    int64_t held = e->local_rows * e->row_numel;
    int64_t padded = e->chunk_rows * e->row_numel;
    if ((padded > 0 && !block) || (held > 0 && !src))
        return FS_ERR_INVALID_ARG; /* offsets below would turn NULL into a wild pointer */
    FS_CHECK(fs_cast(chunk, t, (const char *)src + e->local_row_begin * e->row_numel * ss, src_t,
                     held));
    return fs_zero(chunk + held * es, t, padded - held);
}
