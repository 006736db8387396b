/* shard_group.h - the engine's fully_shard group: parameters sharded on dim 0
 * (torch FSDP2's per-parameter layout, layout.h DIM0), gathered with one
 * all-gather into one unsharded buffer and reduced with one reduce-scatter.
 *
 * Layout: parameter i is cut on dim 0 into chunks of ceil(dim0 / world)
 * rows; rank r's all-gather input (its block) holds its chunk of every
 * parameter, each padded to the common row count. The unsharded buffer holds
 * every parameter whole, each starting at a multiple of the alignment.
 * Gather: each local shard is cast into this rank's block of the gathered
 * buffer (the compute dtype), the blocks are all-gathered in place, and
 * each rank's rows copied out into the unsharded buffer. Reduce: every
 * rank's rows of each unsharded gradient are cast into that rank's block of
 * the reduce-scatter input (the reduce
 * dtype), divided before, in and after the collective as torch's fully_shard
 * divides ([Note: divide rule] in reduce_rule.h: the mean, or the divide
 * factor the user set), reduce-scattered (summed), summed across replicas
 * (HSDP) and cast into each sharded gradient, added to what is there when
 * asked.
 *
 * Parameters whose tensor class gathers for itself (torch's extension
 * protocol: flatshard/fsdp2/extension.py) have no room in the block nor the
 * unsharded buffer; their gradients take the reduce-scatter with the rest.
 *
 * The same code runs on the host and on a device (the link's table): every
 * copy is a cast of a contiguous range; a block's padding is never read
 * (the gathered buffer is not kept between gathers). On a device a gather
 * can be deferred (a prefetch: the copy-out waits for fs_shard_wait, [Note:
 * gather mark] in group.h) and so can a reduction (the steps after the
 * collective wait for fs_shard_finish_reduce).
 *
 * [Note: reduce output] A reduction is the reduce-scatter into this rank's
 * block (rs_out: block_numel elements of the reduce dtype, each parameter's
 * rows at its block_offset), then `collect` (HSDP: the replicas' all-reduce,
 * or without it the partial sum below), then `write_grads` (the scale, each
 * sharded gradient). A held reduction (FS_SHARD_HOLD) stops between the two
 * with rs_out divided by the rule's `hold` (all that torch has divided by
 * when its all-reduce hook runs), so that the host can read and change it;
 * fs_shard_finish_reduce divides by the rest (`post`) and writes.
 * HSDP without the all-reduce (torch's requires_all_reduce=False) adds
 * rs_out, a plain sum, into `partial`, kept across reductions, and writes
 * nothing; the next reduction that all-reduces adds `partial` to its rs_out
 * first and lets it go.
 *
 * [Note: direct layout] Where the layout leaves nothing to rearrange, no
 * buffer stands between a parameter and its collective. With one rank in
 * the shard group (world 1, or HSDP's replicate dim alone) the unsharded
 * parameters are the shards: a gather issues nothing, the host's unsharded
 * parameters alias the shards (`aliased`), or under another compute dtype
 * each shard is cast straight into the unsharded buffer; a reduction sums
 * each gradient across the replicas in place (one all-reduce per gradient:
 * autograd hands each gradient over in a tensor of its own, so only a
 * staging copy could make them one flat buffer) and scales it into the
 * sharded gradient, in place when the host passes the gradient itself as
 * the output. A group of one Shard(0) parameter that splits evenly, with
 * no padding in its block, is its own all-gather output and reduce-scatter
 * input: the rows are gathered straight into the unsharded buffer from the
 * shard, and the gradient is reduce-scattered from where autograd left it.
 * With more parameters each rank's rows of every parameter lie together in
 * its block ((world, -1) rows), so the copies stay.
 *
 * [Note: copy counts] copied_bytes counts the bytes every copy writes, by
 * kind: a same-dtype copy into the all-gather input (COPY_IN), out of the
 * all-gather output (COPY_OUT), into the reduce-scatter input (REDUCE_IN),
 * out of the reduce output into a sharded gradient written anew
 * (REDUCE_OUT), and any copy that changes the dtype (CAST: mixed
 * precision needs those). Adding the reduce output onto a gradient that is
 * there is arithmetic the result needs, not a copy; the host's coalescing
 * of several groups' collectives into one (engine.h) packs on its own. */
#ifndef FS_SHARD_GROUP_H
#define FS_SHARD_GROUP_H

#include "engine.h"
#include "group.h"
#include "layout.h"
#include "reduce_rule.h"

typedef struct {
    /* the parameter viewed as (outer, dim0, row_numel), sharded on dim0: its
     * first dim (outer 1), or a later one (Shard(d): outer is the product
     * of the dims before d). A rank's rows are then `outer` runs apart in
     * the unsharded tensor, and one contiguous range in its shard and its
     * block, whose entries count outer * row_numel elements per row. */
    int64_t outer, dim0, row_numel;
    int gathered;         /* 0: its class gathers it (an extension) */
    int64_t full_offset;  /* its start in the unsharded buffer, elements */
    void *shard;          /* tensor handle: this rank's rows, contiguous */
    fs_dtype shard_t;     /* its dtype */
} fs_shard_param;

enum {
    FS_SHARD_COPY_IN,
    FS_SHARD_COPY_OUT,
    FS_SHARD_REDUCE_IN,
    FS_SHARD_REDUCE_OUT,
    FS_SHARD_CAST,
    FS_SHARD_NCOPY,
};

typedef struct {
    fs_group_core core;      /* name, links, live buffer, marks, counts, failure (group.h) */
    int nparams;
    fs_shard_param *params;
    fs_dim0_entry *entries;  /* world x nparams: each rank's entries (reduce layout) */
    fs_dim0_entry *gentries; /* nparams: this rank's gather entries (extensions: no rows) */
    int64_t block_numel, gather_block_numel;
    int64_t full_alloc;      /* the unsharded buffer, elements of compute */
    fs_dtype compute, reduce;
    void *full;              /* tensor handle of the unsharded buffer (NULL until set) */
    void *storage;           /* its storage handle */
    /* [Note: direct layout]: one rank, every gathered shard in the compute
     * dtype (set with the shards): the unsharded parameters are the shards */
    int aliased;
    /* [Note: kept storage] torch 2.15's set_keep_unsharded_storage: a reshard
     * leaves the unsharded buffer's storage allocated, so its data pointer
     * (and every unsharded parameter's) is the same at the next gather, which
     * refills it in place (for CUDA graph capture); memory_stats counts it
     * as unsharded bytes while it is kept */
    int keep_storage;
    /* a pending gather (core.gather_pending): the copy-out waits for the mark */
    void *gathered, *gathered_h;
    /* a reduction left to finish (core.reduce_pending) [Note: reduce output]:
     * deferred (what follows the reduce-scatter waits for core.reduce_event),
     * or held */
    int reduce_deferred;
    int in_bucket;           /* its reduce-scatter waits in a host bucket (not issued) */
    fs_bucket_owner bucket_owner; /* the bucket part's owner then (group.h) */
    int all_reduce;          /* HSDP: this reduction all-reduces (0: into partial) */
    int held;                /* held after collect, rs_out divided by divide.hold */
    fs_divide divide;        /* this reduction's factors ([Note: divide rule]) */
    void *rs_in_h, *rs_out, *rs_out_h, *ws_h;
    void *partial, *partial_h; /* HSDP: (block_numel) reduce dtype, kept across reductions */
    void **outs;             /* nparams tensor handles (held) or NULL */
    fs_dtype *out_t;
    int *accumulate;
    unsigned long long copied_bytes[FS_SHARD_NCOPY]; /* [Note: copy counts] */
} fs_shard_group;

/* outer[i] (NULL: all 1), dim0[i], row_numel[i], gathered[i] (not 0: the
 * parameter is gathered into the unsharded buffer) for nparams
 * parameters; align: every parameter's start in the block and the unsharded
 * buffer, in elements. */
fs_status fs_shard_init(fs_shard_group *g, const char *name, fs_env env, fs_link link,
                       fs_link replicate, int nparams, const int64_t *outer,
                       const int64_t *dim0, const int64_t *row_numel, const int64_t *gathered,
                       int64_t align, fs_dtype compute, fs_dtype reduce);
void fs_shard_destroy(fs_shard_group *g);

/* The local shards (tensor handles and dtypes, nparams), and the unsharded
 * buffer (tensor and storage handles), set again after the host moved them.
 * After set_shards, `aliased` says whether the host's unsharded parameters
 * must be the shards themselves [Note: direct layout]. A new unsharded
 * buffer is not gathered. Both must be set before a gather. */
void fs_shard_set_shards(fs_shard_group *g, void *const *shards, const fs_dtype *shard_t);
void fs_shard_set_full(fs_shard_group *g, void *full, void *storage);

/* One all-gather of every rank's block, then the copy-out into the
 * unsharded buffer (given its storage first). defer: a device prefetch. A
 * no-op when gathered, but for waiting on a prefetch unless this is one too. */
fs_status fs_shard_unshard(fs_shard_group *g, int defer);
/* g (when own) and the groups in along (the same host comm) gathered in one
 * all-gather (group.h: fs_group_unshard_along chooses which join: not
 * gathered, within the batch's parts), each copied out after it. On
 * failure none is left marked gathered and *failed is the index in along of
 * the group whose err says why, or -1 for g. */
fs_status fs_shard_unshard_along(fs_shard_group *g, int own, fs_shard_group *const *along,
                                 int n, int *failed);
/* The caller's stream waits for a pending gather, then its copy-out
 * ([Note: gather mark]). */
fs_status fs_shard_wait(fs_shard_group *g);
/* int reshard_after_forward: the unsharded buffer gathered again over a
 * smaller group `post`, from the 1/post-size chunk this rank kept (tensor
 * handle, full_alloc / post world elements of compute). */
fs_status fs_shard_unshard_from(fs_shard_group *g, fs_link *post, void *chunk);
fs_status fs_shard_reshard(fs_shard_group *g);
/* [Note: kept storage]: keep (1) or free (0) the unsharded storage at each
 * reshard from now on; 0 on a resharded group frees what was kept. */
fs_status fs_shard_set_keep_storage(fs_shard_group *g, int keep);

enum {
    FS_SHARD_DEFER = 1,         /* a device: what follows the collective waits for finish */
    FS_SHARD_NO_ALL_REDUCE = 2, /* HSDP: into the partial sum, nothing written */
    FS_SHARD_HOLD = 4,          /* stop for a hook before the sharded gradients */
    FS_SHARD_FORCE_SUM = 8,     /* torch's set_force_sum_reduction_for_comms(True) */
    FS_SHARD_RESHARD = 16,      /* then free the unsharded buffer (post-backward, whole) */
};

/* grads[i]: the unsharded gradient (tensor handle, dtype grad_t[i], the
 * parameter's shape) or NULL; outs[i]: the sharded gradient to write
 * (out_t[i], this rank's rows) or NULL; accumulate[i]: add to it. factor >
 * 0: divide the sum by it, else average. FS_SHARD_HOLD: stop before the
 * sharded gradients with rs_out divided by the rule's hold (reduce_pending;
 * ignored with FS_SHARD_NO_ALL_REDUCE, which writes nothing). flags:
 * FS_SHARD_*. bucket (a host link; NULL: none): the reduce-scatter joins it
 * with g->bucket_owner as its owner ([Note: reduction buckets] in engine.h),
 * and the rest waits for its flush (group.h: fs_group_flush_bucket). */
fs_status fs_shard_reduce(fs_shard_group *g, void *const *grads, const fs_dtype *grad_t,
                          void *const *outs, const fs_dtype *out_t, const int *accumulate,
                          double factor, unsigned flags, fs_reduce_bucket *bucket);
/* A deferred reduction: the stream waits for its reduce-scatter, then
 * collect is enqueued; a held rs_out is then ready on the stream. */
fs_status fs_shard_wait_reduce(fs_shard_group *g);
/* What is left of a reduction: the wait, collect, write. */
fs_status fs_shard_finish_reduce(fs_shard_group *g);
/* A held reduction's reduce output once collected ([Note: reduce output]):
 * its data (block_numel elements of the reduce dtype, *nbytes) and the
 * handle that owns it (*owner, taken from the host); NULL when none is. */
void *fs_shard_reduce_output(const fs_shard_group *g, int64_t *nbytes, void **owner);
/* Forget the HSDP partial sum (an iteration given up: reset_iter_state). */
void fs_shard_drop_partial(fs_shard_group *g);
/* Whether an HSDP partial sum is kept (reductions without the all-reduce
 * since the last one with it). */
int fs_shard_has_partial(const fs_shard_group *g);

/* Without gradient sync, an unsharded gradient kept as a reduce-dtype sum
 * across backwards: dst (tensor handle, dst_t) = (add ? dst : 0) + src
 * (src_t), n elements, on the link's host loops or device stream. */
fs_status fs_shard_accumulate(fs_shard_group *g, void *src, fs_dtype src_t, void *dst,
                             fs_dtype dst_t, int64_t n, int add);

#endif
