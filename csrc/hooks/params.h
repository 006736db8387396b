/* params.h - the parameters a fully_shard group registers on its modules
 * (flatshard._C.ShardGroup's half that is about Python objects, not the
 * engine): which module dicts hold each parameter, the sharded and the
 * unsharded parameters, and the registration's plain path run from these
 * fields.
 *
 * [Note: registration in C] Between unshard and reshard the modules hold the
 * unsharded parameters (plain nn.Parameters over the unsharded buffer),
 * otherwise the sharded DTensor parameters, as torch's fully_shard registers
 * them. Every event swaps them, and before a gather the registration is
 * checked for what a user may have done since: assigned a parameter
 * (load_state_dict(assign=True), module.to_empty(), `param.data = ...`),
 * flipped a sharded parameter's requires_grad, given a local tensor
 * attributes (the all-gather extension). Python hands the objects here when
 * they change (fsdp2/param.py: build, refresh, the first unshard) and the
 * plain path reads only these fields and torch's tensor API: identity tests,
 * one requires_grad read per parameter, the dict stores. What the identity
 * tests cannot decide (a local tensor with attributes, a parameter whose class
 * gathers for itself) is left to Python's check (ParamGroup.sync_registered),
 * the one place that decides such a case. */
#ifndef FS_HOOKS_PARAMS_H
#define FS_HOOKS_PARAMS_H

#include "fs_py.h"

enum { FS_REG_NONE = 0, FS_REG_SHARDED = 1, FS_REG_UNSHARDED = 2 };

typedef struct {
    Py_ssize_t nslots;
    PyObject **dicts;    /* (nslots) each alias's module _parameters dict */
    PyObject **keys;     /* (nslots) the name in it */
    int *index;          /* (nslots) which parameter */
    Py_ssize_t *head;    /* (n) each parameter's first alias: its slot */
    int n;
    PyObject *sharded;   /* tuple (n): the sharded parameters (DTensors) */
    PyObject *locals;    /* tuple (n): their local tensors as the engine has them */
    PyObject *unsharded; /* tuple (n): the unsharded parameters (None: not made), or NULL */
    unsigned char *quick; /* (n) the identity tests decide (a plain local, gathered here) */
    unsigned char *train; /* (n) trainable at the last registration of the unsharded */
    unsigned char *hooked; /* (n) the unsharded parameter carries the gradient hook */
    int trainable;       /* how many are */
    int registered;      /* FS_REG_*: which the modules hold */
} fs_params;

void fs_params_clear(fs_params *p);
int fs_params_traverse(const fs_params *p, visitproc visit, void *arg);
/* slots: (dict, key, index) triples; sharded, locals, quick: n each. The
 * registration becomes FS_REG_NONE (the next register_sharded stores). */
int fs_params_set(fs_params *p, int n, PyObject *slots, PyObject *sharded, PyObject *locals,
                  PyObject *quick);
/* The unsharded parameters (n; None where not made yet). A new object at an
 * index carries no hook yet. */
int fs_params_set_unsharded(fs_params *p, PyObject *unsharded);
int fs_params_register_sharded(fs_params *p);
/* requires_grad of each unsharded parameter follows its sharded one's (the
 * user may have flipped it), `trainable` counted, then the stores. */
int fs_params_register_unsharded(fs_params *p);
/* Since the shards were handed: FS_PARAMS_ASSIGNED when a module holds
 * another parameter or a sharded parameter another local tensor (the
 * identity tests), FS_PARAMS_OPEN when those hold but a local tensor has
 * attributes or does not gather here (Python decides whether its path
 * changed: sync_registered), FS_PARAMS_SAME otherwise; -1 with an exception. */
enum { FS_PARAMS_SAME = 0, FS_PARAMS_ASSIGNED = 1, FS_PARAMS_OPEN = 2 };
int fs_params_changed(fs_params *p);
/* Whether a trainable unsharded parameter has no gradient hook yet. */
int fs_params_needs_hooks(const fs_params *p);
/* The indices of the trainable unsharded parameters without the gradient
 * hook, as a list, each marked as hooked now (the caller hooks them); NULL
 * with an exception set. */
PyObject *fs_params_take_unhooked(fs_params *p);
/* Whether an unsharded parameter holds a gradient; -1 with an exception. */
int fs_params_unsharded_grads(const fs_params *p);

#endif
