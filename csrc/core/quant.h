/* quant.h - block-wise quantization of floats for collectives that move
 * fewer bytes: int8 (weights gathered, gradients reduced) and int4
 * (gradients reduced), each block of `block` values sharing one float32
 * scale. Pure arithmetic: no Python, no engine, no backend.
 *
 * [Note: quantized payload] n values quantize into one payload:
 *   scales  ceil(n / block) float32, block k's first
 *   codes   int8: n bytes, value i at byte i;
 *           int4: ceil(n / 2) bytes, value i in byte i / 2, the low nibble
 *           for even i, two's complement
 *   padding up to a multiple of 8 bytes (FS_QUANT_ALIGN), never read
 * so that payloads of equal n laid end to end (an all-gather's output, an
 * all-to-all's chunks) keep every scale aligned. block is a positive
 * multiple of FS_QUANT_BLOCK_MULTIPLE (32: whole SIMD steps, and int4
 * blocks start on a byte) and at most FS_QUANT_BLOCK_MAX (a block's float32
 * staging fits on the stack).
 *
 * [Note: quantization rule] Symmetric, per block: qmax = 127 (int8) or 7
 * (int4); scale = absmax / qmax; code = clamp(rint(x * (1 / scale)),
 * -qmax, qmax); value = code * scale, in float32, then stored in the
 * destination dtype. A block whose values are all zero has scale 0. A block
 * holding an infinity or a NaN gets a NaN scale and zero codes: every value
 * of it comes back NaN, so that a gradient scaler still sees the overflow.
 * Values k * 2^e with |k| <= qmax in a block whose absmax is qmax * 2^e
 * come back exactly. Inputs of float16 and bfloat16 are widened to float32
 * first (exact; float64 is rounded to float32). The scalar path is the reference; the AVX2 path gives the
 * same bits (the same formula, no FMA: the build is ISO C, no contraction).
 */
#ifndef FS_QUANT_H
#define FS_QUANT_H

#include <stdint.h>

#include "fs_dtype.h"
#include "fs_status.h"
#include "reduce.h"

#define FS_QUANT_BLOCK_MULTIPLE 32
#define FS_QUANT_BLOCK_MAX 4096
#define FS_QUANT_ALIGN 8

/* Whether bits (8 or 4) and block are allowed ([Note: quantized payload]). */
int fs_quant_valid(int bits, int64_t block);

/* Bytes of the payload of n values ([Note: quantized payload]); 0 for n 0. */
int64_t fs_quant_payload_bytes(int64_t n, int bits, int64_t block);

/* payload <- n values of src (a float dtype) ([Note: quantization rule]). */
fs_status fs_quantize(void *payload, const void *src, fs_dtype t, int64_t n, int bits,
                      int64_t block, fs_simd simd);

/* dst (n of dt, a float dtype) <- the payload's values; accumulate: dst is
 * float32 and the values are added to it (acc + value, in float32). */
fs_status fs_dequantize(void *dst, fs_dtype dt, const void *payload, int64_t n, int bits,
                        int64_t block, int accumulate, fs_simd simd);

#endif
