/* py_hooks.c - flatshard._C.Hook: a torch hook of fully_shard's whose
 * common case runs here, in C, and whose every other case is the Python
 * hook it was made with.
 *
 * fully_shard (fsdp2/state.py) registers one Hook per event: the module's
 * forward pre-hook and forward hook, the pre-backward hook on its outputs'
 * grad_fn, and each unsharded parameter's post-accumulate-grad hook. torch
 * calls it as any callable (vectorcall: no Python frame). What the event
 * does in the common case is engine work and dictionary stores: the
 * group's all-gather or free (its ShardGroup's unshard/reshard, the
 * engine's own entry points) and the modules' parameters swapped between
 * the sharded and the unsharded ones. That case is "the lane" ([Note: hook
 * lane] in fsdp2/state.py, which says when a state may take it and which
 * Python steps it leaves out because nothing reads them there). Each call
 * checks the lane's conditions on the state's and the group's attributes as
 * they are now; any that does not hold, and the call is the Python hook's,
 * unchanged. A parameter's gradient arrival is C in every case: a set
 * insert and a count, and the group's post-backward (Python) at the last.
 *
 * Nothing here shards, gathers, frees or reduces by itself: it calls the
 * engine group's methods, as the Python hook does. No state is kept here
 * either: every value is read from the objects at each call. */
#include <stddef.h>

#include "fs_py.h"
#include "structmember.h"

enum { HOOK_PRE_FORWARD, HOOK_POST_FORWARD, HOOK_PRE_BACKWARD, HOOK_ARRIVE, HOOK_NKIND };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int kind;
    PyObject *state;       /* the FSDPState's __dict__ */
    PyObject *group;       /* its ParamGroup's __dict__, or None */
    PyObject *fallback;    /* the Python hook: the same arguments */
    PyObject *then;        /* POST_FORWARD: the pre-backward Hook it registers; ARRIVE: the index */
    /* calls run here, calls given to the fallback (ARRIVE: arrivals ending
     * in the Python post-backward) */
    unsigned long long taken, passed;
} HookObject;

/* What every lane check needs from torch, given once (set_hook_tools). */
static struct {
    PyObject *profiling;      /* torch._C._autograd._profiler_enabled */
    PyObject *stack_len;      /* torch._C._len_torch_dispatch_stack, or None */
    PyObject *grad_enabled;   /* torch.is_grad_enabled */
    PyObject *tensor_type;    /* torch.Tensor */
    PyObject *hook_outputs;   /* runtime.trees.hook_before_backward */
    PyObject *dtype_codes;    /* tensors.DTYPE_CODES: torch dtype -> the core's code */
    PyObject *empty_like;     /* torch.empty_like */
    PyObject *contiguous;     /* torch.contiguous_format */
    PyObject *like;           /* fsdp2.param._like: a sharded gradient's DTensor */
    PyObject *run_hooks;      /* runtime.grad_hooks.run_hooks */
} tools;

static PyObject *s_c_hooks, *s_is_root, *s_forward_prefetch, *s_backward_prefetch,
    *s_unshard_async_op, *s_reshard_after_forward, *s_unshard_in_backward, *s_watching,
    *s_hooked_full, *s_hooked, *s_ready, *s_root, *s_tree, *s_final_queued, *s_c, *s_full,
    *s_unsharded, *s_sharded, *s_engine_locals, *s_gathered, *s_heads, *s_slots,
    *s_post_chunk, *s_ext, *s_tp, *s_registered_unsharded, *s_trainable, *s_trainable_mask,
    *s_is_unsharded, *s_unshard, *s_reshard, *s_local_tensor, *s_dict, *s_requires_grad,
    *s_grad_fn, *s_register_prehook, *s_reading, *s_requires_gradient_sync,
    *s_reshard_after_backward, *s_replicate_comm, *s_all_reduce_hook, *s_accumulated,
    *s_world, *s_divide_factor, *s_force_sum, *s_grad, *s_contiguous, *s_dtype, *s_reduce,
    *s_reduce_pending, *s_finish_reduce, *s_reducing, *s_reduced, *s_pahooks, *s_memory_format,
    *s_reduce_kw, *s_like_kw;

static int names_made(void)
{
#define N(var, text) if (!FS_NAME(var, text)) return -1
    N(s_c_hooks, "c_hooks"); N(s_is_root, "is_root"); N(s_forward_prefetch, "forward_prefetch");
    N(s_backward_prefetch, "backward_prefetch"); N(s_unshard_async_op, "unshard_async_op");
    N(s_reshard_after_forward, "reshard_after_forward");
    N(s_unshard_in_backward, "unshard_in_backward"); N(s_watching, "watching");
    N(s_hooked_full, "hooked_full"); N(s_hooked, "hooked"); N(s_ready, "ready");
    N(s_root, "root"); N(s_tree, "tree"); N(s_final_queued, "final_queued"); N(s_c, "c");
    N(s_full, "full"); N(s_unsharded, "unsharded"); N(s_sharded, "sharded");
    N(s_engine_locals, "engine_locals"); N(s_gathered, "gathered"); N(s_heads, "_heads");
    N(s_slots, "_slots"); N(s_post_chunk, "post_chunk"); N(s_ext, "ext"); N(s_tp, "tp");
    N(s_registered_unsharded, "registered_unsharded"); N(s_trainable, "trainable");
    N(s_trainable_mask, "trainable_mask"); N(s_is_unsharded, "is_unsharded");
    N(s_unshard, "unshard"); N(s_reshard, "reshard"); N(s_local_tensor, "_local_tensor");
    N(s_dict, "__dict__"); N(s_requires_grad, "requires_grad"); N(s_grad_fn, "grad_fn");
    N(s_register_prehook, "register_prehook"); N(s_reading, "reading");
    N(s_requires_gradient_sync, "requires_gradient_sync");
    N(s_reshard_after_backward, "reshard_after_backward"); N(s_replicate_comm, "replicate_comm");
    N(s_all_reduce_hook, "all_reduce_hook"); N(s_accumulated, "accumulated");
    N(s_world, "world"); N(s_divide_factor, "divide_factor"); N(s_force_sum, "force_sum");
    N(s_grad, "grad"); N(s_contiguous, "contiguous"); N(s_dtype, "dtype"); N(s_reduce, "reduce");
    N(s_reduce_pending, "reduce_pending"); N(s_finish_reduce, "finish_reduce");
    N(s_reducing, "reducing"); N(s_reduced, "reduced");
    N(s_pahooks, "_post_accumulate_grad_hooks"); N(s_memory_format, "memory_format");
#undef N
    if (!s_reduce_kw && !(s_reduce_kw = Py_BuildValue("(ssss)", "all_reduce", "hold", "force_sum",
                                                      "bucket")))
        return -1;
    if (!s_like_kw && !(s_like_kw = Py_BuildValue("(O)", s_memory_format)))
        return -1;
    return 0;
}

/* d[key] (borrowed), or NULL without an exception when it is missing. */
static inline PyObject *item(PyObject *d, PyObject *key)
{
    return PyDict_GetItemWithError(d, key);
}

/* 1: a builtin of no arguments answered true (nonzero), 0: false, -1: error. */
static int truth_of(PyObject *fn)
{
    if (fn == Py_None)
        return 0;
    PyObject *r = PyObject_CallNoArgs(fn);
    if (!r)
        return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* Whether the lane is open for this state now: Python opened it at lazy
 * init (c_hooks), and nothing watches (a profiler, a dispatch mode such as
 * CommDebugMode: the Python hooks record their ranges and counts). */
static int lane_open(HookObject *h)
{
    if (item(h->state, s_c_hooks) != Py_True || h->group == Py_None)
        return PyErr_Occurred() ? -1 : 0;
    int t = truth_of(tools.profiling);
    if (t != 0)
        return t < 0 ? -1 : 0;
    t = truth_of(tools.stack_len);
    return t < 0 ? -1 : !t;
}

/* A bool attribute of o is Py_True: 1, 0, or -1 with an exception. */
static int attr_true(PyObject *o, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v)
        return -1;
    int t = v == Py_True;
    Py_DECREF(v);
    return t;
}

/* The group as the lane needs it: gathered before (its unsharded
 * parameters exist), no extension, tensor-parallel or post-forward piece,
 * the modules still holding the sharded parameters registered at the last
 * reshard with their local tensors, all parameters trainable and carrying
 * this state's gradient hooks. 1: so, and *c is the engine group
 * (borrowed); 0: not (the Python hook decides); -1: an exception. The
 * conditions are those under which fsdp2's unshard() would take its plain
 * path: sync_registered() finding nothing new, register_unsharded()
 * changing no requires_grad, _hook_grads() adding no hook. */
static int group_ready(HookObject *h, PyObject **c, Py_ssize_t *n)
{
    PyObject *g = h->group;
    PyObject *full = item(g, s_full), *un = item(g, s_unsharded), *sh = item(g, s_sharded);
    PyObject *locs = item(g, s_engine_locals), *gath = item(g, s_gathered);
    PyObject *heads = item(g, s_heads), *slots = item(g, s_slots), *ext = item(g, s_ext);
    PyObject *tp = item(g, s_tp);
    *c = item(g, s_c);
    if (PyErr_Occurred())
        return -1;
    if (!full || full == Py_None || !un || !PyList_CheckExact(un) || !sh ||
        !PyList_CheckExact(sh) || !locs || !PyList_CheckExact(locs) || !gath ||
        !PyList_CheckExact(gath) || !heads || !PyList_CheckExact(heads) || !slots ||
        !PyList_CheckExact(slots) || !ext || !PyDict_CheckExact(ext) || PyDict_GET_SIZE(ext) ||
        !tp || !PyDict_CheckExact(tp) || PyDict_GET_SIZE(tp) || !*c ||
        item(g, s_post_chunk) != Py_None || item(g, s_registered_unsharded) != Py_False)
        return PyErr_Occurred() ? -1 : 0;
    *n = PyList_GET_SIZE(sh);
    if (*n < 1 || *n > 62 || PyList_GET_SIZE(un) != *n || PyList_GET_SIZE(locs) != *n ||
        PyList_GET_SIZE(gath) != *n || PyList_GET_SIZE(heads) != *n)
        return 0;
    long long mask = (1LL << *n) - 1;
    PyObject *hooked = item(h->state, s_hooked);
    if (item(h->state, s_hooked_full) != full || !hooked || !PyLong_CheckExact(hooked) ||
        (PyLong_AsLongLong(hooked) & mask) != mask)
        return PyErr_Occurred() ? -1 : 0;
    int t = attr_true(*c, s_is_unsharded);
    if (t != 0)
        return t < 0 ? -1 : 0;
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *head = PyList_GET_ITEM(heads, i), *sp = PyList_GET_ITEM(sh, i);
        if (!PyTuple_CheckExact(head) || PyTuple_GET_SIZE(head) != 2 ||
            !PyDict_Check(PyTuple_GET_ITEM(head, 0)) ||
            PyList_GET_ITEM(gath, i) != Py_True)
            return 0;
        if (item(PyTuple_GET_ITEM(head, 0), PyTuple_GET_ITEM(head, 1)) != sp)
            return PyErr_Occurred() ? -1 : 0;
        PyObject *local = PyObject_GetAttr(sp, s_local_tensor);
        if (!local)
            return -1;
        int same = local == PyList_GET_ITEM(locs, i);
        PyObject *d = same ? PyObject_GetAttr(local, s_dict) : NULL;
        Py_DECREF(local);
        if (!same)
            return 0;
        if (!d)
            return -1;
        int plain = PyDict_Check(d) && PyDict_GET_SIZE(d) == 0;
        Py_DECREF(d);
        if (!plain)
            return 0; /* attributes on the local tensor: it may have gained an extension */
        if ((t = attr_true(sp, s_requires_grad)) != 1 ||
            (t = attr_true(PyList_GET_ITEM(un, i), s_requires_grad)) != 1)
            return t;
    }
    return 1;
}

/* The modules' parameters: slot (dict, name, index) of each alias set to
 * params[index]. */
static int register_params(PyObject *slots, PyObject *params)
{
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(slots); k++) {
        PyObject *s = PyList_GET_ITEM(slots, k);
        if (!PyTuple_CheckExact(s) || PyTuple_GET_SIZE(s) != 3) {
            PyErr_SetString(PyExc_TypeError, "Hook: a parameter slot must be (dict, name, index)");
            return -1;
        }
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(s, 2));
        if (i < 0 || i >= PyList_GET_SIZE(params)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "Hook: a parameter slot's index is out of range");
            return -1;
        }
        if (PyObject_SetItem(PyTuple_GET_ITEM(s, 0), PyTuple_GET_ITEM(s, 1),
                             PyList_GET_ITEM(params, i)) < 0)
            return -1;
    }
    return 0;
}

static PyObject *call_method0(PyObject *o, PyObject *name, PyObject *arg)
{
    PyObject *args[2] = {o, arg};
    return PyObject_VectorcallMethod(name, args, (arg ? 2 : 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                     NULL);
}

/* The gather of pre-forward and pre-backward: the engine's all-gather, then
 * the unsharded parameters registered, as ParamGroup.unshard() and
 * register_unsharded() do on their plain path. */
static int gather(HookObject *h, PyObject *c, Py_ssize_t n)
{
    PyObject *r = call_method0(c, s_unshard, Py_False);
    if (!r)
        return -1;
    Py_DECREF(r);
    PyObject *g = h->group;
    if (register_params(item(g, s_slots), item(g, s_unsharded)) < 0)
        return -1;
    PyObject *count = PyLong_FromSsize_t(n), *mask = PyLong_FromLongLong((1LL << n) - 1);
    int rc = count && mask && PyDict_SetItem(g, s_trainable, count) == 0 &&
                     PyDict_SetItem(g, s_trainable_mask, mask) == 0 &&
                     PyDict_SetItem(g, s_registered_unsharded, Py_True) == 0
                 ? 0
                 : -1;
    Py_XDECREF(count);
    Py_XDECREF(mask);
    return rc;
}

/* Whether the lane takes this call: 1, 0 (the fallback's), -1 (error). */
static int lane_takes(HookObject *h, PyObject **c, Py_ssize_t *n)
{
    int t = lane_open(h);
    if (t != 1)
        return t;
    PyObject *st = h->state;
    switch (h->kind) {
    case HOOK_PRE_FORWARD:
        if (item(st, s_is_root) != Py_False || item(st, s_forward_prefetch) != Py_None ||
            item(st, s_unshard_async_op) != Py_False)
            return PyErr_Occurred() ? -1 : 0;
        return group_ready(h, c, n);
    case HOOK_PRE_BACKWARD: {
        if (item(st, s_unshard_in_backward) != Py_True ||
            item(st, s_backward_prefetch) != Py_None || item(st, s_unshard_async_op) != Py_False)
            return PyErr_Occurred() ? -1 : 0;
        /* the end-of-backward callback is queued (the first pre-backward
         * of each backward queues it, in Python) */
        PyObject *root = item(st, s_root);
        if (!root || root == Py_None)
            return PyErr_Occurred() ? -1 : 0;
        PyObject *tree = PyObject_GetAttr(root, s_tree);
        if (!tree)
            return -1;
        t = tree == Py_None ? 0 : attr_true(tree, s_final_queued);
        Py_DECREF(tree);
        return t != 1 ? t : group_ready(h, c, n);
    }
    case HOOK_POST_FORWARD: {
        PyObject *g = h->group, *ext = item(g, s_ext), *slots = item(g, s_slots);
        if (item(st, s_is_root) != Py_False || item(st, s_reshard_after_forward) != Py_True ||
            item(st, s_watching) != Py_None || !ext || !PyDict_CheckExact(ext) ||
            PyDict_GET_SIZE(ext) || item(g, s_post_chunk) != Py_None || !slots ||
            !PyList_CheckExact(slots) || !(*c = item(g, s_c)))
            return PyErr_Occurred() ? -1 : 0;
        PyObject *sh = item(g, s_sharded);
        return sh && PyList_CheckExact(sh) ? 1 : (PyErr_Occurred() ? -1 : 0);
    }
    }
    return 0;
}

/* hook_before_backward(output, pre_backward): on the output's grad_fn
 * directly where it is one plain tensor (the common case), else through
 * the Python function, which walks the output's structure. */
static int hook_outputs(PyObject *output, PyObject *pre_backward)
{
    PyObject *r;
    if (Py_TYPE(output) == (PyTypeObject *)tools.tensor_type) {
        PyObject *fn = PyObject_GetAttr(output, s_grad_fn);
        if (!fn)
            return -1;
        if (fn == Py_None) {
            Py_DECREF(fn);
            r = PyObject_CallFunctionObjArgs(tools.hook_outputs, output, pre_backward, NULL);
        } else {
            r = call_method0(fn, s_register_prehook, pre_backward);
            Py_DECREF(fn);
        }
    } else {
        r = PyObject_CallFunctionObjArgs(tools.hook_outputs, output, pre_backward, NULL);
    }
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The forward hook's lane: the sharded parameters registered back, the
 * group freed (ParamGroup.reshard()), and the pre-backward hook put on the
 * output when autograd records. */
static PyObject *post_forward(HookObject *h, PyObject *c, PyObject *output)
{
    PyObject *g = h->group;
    if (item(g, s_registered_unsharded) != Py_False) {
        if (register_params(item(g, s_slots), item(g, s_sharded)) < 0 ||
            PyDict_SetItem(g, s_registered_unsharded, Py_False) < 0)
            return NULL;
    }
    int t = attr_true(c, s_is_unsharded);
    if (t < 0)
        return NULL;
    if (t) {
        PyObject *r = call_method0(c, s_reshard, NULL);
        if (!r)
            return NULL;
        Py_DECREF(r);
    }
    if ((t = truth_of(tools.grad_enabled)) < 0 || (t && hook_outputs(output, h->then) < 0))
        return NULL;
    Py_RETURN_NONE;
}

static int reduce_ready(HookObject *h, Py_ssize_t *n);
static PyObject *post_backward(HookObject *h, Py_ssize_t n);

/* A parameter's gradient has arrived: its index into the state's `ready`
 * set; once every trainable parameter's has, the group's post-backward. */
static PyObject *arrive(HookObject *h)
{
    PyObject *ready = item(h->state, s_ready);
    if (!ready || !PySet_Check(ready)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "Hook: the state's `ready` must be a set");
        return NULL;
    }
    if (PySet_Add(ready, h->then) < 0)
        return NULL;
    PyObject *trainable = item(h->group, s_trainable);
    if (!trainable)
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_AttributeError, "trainable");
    Py_ssize_t want = PyLong_AsSsize_t(trainable);
    if (want == -1 && PyErr_Occurred())
        return NULL;
    if (PySet_GET_SIZE(ready) != want) {
        h->taken++;
        Py_RETURN_NONE;
    }
    Py_ssize_t n = 0;
    int t = lane_open(h);
    if (t == 1)
        t = reduce_ready(h, &n);
    if (t < 0)
        return NULL;
    if (t) {
        h->taken++;
        return post_backward(h, n);
    }
    h->passed++; /* the group's post-backward in Python */
    return PyObject_CallNoArgs(h->fallback);
}

/* The post-backward's lane: a host group of several ranks, its plain
 * reduction (no replicas, hook, accumulation without sync, extension or
 * tensor-parallel parameter), every parameter's gradient a plain tensor,
 * and resharding after it. The conditions of FSDPState._post_backward()
 * and ParamGroup.reduce_grads() taking their plain path, with the root's
 * bucket off (its budget is 0 where the lane is open). 1, 0, -1. */
static int reduce_ready(HookObject *h, Py_ssize_t *n)
{
    PyObject *st = h->state, *g = h->group;
    PyObject *reading = item(st, s_reading), *acc = item(g, s_accumulated);
    PyObject *un = item(g, s_unsharded), *sh = item(g, s_sharded), *ext = item(g, s_ext);
    PyObject *tp = item(g, s_tp), *slots = item(g, s_slots), *world = item(g, s_world);
    PyObject *trainable = item(g, s_trainable);
    if (PyErr_Occurred())
        return -1;
    if (!reading || !PyList_CheckExact(reading) || PyList_GET_SIZE(reading) ||
        item(st, s_requires_gradient_sync) != Py_True ||
        item(st, s_reshard_after_backward) != Py_True ||
        item(g, s_replicate_comm) != Py_None || item(g, s_all_reduce_hook) != Py_None ||
        item(g, s_post_chunk) != Py_None || !acc || !PyList_CheckExact(acc) || !un ||
        !PyList_CheckExact(un) || !sh || !PyList_CheckExact(sh) || !ext ||
        !PyDict_CheckExact(ext) || PyDict_GET_SIZE(ext) || !tp || !PyDict_CheckExact(tp) ||
        PyDict_GET_SIZE(tp) || !slots || !PyList_CheckExact(slots) || !world ||
        !PyLong_CheckExact(world) || PyLong_AsLong(world) < 2 || !item(g, s_c) || !trainable ||
        !PyLong_CheckExact(trainable))
        return PyErr_Occurred() ? -1 : 0;
    *n = PyList_GET_SIZE(sh);
    if (PyList_GET_SIZE(un) != *n || PyList_GET_SIZE(acc) != *n ||
        PyLong_AsSsize_t(trainable) != *n)
        return PyErr_Occurred() ? -1 : 0;
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (PyList_GET_ITEM(acc, i) != Py_None)
            return 0;
        PyObject *gr = PyObject_GetAttr(PyList_GET_ITEM(un, i), s_grad);
        if (!gr)
            return -1;
        int plain = Py_TYPE(gr) == (PyTypeObject *)tools.tensor_type;
        Py_DECREF(gr);
        if (!plain)
            return 0;
    }
    return 1;
}

/* The core's code of tensor t's dtype; -1 with an exception. */
static int code_of(PyObject *t)
{
    PyObject *dt = PyObject_GetAttr(t, s_dtype);
    if (!dt)
        return -1;
    PyObject *code = PyDict_GetItemWithError(tools.dtype_codes, dt);
    Py_DECREF(dt);
    if (!code) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "flatshard: a gradient's dtype is not supported "
                            "by the C core");
        return -1;
    }
    return (int)PyLong_AsLong(code);
}

static int append_new(PyObject *list, PyObject *o)
{
    if (!o)
        return -1;
    int rc = PyList_Append(list, o);
    Py_DECREF(o);
    return rc;
}

/* One parameter's part of the reduction: its gradient handed over (the
 * unsharded parameter's .grad cleared), and where the reduction lands: onto
 * the sharded gradient that is there, or a new tensor like the shard
 * (`fresh`, its DTensor set after the reduction). */
static int reduce_part(PyObject *up, PyObject *sp, Py_ssize_t i, PyObject *lists[6])
{
    PyObject *gr = PyObject_GetAttr(up, s_grad), *args[3];
    if (!gr)
        return -1;
    args[0] = gr;
    PyObject *g = PyObject_VectorcallMethod(s_contiguous, args,
                                            1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(gr);
    if (!g)
        return -1;
    int code = code_of(g);
    if (code < 0) {
        Py_DECREF(g);
        return -1;
    }
    if (append_new(lists[0], g) < 0 || append_new(lists[1], PyLong_FromLong(code)) < 0 ||
        PyObject_SetAttr(up, s_grad, Py_None) < 0)
        return -1;
    PyObject *cur = PyObject_GetAttr(sp, s_grad), *out;
    if (!cur)
        return -1;
    int add = cur != Py_None;
    if (add) {
        out = PyObject_GetAttr(cur, s_local_tensor);
    } else {
        PyObject *local = PyObject_GetAttr(sp, s_local_tensor);
        if (!local) {
            Py_DECREF(cur);
            return -1;
        }
        args[1] = local;
        args[2] = tools.contiguous;
        out = PyObject_Vectorcall(tools.empty_like, args + 1, 1, s_like_kw);
        Py_DECREF(local);
    }
    Py_DECREF(cur);
    if (!out)
        return -1;
    if (!add) {
        PyObject *pair = Py_BuildValue("(nO)", i, out);
        if (append_new(lists[5], pair) < 0) {
            Py_DECREF(out);
            return -1;
        }
    }
    code = code_of(out);
    if (code < 0) {
        Py_DECREF(out);
        return -1;
    }
    if (append_new(lists[2], out) < 0 || append_new(lists[3], PyLong_FromLong(code)) < 0 ||
        PyList_Append(lists[4], add ? Py_True : Py_False) < 0)
        return -1;
    return 0;
}

/* Whether any of params has a post-accumulate-grad hook of its own. */
static int any_hooked(PyObject *params)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
        PyObject *d = PyObject_GetAttr(PyList_GET_ITEM(params, i), s_pahooks);
        if (!d) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear();
            continue;
        }
        int has = d != Py_None && PyObject_IsTrue(d);
        Py_DECREF(d);
        if (has)
            return has < 0 ? -1 : 1;
    }
    return 0;
}

/* FSDPState._post_backward() on the lane: one engine reduce-scatter that
 * also frees the unsharded buffer, the new sharded gradients set, their
 * parameters' hooks run, and the sharded parameters registered back. */
static PyObject *post_backward(HookObject *h, Py_ssize_t n)
{
    PyObject *g = h->group, *lists[6] = {0}, *r = NULL, *c = item(g, s_c);
    PyObject *un = item(g, s_unsharded), *sh = item(g, s_sharded);
    Py_INCREF(c);
    Py_INCREF(un);
    Py_INCREF(sh);
    PySet_Clear(item(h->state, s_ready));
    for (int k = 0; k < 6; k++)
        if (!(lists[k] = PyList_New(0)))
            goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (reduce_part(PyList_GET_ITEM(un, i), PyList_GET_ITEM(sh, i), i, lists) < 0)
            goto done;
    PyObject *none = PyList_New(n);
    if (!none)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        PyList_SET_ITEM(none, i, Py_NewRef(Py_None));
    int bad = PyDict_SetItem(g, s_accumulated, none);
    Py_DECREF(none);
    if (bad)
        goto done;
    PyObject *f = item(g, s_divide_factor), *fs = item(g, s_force_sum);
    double factor = f && f != Py_None ? PyFloat_AsDouble(f) : 0.0;
    if ((factor == -1.0 && PyErr_Occurred()) || !fs)
        goto done;
    PyObject *factor_o = PyFloat_FromDouble(factor);
    if (!factor_o)
        goto done;
    /* reduce(grads, codes, outs, out_codes, accumulate, factor, deferred,
     *        reshard, all_reduce=, hold=, force_sum=, bucket=) */
    PyObject *args[13] = {c, lists[0], lists[1], lists[2], lists[3], lists[4], factor_o,
                          Py_False, Py_True, Py_True, Py_False, fs, Py_None};
    PyObject *res = PyObject_VectorcallMethod(s_reduce, args,
                                              9 | PY_VECTORCALL_ARGUMENTS_OFFSET, s_reduce_kw);
    Py_DECREF(factor_o);
    if (!res)
        goto done;
    Py_DECREF(res);
    int t = attr_true(c, s_reduce_pending);
    if (t < 0)
        goto done;
    if (t) {
        if (!(res = call_method0(c, s_finish_reduce, NULL)))
            goto done;
        Py_DECREF(res);
    }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(lists[5]); k++) {
        PyObject *pair = PyList_GET_ITEM(lists[5], k);
        PyObject *sp = PyList_GET_ITEM(sh, PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0)));
        PyObject *d = PyObject_CallFunctionObjArgs(tools.like, PyTuple_GET_ITEM(pair, 1), sp,
                                                   NULL);
        if (!d)
            goto done;
        bad = PyObject_SetAttr(sp, s_grad, d);
        Py_DECREF(d);
        if (bad)
            goto done;
    }
    if ((t = any_hooked(sh)) < 0)
        goto done;
    if (t) {
        if (!(res = PyObject_CallOneArg(tools.run_hooks, sh)))
            goto done;
        Py_DECREF(res);
    }
    PyObject *root = item(h->state, s_root), *tree = root ? PyObject_GetAttr(root, s_tree) : NULL;
    if (!tree)
        goto done;
    bad = PyObject_SetAttr(tree, s_reduced, Py_True);
    Py_DECREF(tree);
    if (bad)
        goto done;
    /* ParamGroup.reshard(): the engine's reduce freed the buffer already */
    if (item(g, s_registered_unsharded) != Py_False &&
        (register_params(item(g, s_slots), sh) < 0 ||
         PyDict_SetItem(g, s_registered_unsharded, Py_False) < 0))
        goto done;
    if ((t = attr_true(c, s_is_unsharded)) < 0)
        goto done;
    if (t) {
        if (!(res = call_method0(c, s_reshard, NULL)))
            goto done;
        Py_DECREF(res);
    }
    r = Py_NewRef(Py_None);
done:
    for (int k = 0; k < 6; k++)
        Py_XDECREF(lists[k]);
    Py_DECREF(c);
    Py_DECREF(un);
    Py_DECREF(sh);
    return r;
}

static PyObject *Hook_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames)
{
    HookObject *h = (HookObject *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames && PyTuple_GET_SIZE(kwnames)) {
        h->passed++;
        return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
    }
    if (h->kind == HOOK_ARRIVE) {
        if (nargs == 1)
            return arrive(h);
        h->passed++;
        return PyObject_Vectorcall(h->fallback, args, nargsf, NULL);
    }
    PyObject *c = NULL;
    Py_ssize_t n = 0;
    int need = h->kind == HOOK_PRE_BACKWARD ? 1 : 3;
    int t = nargs == need ? lane_takes(h, &c, &n) : 0;
    if (t < 0)
        return NULL;
    if (!t) {
        h->passed++;
        return PyObject_Vectorcall(h->fallback, args, nargsf, NULL);
    }
    h->taken++;
    PyObject *r = NULL;
    Py_INCREF(c); /* read from the group's dict, which the calls below may change */
    switch (h->kind) {
    case HOOK_PRE_FORWARD: /* args and kwargs as they were: None */
        if (gather(h, c, n) == 0 && PyDict_SetItem(h->state, s_watching, Py_None) == 0)
            r = Py_NewRef(Py_None);
        break;
    case HOOK_PRE_BACKWARD:
        if (gather(h, c, n) == 0)
            r = Py_NewRef(Py_None);
        break;
    default:
        r = post_forward(h, c, args[2]);
    }
    Py_DECREF(c);
    return r;
}

static PyObject *Hook_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"kind", "state", "group", "fallback", "then", NULL};
    int kind;
    PyObject *state, *group, *fallback, *then = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO!OO|O:Hook", kwlist, &kind, &PyDict_Type,
                                     &state, &group, &fallback, &then))
        return NULL;
    if (kind < 0 || kind >= HOOK_NKIND)
        return PyErr_Format(PyExc_ValueError, "Hook: kind must be one of HOOK_PRE_FORWARD, "
                            "HOOK_POST_FORWARD, HOOK_PRE_BACKWARD, HOOK_ARRIVE, not %d", kind);
    if (group != Py_None && !PyDict_Check(group))
        return PyErr_Format(PyExc_TypeError, "Hook: group must be the group's __dict__ or None");
    if (!PyCallable_Check(fallback))
        return PyErr_Format(PyExc_TypeError, "Hook: fallback must be callable");
    if (kind == HOOK_POST_FORWARD && !PyCallable_Check(then))
        return PyErr_Format(PyExc_TypeError, "Hook: a post-forward hook's `then` must be the "
                            "pre-backward hook it registers");
    if (kind == HOOK_ARRIVE && (!PyLong_CheckExact(then) || group == Py_None))
        return PyErr_Format(PyExc_TypeError, "Hook: an arrival hook needs the group and its "
                            "parameter's index as `then`");
    if (kind != HOOK_ARRIVE && !tools.tensor_type)
        return PyErr_Format(PyExc_RuntimeError, "Hook: set_hook_tools() was not called");
    if (names_made() < 0)
        return NULL;
    HookObject *h = PyObject_GC_New(HookObject, tp);
    if (!h)
        return NULL;
    h->vectorcall = Hook_vectorcall;
    h->kind = kind;
    h->state = Py_NewRef(state);
    h->group = Py_NewRef(group);
    h->fallback = Py_NewRef(fallback);
    h->then = Py_NewRef(then);
    h->taken = h->passed = 0;
    PyObject_GC_Track(h);
    return (PyObject *)h;
}

static int Hook_traverse(HookObject *h, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(h));
    Py_VISIT(h->state);
    Py_VISIT(h->group);
    Py_VISIT(h->fallback);
    Py_VISIT(h->then);
    return 0;
}

static int Hook_clear(HookObject *h)
{
    Py_CLEAR(h->state);
    Py_CLEAR(h->group);
    Py_CLEAR(h->fallback);
    Py_CLEAR(h->then);
    return 0;
}

static void Hook_dealloc(HookObject *h)
{
    PyTypeObject *tp = Py_TYPE(h);
    PyObject_GC_UnTrack(h);
    Hook_clear(h);
    tp->tp_free(h);
    Py_DECREF(tp);
}

static PyObject *Hook_get_fallback(HookObject *h, void *c)
{
    return Py_NewRef(h->fallback ? h->fallback : Py_None);
}

static PyGetSetDef Hook_getset[] = {
    {"fallback", (getter)Hook_get_fallback, NULL, "the Python hook of every other case", NULL},
    {NULL},
};

static PyMemberDef Hook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(HookObject, vectorcall), READONLY},
    {"kind", T_INT, offsetof(HookObject, kind), READONLY, "HOOK_PRE_FORWARD, ..."},
    {"taken", T_ULONGLONG, offsetof(HookObject, taken), READONLY, "calls run in C (the lane)"},
    {"passed", T_ULONGLONG, offsetof(HookObject, passed), READONLY,
     "calls given to the Python hook"},
    {NULL},
};

static PyType_Slot Hook_slots[] = {
    {Py_tp_new, Hook_new},
    {Py_tp_dealloc, Hook_dealloc},
    {Py_tp_traverse, Hook_traverse},
    {Py_tp_clear, Hook_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_getset, Hook_getset},
    {Py_tp_members, Hook_members},
    {Py_tp_doc, "Hook(kind, state, group, fallback, then=None): one of fully_shard's torch hooks, "
                "its common case in C (csrc/glue/py_hooks.c), every other case fallback(...).\n"
                "state, group: the FSDPState's and its ParamGroup's __dict__ (group None: no "
                "parameters). then: HOOK_POST_FORWARD's pre-backward Hook, HOOK_ARRIVE's "
                "parameter index."},
    {0, NULL},
};

static PyType_Spec Hook_spec = {
    "flatshard._C.Hook", sizeof(HookObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
        Py_TPFLAGS_IMMUTABLETYPE,
    Hook_slots,
};

PyDoc_STRVAR(set_hook_tools_doc,
             "set_hook_tools(profiling, stack_len, grad_enabled, tensor_type, hook_outputs,\n"
             "               dtype_codes, empty_like, contiguous_format, like, run_hooks)\n"
             "What Hook reads from torch and flatshard, given once by fsdp2/state.py: the "
             "profiler's and the dispatch-mode stack's probes (stack_len None where torch has "
             "none), torch.is_grad_enabled, torch.Tensor, runtime.trees.hook_before_backward, "
             "tensors.DTYPE_CODES, torch.empty_like, torch.contiguous_format, fsdp2.param's "
             "_like and runtime.grad_hooks.run_hooks.");

static PyObject *set_hook_tools(PyObject *m, PyObject *args)
{
    PyObject *p, *s, *g, *t, *o, *codes, *el, *cf, *like, *run;
    if (!PyArg_ParseTuple(args, "OOOO!OO!OOOO:set_hook_tools", &p, &s, &g, &PyType_Type, &t, &o,
                          &PyDict_Type, &codes, &el, &cf, &like, &run))
        return NULL;
    if (!PyCallable_Check(p) || (s != Py_None && !PyCallable_Check(s)) ||
        !PyCallable_Check(g) || !PyCallable_Check(o))
        return PyErr_Format(PyExc_TypeError, "set_hook_tools: profiling, grad_enabled and "
                            "hook_outputs must be callable, stack_len callable or None");
    Py_XSETREF(tools.profiling, Py_NewRef(p));
    Py_XSETREF(tools.stack_len, Py_NewRef(s));
    Py_XSETREF(tools.grad_enabled, Py_NewRef(g));
    Py_XSETREF(tools.tensor_type, Py_NewRef(t));
    Py_XSETREF(tools.hook_outputs, Py_NewRef(o));
    Py_XSETREF(tools.dtype_codes, Py_NewRef(codes));
    Py_XSETREF(tools.empty_like, Py_NewRef(el));
    Py_XSETREF(tools.contiguous, Py_NewRef(cf));
    Py_XSETREF(tools.like, Py_NewRef(like));
    Py_XSETREF(tools.run_hooks, Py_NewRef(run));
    Py_RETURN_NONE;
}

static PyMethodDef hooks_methods[] = {
    {"set_hook_tools", set_hook_tools, METH_VARARGS, set_hook_tools_doc},
    {NULL},
};

int fs_hook_type_add(PyObject *module)
{
    PyObject *tp = PyType_FromModuleAndSpec(module, &Hook_spec, NULL);
    int rc = tp ? PyModule_AddObjectRef(module, "Hook", tp) : -1;
    Py_XDECREF(tp);
    if (rc < 0 || PyModule_AddFunctions(module, hooks_methods) < 0 ||
        PyModule_AddIntConstant(module, "HOOK_PRE_FORWARD", HOOK_PRE_FORWARD) < 0 ||
        PyModule_AddIntConstant(module, "HOOK_POST_FORWARD", HOOK_POST_FORWARD) < 0 ||
        PyModule_AddIntConstant(module, "HOOK_PRE_BACKWARD", HOOK_PRE_BACKWARD) < 0 ||
        PyModule_AddIntConstant(module, "HOOK_ARRIVE", HOOK_ARRIVE) < 0)
        return -1;
    return 0;
}
