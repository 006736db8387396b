/* grads.h - the gradients a fully_shard group reduces (flatshard._C.ShardGroup's
 * reduce_grads and finish_reduce): which tensors the engine's reduction
 * reads and writes, found from the parameters params.h holds, and the
 * new sharded gradients set on the parameters afterwards.
 *
 * [Note: post-backward in C] A group's post-backward is one engine reduction
 * of its unsharded parameters' gradients into its sharded parameters' .grad
 * (DTensors), added where one is there. Its plain path runs here from the
 * group's own fields: each unsharded parameter's .grad (a plain tensor of a
 * dtype the handed table knows, made contiguous), its sharded parameter's
 * .grad (the output, added to) or a new shard (a new DTensor gradient after
 * the reduction, built from the parameter's spec as torch's fully_shard
 * builds it), the unsharded .grad dropped, then the parameters' own
 * post-accumulate-grad hooks. The settings that choose the engine's flags
 * (divide factor, force_sum, HSDP's all-reduce, a hook on the reduce output,
 * reduce_unused) are handed when a user sets them, not read per call.
 * Python (fsdp2/param.py, ParamGroup.reduce_grads) keeps the special
 * cases, and only the gradient each is about: the reduce-dtype sums kept
 * without gradient sync, a DTensor's local tensor (tensor parallel), a
 * subclass's values; it hands those in place of the .grad and calls the
 * same method. A gradient that is none of those and not plain makes the
 * method answer before it changed anything, so that Python hands it. */
#ifndef FS_HOOKS_GRADS_H
#define FS_HOOKS_GRADS_H

#include "params.h"

typedef struct {
    int n;
    /* handed by set_grads (when the shards are handed) */
    PyObject *codes;     /* dict: torch.dtype -> engine dtype code */
    PyObject *tensor;    /* torch.Tensor: the plain type */
    PyObject *specs;     /* tuple (n): each sharded parameter's DTensor spec, or None */
    PyObject *make;      /* make(cls, local, spec, requires_grad=False): DTensor.__new__ */
    PyObject *cls;       /* DTensor */
    PyObject *like;      /* like(local, param): the gradient where the spec is None */
    PyObject *empty;     /* empty(local): a new shard where the local is not plain */
    PyObject *run_hooks; /* run_hooks(params): their post-accumulate-grad hooks */
    /* handed by set_reduce_options (when a user sets them) */
    double factor;       /* 0: the engine's rule */
    int force_sum, all_reduce, hold, unused;
    /* the group's (set with set_grads) */
    int alone;           /* one rank: a gradient may become its own shard */
    fs_dtype rcode;      /* the reduce dtype */
    /* scratch for one call (n each) */
    void **gh, **oh;
    fs_dtype *gt, *ot;
    int *acc;
    /* the reduction left to finish: (index, out) pairs made new, and the
     * sharded parameters written; NULL when none is */
    PyObject *fresh, *written;
} fs_grads;

void fs_grads_clear(fs_grads *q);
int fs_grads_traverse(const fs_grads *q, visitproc visit, void *arg);
int fs_grads_set(fs_grads *q, int n, PyObject *codes, PyObject *tensor, PyObject *specs,
                 PyObject *make, PyObject *cls, PyObject *like, PyObject *empty,
                 PyObject *run_hooks);

enum { FS_GRADS_NONE = 0, FS_GRADS_READY = 1, FS_GRADS_ASK = 2 };
/* The engine's arguments for one reduction into q's scratch (q->gh ...),
 * the references they need held in *keep (a new list). over: NULL, or a
 * sequence of n gradients that replace the unsharded parameters' .grad
 * (None entries: read the .grad). Returns FS_GRADS_READY (q->fresh and
 * q->written set, the unsharded .grad dropped), FS_GRADS_NONE (no gradient
 * takes part: nothing changed), FS_GRADS_ASK (a gradient Python must hand:
 * nothing changed), -1 with an exception (nothing changed). */
int fs_grads_collect(fs_grads *q, const fs_params *p, PyObject *over, PyObject **keep);
/* After the engine wrote: the new gradients set on their parameters, then
 * the hooks of the parameters written; q's reduction forgotten. */
int fs_grads_finish(fs_grads *q, const fs_params *p);
/* A reduction given up before it ran: nothing set. */
void fs_grads_drop(fs_grads *q);

#endif
