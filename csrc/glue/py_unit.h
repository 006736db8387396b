/* py_unit.h - what the two halves of flatshard._C.Unit share: py_unit.c
 * (the type, gathers, resharding) and py_unit_reduce.c (gradient
 * reductions). See py_unit.c for how memory and streams are handled. */
#ifndef FS_PY_UNIT_H
#define FS_PY_UNIT_H

#include "fs_py.h"
#include "unit_fsm.h"

/* [Note: mixed precision] With a compute dtype other than the parameters'
 * (MixedPrecision.param_dtype), the shard stays the full-precision master and
 * forward/backward run on `lp`: the shard is cast in one pass into lp_shard
 * and that is all-gathered, so the collective moves the low-precision bytes.
 * `full` (full precision) is gathered only on request (summon_full_params,
 * state dicts). Gradients arrive in the compute dtype, are reduced in the
 * reduce dtype and accumulated into the full-precision shard gradient. */
typedef struct {
    PyObject *shard;      /* 1-D tensor, shard_numel: the local shard (persistent) */
    PyObject *full;       /* 1-D tensor, padded_numel; the shard itself under NO_SHARD */
    PyObject *storage;    /* full.untyped_storage() */
    PyObject *lp;         /* padded_numel in the compute dtype, or NULL */
    PyObject *lp_storage; /* lp.untyped_storage() */
    int64_t shard_numel;
    int64_t padded_numel;
    fs_dtype dtype;       /* parameters, shard, full, shard gradient */
    fs_dtype compute;     /* lp's dtype (== dtype without mixed precision) */
    fs_dtype reduce;      /* gradient reduction dtype */
    void *lp_shard;       /* shard_numel in the compute dtype: all-gather input */
    void *red_out;        /* shard_numel in the reduce dtype, when it differs from dtype */
    PyObject *lp_shard_t; /* the tensors holding lp_shard / red_out on a device */
    PyObject *red_out_t;
} unit_group;

typedef struct {
    PyObject_HEAD
    fs_unit_cfg cfg;
    fs_unit_fsm fsm;
    PyObject *name;
    CommObject *comm;
    CommObject *replicate;  /* HYBRID_SHARD: the Comm across replicas, or NULL */
    Py_ssize_t ngroups;
    unit_group *groups;
    int unsharded;          /* the compute buffers (lp, else full) are live and gathered */
    int full_unsharded;     /* the full-precision buffers are live and gathered */
    void *scratch;          /* reduce-scatter landing area when accumulating */
    size_t scratch_bytes;
    PyObject *scratch_t;    /* the tensor holding scratch on a device */
    PyObject *empty;        /* device units: empty(numel, dtype_code) -> tensor */
    void *gather_event;     /* device units: the mark of a deferred gather */
    int gather_pending;     /* the caller's stream has not waited for it yet */
    void *reduce_event;     /* the mark of deferred reductions */
    void *scatter_event;    /* HYBRID_SHARD: the reduce-scatter the replicas' all-reduce
                               follows (the two communicators have their own streams) */
    int reduce_pending;
    PyObject *held;         /* list: what deferred reductions use, until waited for */
    PyObject *gather_held;  /* list: what a deferred gather uses, until waited for */
    int offload;            /* shards and their gradients in host memory (CPUOffload) */
    int replicated;         /* NO_SHARD: every rank's shard is the whole buffer */
    int host_pending;       /* a gradient copy to host memory the host has not waited for */
    unsigned long long n_all_gather, n_reduce;
} UnitObject;


static inline fs_mod_state *fs_unit_mstate(UnitObject *u)
{
    return fs_state_from_type(Py_TYPE(u));
}

/* numel elements of t: from u->empty on a device (*owner holds the tensor),
 * else malloc'd host memory. NULL with an exception set on failure. */
void *fs_unit_take(UnitObject *u, int64_t numel, fs_dtype t, PyObject **owner);
/* copy.h's cast / scale_accumulate: the host loops, or the device's table
 * (enqueued on `stream`). */
fs_status fs_unit_cast(UnitObject *u, void *stream, void *dst, fs_dtype dt, const void *src,
                       fs_dtype st, int64_t n);
fs_status fs_unit_scale_accumulate(UnitObject *u, void *stream, void *dst, fs_dtype dt,
                                   const void *src, fs_dtype st, int64_t n, double scale,
                                   int accumulate);
/* py_unit_pool.c, [Note: pooled storage]: give a gathered buffer's storage
 * nbytes (from the host pool; a device's through resize_), or take them
 * away (0). -1 with an exception set on failure. */
int fs_unit_set_storage(UnitObject *u, PyObject *storage, int64_t nbytes);
/* Host staging for one reduction, from the pool; NULL with an exception set. */
void *fs_unit_take_staging(UnitObject *u, int64_t nbytes);
void fs_unit_give_staging(void *p);
/* The pool's module functions (pool_stats, pool_trim, ...). */
int fs_unit_pool_add(PyObject *module);

/* Add "during <what> of unit ..." to the exception now set; returns NULL. */
PyObject *fs_unit_annotate(UnitObject *u, const char *what, Py_ssize_t g);

/* py_unit_reduce.c: the Unit methods reduce_grad and wait_reduced. */
extern const char fs_unit_reduce_grad_doc[];
extern const char fs_unit_wait_reduced_doc[];
PyObject *fs_unit_reduce_grad(UnitObject *u, PyObject *args);
PyObject *fs_unit_wait_reduced(UnitObject *u, PyObject *a);

#endif
