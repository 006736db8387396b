/* link_quant.c - the quantized collectives of a link ([Note: quantized
 * collectives] in engine.h): a block-quantized all-gather, and a
 * reduce-scatter made of one all-to-all of quantized blocks and a float32
 * sum on the owning rank. The kernels are quant.h's; the bytes move
 * through the backend's all_gather and all_to_all (comm.h). Host links
 * only; the lock is handed back around long kernel loops, as link.c does
 * around casts. */
#include "engine.h"

#include <stdio.h>

#include "copy.h"
#include "quant.h"

int fs_comm_quant_check(const fs_comm_quant *q, char *err, size_t cap)
{
    if (q->weight_bits != 0 && q->weight_bits != 8) {
        snprintf(err, cap, "weight bits must be 0 (off) or 8, got %d", q->weight_bits);
        return 0;
    }
    if (q->grad_bits != 0 && q->grad_bits != 8 && q->grad_bits != 4) {
        snprintf(err, cap, "gradient bits must be 0 (off), 8 or 4, got %d", q->grad_bits);
        return 0;
    }
    if ((q->weight_bits || q->grad_bits) && !fs_quant_valid(8, q->block)) {
        snprintf(err, cap, "block must be a positive multiple of %d up to %d, got %lld",
                 FS_QUANT_BLOCK_MULTIPLE, FS_QUANT_BLOCK_MAX, (long long)q->block);
        return 0;
    }
    return 1;
}

static fs_status take_payloads(const fs_env *env, fs_comm *c, int64_t nbytes, const char *kind,
                               void **buf, void **h)
{
    fs_status s = env->take(env->ctx, nbytes ? nbytes : 1, FS_TAKE_TRANSIENT, buf, h);
    if (s != FS_OK)
        snprintf(c->last_error, sizeof c->last_error, "out of memory for %lld bytes of %s",
                 (long long)nbytes, kind);
    return s;
}

static fs_status not_here(fs_comm *c, const char *op)
{
    snprintf(c->last_error, sizeof c->last_error,
             "%s: quantized collectives run on host links only", op);
    return FS_ERR_UNSUPPORTED;
}

fs_status fs_link_all_gather_quant(fs_link *l, const fs_env *env, const char *what,
                                   const void *send, void *recv, int64_t count, fs_dtype t)
{
    fs_comm *c = l->comm;
    const int bits = l->quant.weight_bits, world = c->world_size;
    const int64_t block = l->quant.block;
    if (l->dev)
        return not_here(c, "quantized all-gather");
    if (count == 0)
        return FS_OK;
    const int64_t pb = fs_quant_payload_bytes(count, bits, block);
    const size_t es = fs_dtype_size(t);
    const fs_simd simd = fs_simd_best();
    void *buf, *h;
    fs_status s = take_payloads(env, c, pb * world, "quantized all-gather", &buf, &h);
    if (s != FS_OK)
        return s;
    char *mine = (char *)buf + (size_t)(c->rank * pb);
    void *tok = fs_link_unlock_for(l, count);
    s = fs_quantize(mine, send, t, count, bits, block, simd);
    fs_link_relock(l, count, tok);
    if (s != FS_OK)
        snprintf(c->last_error, sizeof c->last_error, "quantize: bad arguments");
    else
        FS_LINK_RUN(l, s, FS_LOP_ALL_GATHER, what, pb, FS_U8,
                    fs_comm_all_gather(c, mine, buf, pb, FS_U8));
    if (s == FS_OK) {
        tok = fs_link_unlock_for(l, count * world);
        for (int r = 0; r < world && s == FS_OK; r++)
            s = fs_dequantize((char *)recv + (size_t)(r * count) * es, t,
                              (const char *)buf + (size_t)(r * pb), count, bits, block, 0, simd);
        fs_link_relock(l, count * world, tok);
    }
    env->release(env->ctx, h);
    return s;
}

fs_status fs_link_reduce_scatter_quant(fs_link *l, const fs_env *env, const char *what,
                                       const void *send, void *recv, int64_t recv_count,
                                       fs_dtype t)
{
    fs_comm *c = l->comm;
    const int bits = l->quant.grad_bits, world = c->world_size;
    const int64_t block = l->quant.block, n = recv_count;
    if (l->dev)
        return not_here(c, "quantized reduce-scatter");
    if (n == 0)
        return FS_OK;
    const int64_t pb = fs_quant_payload_bytes(n, bits, block);
    const size_t es = fs_dtype_size(t);
    const fs_simd simd = fs_simd_best();
    /* out: world payloads sent, then world received, then the float32 sum
     * (recv itself when it is float32) */
    const int64_t acc_bytes = t == FS_F32 ? 0 : n * 4;
    void *buf, *h;
    fs_status s = take_payloads(env, c, 2 * pb * world + acc_bytes, "quantized reduce-scatter",
                                &buf, &h);
    if (s != FS_OK)
        return s;
    char *out = buf, *in = (char *)buf + (size_t)(pb * world);
    float *acc = t == FS_F32 ? recv : (float *)(in + (size_t)(pb * world));
    void *tok = fs_link_unlock_for(l, n * world);
    for (int r = 0; r < world && s == FS_OK; r++)
        s = fs_quantize(out + (size_t)(r * pb), (const char *)send + (size_t)(r * n) * es, t, n,
                        bits, block, simd);
    fs_link_relock(l, n * world, tok);
    if (s != FS_OK)
        snprintf(c->last_error, sizeof c->last_error, "quantize: bad arguments");
    else
        FS_LINK_RUN(l, s, FS_LOP_ALL_TO_ALL, what, pb, FS_U8,
                    fs_comm_all_to_all(c, out, in, pb, FS_U8));
    if (s == FS_OK) { /* every rank's block for this one, summed in rank order */
        tok = fs_link_unlock_for(l, n * world);
        for (int r = 0; r < world && s == FS_OK; r++)
            s = fs_dequantize(acc, FS_F32, in + (size_t)(r * pb), n, bits, block, r > 0, simd);
        if (s == FS_OK && t != FS_F32)
            s = fs_cast(recv, t, acc, FS_F32, n);
        fs_link_relock(l, n * world, tok);
    }
    env->release(env->ctx, h);
    return s;
}

fs_status fs_link_quantized(fs_link *l, const fs_env *env, int gather, int bits, int64_t block,
                            const char *tag, const void *send, void *recv, int64_t count,
                            fs_dtype t)
{
    fs_comm *c = l->comm;
    l->quant = (fs_comm_quant){gather ? bits : 0, gather ? 0 : bits, block};
    if (!fs_comm_quant_check(&l->quant, c->last_error, sizeof c->last_error))
        return FS_ERR_INVALID_ARG;
    if (!fs_dtype_is_float(t) || count < 0) {
        snprintf(c->last_error, sizeof c->last_error, "a float dtype and count >= 0 needed");
        return FS_ERR_INVALID_ARG;
    }
    return gather ? fs_link_all_gather_quant(l, env, tag, send, recv, count, t)
                  : fs_link_reduce_scatter_quant(l, env, tag, send, recv, count, t);
}
