/* engine.h - what the engine needs from the program around it:
 * FSDP1 units (unit.h) and fully_shard shard groups (shard_group.h) alike.
 *
 * The engine (unit.c, unit_reduce.c, shard_group.c) owns sharding: it gathers,
 * frees, reduces and defers, for every strategy and both layouts, on the
 * host and through a device table (fs_device.h). It holds no Python object
 * and includes no Python header. What only the host program can do (give a
 * tensor's storage its bytes, hand out memory for one operation, keep an
 * object alive) comes through one fs_env table given when a unit is made:
 * the C over torch objects fills it with torch calls (hooks/env.c), the C
 * driver test (tests/engine/driver.c) with malloc.
 *
 * Handles: the engine never looks inside one. A tensor handle stands for a
 * tensor the host owns (a shard, an unsharded buffer, a gradient passed in);
 * a storage handle for the storage whose bytes come and go; a taken handle
 * for memory from env->take. The engine gives each handle it was lent back
 * through env->release exactly once, at the end of the call, or when a
 * deferred collective that uses it has been waited for.
 *
 * Threads: every env entry is called on the calling thread, as the engine
 * call itself was. A link may carry an unlock/lock pair (the glue's: the
 * GIL): the engine unlocks around collectives and long host loops only, so
 * the env entries and the glue's short steps run without handing it back
 * and forth.
 */
#ifndef FS_ENGINE_H
#define FS_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "fs_device.h"
#include "fs_dtype.h"
#include "fs_status.h"
#include "ledger.h"

/* FS_ERR_HOST: an env entry failed and reported in its own way (the glue
 * leaves a Python exception set); the engine adds no text of its own. */
#define FS_ERR_HOST FS_ERR_PYTHON

typedef struct {
    void *ctx;
    /* A tensor handle's current data pointer (it can change between calls:
     * a model moved, a state dict loaded with assign). */
    fs_status (*data)(void *ctx, void *tensor, void **ptr);
    /* Give `storage` nbytes (0: take them away); *data: where they are now. */
    fs_status (*set_storage)(void *ctx, void *storage, int64_t nbytes, void **data);
    /* nbytes (at least one) of memory on the unit's device (FS_TAKE_* flags);
     * *handle owns it until released. */
    fs_status (*take)(void *ctx, int64_t nbytes, unsigned flags, void **data, void **handle);
    /* Hand a handle back (taken memory; a tensor lent to a deferred call). */
    void (*release)(void *ctx, void *handle);
    /* An extra reference to a tensor handle, to hold it past the call. */
    void *(*hold)(void *ctx, void *tensor);
} fs_env;

enum {
    FS_TAKE_ZERO = 1,      /* zero-filled */
    FS_TAKE_TRANSIENT = 2, /* given back within the call (host: from the pool) */
    FS_TAKE_STAGING = 4,   /* given back at a later call in the same backward, a bucket's
                              flush (host: from the pool, not the heap) */
};

/* [Note: quantized collectives] A group's gathers and reductions can move
 * block-quantized payloads instead of the compute and reduce dtypes
 * (quant.h): the setting is handed to the engine once per group
 * (fs_group_set_quant) and every gather and reduction of that group on
 * its shard link reads it; nothing above the engine chooses per call.
 *   gathers (weight_bits 8): each rank quantizes the all-gather input (its
 *     shard in the compute dtype), one all-gather moves the payloads, and
 *     each rank dequantizes every rank's payload, its own too, into the
 *     output: all ranks compute with the same values. The master shard is
 *     never touched; gathers for a full-precision copy (summon, state
 *     dicts) stay exact.
 *   reductions (grad_bits 8 or 4): each rank quantizes the block it sends to
 *     each rank, one all-to-all moves them, and each rank sums the blocks
 *     it received in float32, in rank order, into the reduce-scatter's
 *     output (qgZ's order: every value is quantized once, never again per
 *     hop). The divides around the collective ([Note: divide rule]) are
 *     the same; only the sum changes.
 * Host links only: a device link's groups refuse the setting. A quantized
 * collective is issued at once, never coalesced into a host batch or
 * bucket (its payload is packed by the engine already). HSDP's all-reduce
 * across replicas is not quantized. */
typedef struct {
    int weight_bits;  /* 0: gathers move the compute dtype; 8 */
    int grad_bits;    /* 0: reductions move the reduce dtype; 8 or 4 */
    int64_t block;    /* values per float32 scale (quant.h's rules) */
} fs_comm_quant;

typedef struct fs_gather_batch fs_gather_batch;   /* below */
typedef struct fs_reduce_bucket fs_reduce_bucket;

/* A group of ranks as the engine sees it: the backend, its ledger (may be
 * NULL), the device table (NULL: host memory), the caller's stream the
 * host bound for this call (fs_device.h: set_caller_stream), and what the
 * engine releases around blocking or long work (NULL: nothing). */
typedef struct {
    fs_comm *comm;
    fs_ledger *ledger;
    const fs_device_api *dev;
    void *stream;
    void *(*unlock)(void);     /* returns what lock() takes back */
    void (*lock)(void *saved);
    fs_gather_batch *batch;    /* host: all-gathers join it ([Note: coalesced gathers]) */
    fs_reduce_bucket *bucket;  /* host: reduce-scatters join it ([Note: reduction buckets]) */
    fs_comm_quant quant;       /* [Note: quantized collectives]; zeros: none */
    /* [Note: bytes sent] what this rank put into the collectives issued on
     * this link that succeeded: an all-gather's count, a reduce-scatter's or
     * an all-to-all's whole input (world_size blocks), an all-reduce's
     * buffer, in bytes; gathers and reductions (reduce-scatter, all-reduce,
     * all-to-all) apart. The payloads, not the dtype they stand for. */
    unsigned long long sent_gather_bytes, sent_reduce_bytes;
} fs_link;

/* [Note: bytes sent]: a collective of op that succeeded on l, counted. */
static inline void fs_link_count_sent(fs_link *l, fs_ledger_op op, int64_t count, fs_dtype t)
{
    const unsigned long long b = (unsigned long long)count * fs_dtype_size(t);
    if (op == FS_LOP_ALL_GATHER)
        l->sent_gather_bytes += b;
    else if (op == FS_LOP_REDUCE_SCATTER || op == FS_LOP_ALL_TO_ALL)
        l->sent_reduce_bytes += b * (unsigned long long)l->comm->world_size;
    else if (op == FS_LOP_ALL_REDUCE)
        l->sent_reduce_bytes += b;
}

/* Host loops shorter than this many elements keep the lock (releasing it
 * costs more than they take). */
#define FS_UNLOCK_NUMEL (1 << 16)

/* Run a collective on a link, recorded in its ledger under `tag`: the
 * only way a collective is issued, by the engine and by the glue's Comm
 * alike. The lock is handed back around it, unless the backend calls into
 * the host's interpreter itself (comm.h: needs_gil). */
#define FS_LINK_RUN(link, s, op, tag, count, dtype, expr)                                   \
    do {                                                                                  \
        fs_link *fs_l_ = (link);                                                          \
        const int fs_unl_ = fs_l_->unlock && !fs_l_->comm->ops->needs_gil;                \
        uint64_t fs_seq_ = fs_l_->ledger ? fs_ledger_issue(fs_l_->ledger, op, tag, count, \
                                                           dtype)                         \
                                         : 0;                                             \
        fs_l_->comm->what = (tag);                                                        \
        void *fs_tok_ = fs_unl_ ? fs_l_->unlock() : NULL;                                 \
        s = (expr);                                                                       \
        if (fs_unl_)                                                                      \
            fs_l_->lock(fs_tok_);                                                         \
        if (s == FS_OK)                                                                   \
            fs_link_count_sent(fs_l_, op, count, dtype);                                  \
        fs_l_->comm->what = NULL;                                                         \
        if (fs_l_->ledger)                                                                \
            fs_ledger_finish(fs_l_->ledger, fs_seq_, s, fs_l_->dev != NULL);              \
    } while (0)

/* ---------------------------------------------------------------------------
 * [Note: coalesced gathers] Every collective costs a fixed time per call,
 * however few bytes it moves: a barrier on shared memory (microseconds),
 * a round of messages through gloo (about a millisecond on one host, more
 * across hosts). Small units pay it more often than they compute. So on
 * the host, the gathers of several units in one engine call (a unit's own
 * and the ones prefetched with it) go in one all-gather. While a batch
 * is set on a link, fs_link_all_gather records the call (its buffers must
 * stay put until the flush) instead of issuing it; fs_gather_batch_flush
 * then copies every part's send into this rank's block of one buffer,
 * all-gathers the blocks in place, and copies each rank's piece of each
 * part to recv + rank * part bytes (comm.h's rule). What reads a recorded
 * gather's output waits for the flush (shard_group.c's copy-out). Each rank must
 * batch the same parts in the same order: the callers decide batches from
 * the forward order, which every rank shares. Device links never batch
 * (NCCL's own grouping is the tool there). */
#define FS_BATCH_MAX_PARTS 256

/* One collective recorded in a batch or a bucket (below). */
typedef struct {
    const void *send;
    void *recv;
    int64_t size;         /* a batch's: per-rank bytes; a bucket's: recv elements */
    void *owner;          /* a bucket's: its fs_bucket_owner (group.h) */
} fs_coalesced_part;

struct fs_gather_batch {
    fs_coalesced_part part[FS_BATCH_MAX_PARTS];
    int nparts;
    int64_t nbytes;       /* per rank, all parts */
    fs_dtype dtype;       /* the parts' dtype; FS_U8 once they differ */
    const char *what;     /* the first part's name (the ledger's unit) */
};

/* An all-gather on l (comm.h's rules): recorded into l->batch when one is
 * set on a host link, else issued now, under `what` in the ledger.
 * FS_ERR_INVALID_ARG with comm->last_error when a batch is full. */
fs_status fs_link_all_gather(fs_link *l, const char *what, const void *send, void *recv,
                             int64_t count, fs_dtype t);
/* Issue the batch's parts as one all-gather on l (staging from env->take)
 * and empty it. A failure's words are in l->comm->last_error. */
fs_status fs_gather_batch_flush(fs_gather_batch *b, fs_link *l, const fs_env *env);

/* [Note: reduction buckets] The same for gradient reductions, across
 * engine calls: while a bucket is set on a host link, fs_link_reduce_scatter
 * records the call with its owner (group.h's fs_bucket_owner: how the engine
 * object that made it finishes it)
 * instead of issuing it, and the caller holds its send and recv buffers
 * (as for a deferred reduction on a device) until the host flushes the
 * bucket: every part's rank-r block is copied into rank r's block of one
 * buffer, one reduce-scatter (a sum, so each element adds the same values in
 * the same order as alone: the bits do not change) lands this rank's block,
 * and each part's piece is copied to its recv. Then each owner finishes
 * (group.h: fs_group_flush_bucket). Parts share one dtype; the host decides
 * when to flush (a byte budget, the end of backward) from events every rank
 * sees in the same order. */
struct fs_reduce_bucket {
    fs_coalesced_part part[FS_BATCH_MAX_PARTS]; /* send: world_size * size, recv: size */
    int nparts;
    int64_t count;          /* per rank, all parts, elements */
    fs_dtype dtype;
    const char *what;       /* the first part's name (its owner keeps it) */
};

/* A summing reduce-scatter on l (comm.h's rules): recorded into l->bucket
 * with `owner` when one is set on a host link, else issued now.
 * FS_ERR_INVALID_ARG with comm->last_error when the bucket is full or holds
 * another dtype. */
fs_status fs_link_reduce_scatter(fs_link *l, const char *what, const void *send, void *recv,
                                 int64_t recv_count, fs_dtype t, void *owner);
/* Issue the bucket's parts as one reduce-scatter on l (staging from
 * env->take); the owners are left for the caller to finish, the bucket for
 * it to empty. A failure's words are in l->comm->last_error. */
fs_status fs_reduce_bucket_flush(fs_reduce_bucket *b, fs_link *l, const fs_env *env);

/* [Note: quantized collectives]: an all-gather (comm.h's rule, never in
 * place in the payload's sense: send may lie inside recv) whose payloads
 * are l->quant.weight_bits codes, and a summing reduce-scatter whose blocks
 * travel as l->quant.grad_bits codes through an all-to-all; staging from
 * env->take, issued at once under `what` in the ledger. Host links. */
fs_status fs_link_all_gather_quant(fs_link *l, const fs_env *env, const char *what,
                                   const void *send, void *recv, int64_t count, fs_dtype t);
fs_status fs_link_reduce_scatter_quant(fs_link *l, const fs_env *env, const char *what,
                                       const void *send, void *recv, int64_t recv_count,
                                       fs_dtype t);
/* Whether q is a setting the engine takes (quant.h's bits and block); on
 * failure its words in err. */
int fs_comm_quant_check(const fs_comm_quant *q, char *err, size_t cap);
/* One of them as the host's Comm issues it on l (its quantized()): the
 * all-gather with `bits` codes (gather), else the reduce-scatter; the
 * setting, a float dtype and count >= 0 checked first (FS_ERR_INVALID_ARG,
 * the words in the comm's last_error). */
fs_status fs_link_quantized(fs_link *l, const fs_env *env, int gather, int bits, int64_t block,
                            const char *tag, const void *send, void *recv, int64_t count,
                            fs_dtype t);

/* Host loops over n values: the lock handed back around them when they are
 * long (n >= FS_UNLOCK_NUMEL); fs_link_relock takes it again with the same n. */
void *fs_link_unlock_for(const fs_link *l, int64_t n);
void fs_link_relock(const fs_link *l, int64_t n, void *tok);

/* copy.h's fs_cast / fs_scale_accumulate: the host loops, or the link's
 * device kernels enqueued on `stream` (a failure's words in comm->last_error). */
fs_status fs_link_cast(const fs_link *l, void *stream, void *dst, fs_dtype dt, const void *src,
                       fs_dtype st, int64_t n);
/* fs_link_cast of height rows of width elements at element pitches. */
fs_status fs_link_cast2d(const fs_link *l, void *stream, void *dst, int64_t dst_pitch,
                         fs_dtype dt, const void *src, int64_t src_pitch, fs_dtype st,
                         int64_t width, int64_t height);
fs_status fs_link_scale_accumulate(const fs_link *l, void *stream, void *dst, fs_dtype dt,
                                   const void *src, fs_dtype st, int64_t n, double scale,
                                   int accumulate);

/* [Note: divide rule] in reduce_rule.h, after the collective: src (n of
 * st, the reduce dtype) divided by what the rule left (`post`; 1: nothing)
 * and scaled by `scale` (a divide the collective itself would make: fused,
 * as the collective would round it), then cast into dst (dt), added to it
 * when accumulating; src == dst: in place. The post divide runs in st
 * before the cast, as torch's does, unless fs_divide_fuses says fusing it
 * into the cast changes no bits. */
fs_status fs_link_divide_out(const fs_link *l, void *stream, void *dst, fs_dtype dt, void *src,
                             fs_dtype st, int64_t n, double scale, double post, int accumulate);

/* bfloat16/float16 reductions on a device stage through float32 (comm.h):
 * lend the link's backend count floats for the next collective (*h owns
 * them; NULL and nothing lent on the host or for other dtypes). After the
 * collective, unlend, and release *h: at once when the caller's stream
 * waits for the collective, after it was waited for when deferred. */
fs_status fs_link_lend(const fs_env *env, const fs_link *l, fs_dtype t, int64_t count,
                       void **h);
void fs_link_unlend(const fs_link *l);

/* One of the six collectives (op; comm.h's rules for the buffers: count is
 * recv_count for a reduce-scatter, send the one buffer of the in-place ones,
 * average for the reductions, root for a broadcast) as the host's Comm
 * issues it on l: recorded in the ledger (FS_LINK_RUN), float32 staging
 * lent to a device's bfloat16/float16 reduction and given back after it
 * (the caller's stream waits for the collective: the allocator reuses the
 * staging in that stream's order). */
fs_status fs_link_collective(fs_link *l, const fs_env *env, fs_ledger_op op, const char *tag,
                             void *send, void *recv, int64_t count, fs_dtype t, int average,
                             int root);

/* A list of handles held until a deferred collective is waited for. */
typedef struct {
    void **h;
    int n, cap;
} fs_held;

int fs_held_add(fs_held *l, void *h);             /* -1: out of memory */
void fs_held_release(fs_held *l, const fs_env *env); /* release all, keep capacity */
void fs_held_free(fs_held *l, const fs_env *env);

#endif
