/* py_hooks.h - what the hook files share: flatshard._C.Hook's object, the
 * torch and flatshard functions its lanes call, and the helpers of both
 * lanes. py_hooks.c: the type, its dispatch, these helpers;
 * py_hooks_shard.c: fully_shard's lane; py_hooks_unit.c: the FSDP1
 * wrapper's. Glue only: each lane calls the engine objects' methods, as
 * the Python hook it stands for does. */
#ifndef FS_PY_HOOKS_H
#define FS_PY_HOOKS_H

#include "fs_py.h"

enum {
    /* fully_shard (fsdp2/state.py, [Note: hook lane]) */
    HOOK_PRE_FORWARD, HOOK_POST_FORWARD, HOOK_PRE_BACKWARD, HOOK_ARRIVE,
    /* the FSDP1 wrapper's unit (fsdp/unit.py, [Note: unit hook lane]) */
    HOOK_UNIT_PRE_FORWARD, HOOK_UNIT_POST_FORWARD, HOOK_UNIT_PRE_BACKWARD,
    HOOK_UNIT_POST_BACKWARD,
    HOOK_NKIND
};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int kind;
    PyObject *state;    /* the __dict__ of the object that owns the hook */
    PyObject *owner;    /* that object (FSDP1: the UnitRuntime), or None */
    PyObject *group;    /* fully_shard: its ParamGroup's __dict__, or None */
    PyObject *fallback; /* the Python hook: the same arguments */
    /* POST_FORWARD kinds: the pre-backward Hook they register; ARRIVE,
     * UNIT_POST_BACKWARD: the parameter's or the group's index */
    PyObject *then;
    /* calls run here, calls given to the fallback (ARRIVE: arrivals ending
     * in the Python post-backward) */
    unsigned long long taken, passed;
} HookObject;

/* What the lanes call, given once by the Python layer (set_hook_tools). */
typedef struct {
    PyObject *profiling;      /* torch._C._autograd._profiler_enabled */
    PyObject *stack_len;      /* torch._C._len_torch_dispatch_stack, or None */
    PyObject *grad_enabled;   /* torch.is_grad_enabled */
    PyObject *set_grad;       /* torch._C._set_grad_enabled */
    PyObject *tensor_type;    /* torch.Tensor */
    PyObject *hook_outputs;   /* runtime.trees.hook_before_backward */
    PyObject *dtype_codes;    /* tensors.DTYPE_CODES: torch dtype -> the core's code */
    PyObject *empty;          /* torch.empty */
    PyObject *empty_like;     /* torch.empty_like */
    PyObject *contiguous;     /* torch.contiguous_format */
    PyObject *split;          /* torch.split_with_sizes */
    PyObject *like;           /* fsdp2.param._like: a sharded gradient's DTensor */
    PyObject *run_hooks;      /* runtime.grad_hooks.run_hooks */
    PyObject *heap_freed;     /* runtime.heap.HEAP.freed */
    PyObject *backward_pre;   /* options.BackwardPrefetch.BACKWARD_PRE */
} fs_hook_tools;

extern fs_hook_tools fs_hooks;

/* d[key] (borrowed), or NULL without an exception when it is missing. */
static inline PyObject *fs_item(PyObject *d, PyObject *key)
{
    return PyDict_GetItemWithError(d, key);
}

/* A builtin of no arguments answered true: 1, false: 0, error: -1 (None: 0). */
int fs_hook_truth(PyObject *fn);
/* A profiler or a dispatch mode (CommDebugMode) watches: the Python hooks
 * record their ranges and counts. 1, 0, -1. */
int fs_hook_watched(void);
/* The attribute `name` of o is Py_True: 1, 0, or -1 with an exception. */
int fs_hook_attr_true(PyObject *o, PyObject *name);
/* o.name() or o.name(arg): the result, or NULL with an exception. */
PyObject *fs_hook_method(PyObject *o, PyObject *name, PyObject *arg);
/* As fs_hook_method, the result dropped: 0 or -1. */
int fs_hook_call(PyObject *o, PyObject *name, PyObject *arg);
/* slots[k] = (dict, name, i): dict[name] = params[i] for each (params: a
 * list or tuple). 0 or -1. */
int fs_hook_register(PyObject *slots, PyObject *params);
/* hook_before_backward(output, pre_backward), on one plain tensor's
 * grad_fn directly. 0 or -1. */
int fs_hook_outputs(PyObject *output, PyObject *pre_backward);
/* The post-accumulate-grad hooks of params (a list) run, where any has one
 * (runtime/grad_hooks.run_hooks). 0 or -1. */
int fs_hook_run_param_hooks(PyObject *params);
/* list.append(o), o's reference given to the list (o NULL: -1). */
int fs_hook_append_new(PyObject *list, PyObject *o);
/* d[name] = value as a new int: 0 or -1. */
int fs_hook_set_int(PyObject *d, PyObject *name, long long value);

/* Each lane: its kinds' calls, in C or through the fallback. */
PyObject *fs_hook_shard_call(HookObject *h, PyObject *const *args, Py_ssize_t nargs);
PyObject *fs_hook_unit_call(HookObject *h, PyObject *const *args, Py_ssize_t nargs);
/* Each lane's interned names, made once: 0 or -1. */
int fs_hook_shard_names(void);
int fs_hook_unit_names(void);

#endif
