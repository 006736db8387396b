/* reduce_rule.h - the gradient reduce rules, as torch decides them for both
 * layouts (FSDP1's flat unit, fully_shard's shard group): in which dtype
 * gradients are reduced ([Note: reduce dtype rule]), and by what a gradient
 * is divided before its collective, by the collective itself and after it,
 * and what a held reduce output has been divided by when a hook reads it
 * ([Note: divide rule]).
 *
 * Pure arithmetic on sizes and dtypes: no buffers, no Python, no device.
 * Both engines (engine/unit_reduce.c, engine/shard_group_reduce.c) and Python (through
 * _C.grad_divide and _C.reduce_dtype) take their factors and reduce dtypes
 * from here and from nowhere else.
 *
 * [Note: reduce dtype rule] A reduce dtype that is set (FSDP1's
 * MixedPrecision.reduce_dtype, fully_shard's MixedPrecisionPolicy.reduce_dtype)
 * is the reduce dtype. Unset, one of two rules decides:
 *
 *  FS_REDUCE_IN_COMPUTE ("param_dtype"): FSDP1 under every torch, and
 *    fully_shard up to torch 2.14 (_fsdp_param.py, init_dtype_attrs): the
 *    compute dtype (param_dtype when set, else the parameter's own), the
 *    dtype the gradients arrive in.
 *  FS_REDUCE_IN_GRAD ("grad_dtype"): fully_shard from torch 2.15
 *    (_fsdp_param_group.py, _get_reduce_dtype): each parameter's
 *    accumulation dtype (its grad_dtype; unset, its own dtype: float32 for a
 *    float32 parameter under param_dtype=bfloat16), whatever the compute
 *    dtype, promoted over the group as torch.promote_types promotes floats
 *    (the wider one; float16 with bfloat16 gives float32).
 *
 * Which rule fully_shard follows is the installed torch's: Python reads it
 * (flatshard/torch_facts.py, reduce_dtype_rule) and passes it in. The
 * accumulation without sync ([Note: accumulation dtype] in fsdp2/param.py)
 * sums in the reduce dtype the rule gives, under either rule.
 *
 * [Note: divide rule] A gradient averaged over N ranks (the shard group's
 * size times the replicas' under HSDP) is divided by N, or by the factor a
 * user set (fully_shard's set_gradient_divide_factor):
 *
 *  FSDP1 (torch's _init_utils / default_hooks._get_gradient_predivide_factor):
 *    every dtype: pre = p, doubled from 1 while p divides N and N / p > p
 *    (about sqrt(N); 2 for N = 3, where the last doubling no longer
 *    divides), post = N / pre; the sum runs undivided (ReduceOp.SUM)
 *    between them.
 *  fully_shard (torch's _fully_shard/_fsdp_collectives.py,
 *  _get_gradient_divide_factors):
 *    float32 and bfloat16 reduce dtypes, unless sums are forced
 *    (set_force_sum_reduction_for_comms): the collective divides
 *    (ReduceOp.AVG, or PREMUL_SUM(1 / factor) for a set factor; a plain sum
 *    on one rank without a factor): in_comm = factor or N.
 *    Other dtypes (float16, float64: they can overflow or underflow), and any
 *    dtype under forced sums: f = factor or N; pre = the power of two above
 *    for float16/float64, else 1; post = f / pre.
 *
 * The all-reduce hook (fully_shard's set_all_reduce_hook) runs between the
 * collective and the post divide, so it reads the sum divided by pre *
 * in_comm: that is `hold`.
 *
 * Divides happen in the reduce dtype, in that order (as torch's in-place
 * div_), so a float16 gradient near its subnormal range loses the bits torch
 * loses and no others. torch 2.11 and 2.13 apply the same rule. One case is
 * torch's alone: a fully_shard group on one rank with a set factor divides by
 * it again in the copy that stands in for the reduce-scatter (so float16
 * divides by the factor twice); the rule divides once, by the factor. */
#ifndef FS_REDUCE_RULE_H
#define FS_REDUCE_RULE_H

#include "fs_dtype.h"
#include "fs_status.h"

typedef enum {
    FS_DIVIDE_FLAT = 0,        /* FSDP1's flat unit */
    FS_DIVIDE_FULLY_SHARD = 1, /* fully_shard's shard group */
} fs_divide_api;

typedef struct {
    double pre;     /* the gradient (in the reduce dtype) divided by it before the collective */
    double in_comm; /* the collective's sum divided by it (ReduceOp.AVG / PREMUL_SUM) */
    double post;    /* the collective's output divided by it after (and after a hook) */
    double hold;    /* pre * in_comm: what a hook's reduce output is divided by */
} fs_divide;

/* shard_world >= 1; replicate_world >= 1 (1: no replicas). factor: 0 to
 * average, else > 0 (fully_shard only). force_sum: fully_shard only.
 * In *out, 1 means "no divide". */
fs_status fs_divide_rule(fs_divide_api api, fs_dtype reduce, int shard_world,
                         int replicate_world, double factor, int force_sum, fs_divide *out);

/* Whether the post divide can be fused into the cast of a reduce output
 * (reduce dtype) into a gradient of dtype out (added to it when accumulate)
 * with no bit changed: the same dtype, and an add that rounds the product as
 * the reduce dtype does (float32, float64). Else the divide runs in place
 * in the reduce dtype first, as torch's does. */
int fs_divide_fuses(fs_dtype out, fs_dtype reduce, int accumulate);

typedef enum {
    FS_REDUCE_IN_COMPUTE = 0, /* "param_dtype": the compute dtype */
    FS_REDUCE_IN_GRAD = 1,    /* "grad_dtype": the accumulation dtypes, promoted */
} fs_reduce_dtype_rule;

/* [Note: reduce dtype rule]. set: the reduce dtype given, or FS_DTYPE_COUNT
 * for none. compute: the group's compute dtype. accumulate[0..n): each
 * parameter's accumulation dtype (n >= 1 under FS_REDUCE_IN_GRAD). Every
 * dtype given must be a float. */
fs_status fs_reduce_dtype(fs_reduce_dtype_rule rule, fs_dtype set, fs_dtype compute,
                          const fs_dtype *accumulate, int n, fs_dtype *out);

#endif
