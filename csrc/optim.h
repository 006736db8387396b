/* optim.h - fused optimizer steps over flat fp32 buffers on the CPU.
 *
 * One pass over (param, grad, state...) per step: the loop is memory-bound,
 * so fusing every elementwise op of the update into one read and one write
 * of each buffer is the whole game. Math is f32, elementwise, in the order
 * torch's single-tensor implementations use (tests hold it to ~1e-6 relative
 * after many steps). Optionally the same pass writes a bf16/fp16 copy of the
 * updated parameters (the low-precision weights of mixed precision/offload).
 *
 * SIMD level is chosen at run time (reduce.h's fs_simd); the scalar path is
 * the reference. Large buffers are split over `threads` POSIX threads; the
 * caller releases the GIL. Indices are 64-bit.
 */
#ifndef FS_OPTIM_H
#define FS_OPTIM_H

#include <stdint.h>
#include "fs_dtype.h"
#include "fs_status.h"
#include "reduce.h"

typedef struct {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;      /* already incremented: 1 on the first update */
    int decoupled;     /* 1: AdamW (decay the parameter); 0: Adam (L2 into the gradient) */
    int maximize;
} fs_adam_hparams;

typedef struct {
    float *param;          /* (n) updated in place */
    const float *grad;     /* (n) */
    float *exp_avg;        /* (n) */
    float *exp_avg_sq;     /* (n) */
    float *max_exp_avg_sq; /* (n) amsgrad, or NULL */
    void *copy;            /* (n) low-precision copy of the updated param, or NULL */
    fs_dtype copy_dtype;   /* FS_BF16 or FS_F16 when copy != NULL */
    int64_t n;
} fs_adam_buffers;

fs_status fs_adam_step(const fs_adam_buffers *b, const fs_adam_hparams *h, fs_simd simd,
                       int threads);

typedef struct {
    float lr, momentum, dampening, weight_decay;
    int nesterov, maximize;
    int first_step; /* momentum buffer is initialised to the gradient (torch's rule) */
} fs_sgd_hparams;

typedef struct {
    float *param;
    const float *grad;
    float *momentum_buf; /* NULL when momentum == 0 */
    void *copy;
    fs_dtype copy_dtype;
    int64_t n;
} fs_sgd_buffers;

fs_status fs_sgd_step(const fs_sgd_buffers *b, const fs_sgd_hparams *h, fs_simd simd, int threads);

#endif
