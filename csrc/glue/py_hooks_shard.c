/* py_hooks_shard.c - fully_shard's hook lane: the common case of its
 * pre-forward, post-forward, pre-backward and post-backward in C, every
 * other case its Python hook ([Note: hook lane] in fsdp2/state.py says when
 * a state may take the lane and which Python steps it leaves out because
 * nothing reads them there).
 *
 * Each call reads the state's and its group's attributes as they are then
 * (their __dict__s) and checks that the Python hook would take its plain
 * path; the lane then does what that path does: the engine group's unshard,
 * reshard or reduce (its own methods, as from Python) and the modules'
 * parameters swapped between the sharded and the unsharded ones. A
 * gradient's arrival is C always: a set insert and a count. */
#include "py_hooks.h"

static PyObject *s_c_hooks, *s_is_root, *s_forward_prefetch, *s_backward_prefetch,
    *s_unshard_async_op, *s_reshard_after_forward, *s_unshard_in_backward, *s_watching,
    *s_hooked_full, *s_hooked, *s_ready, *s_root, *s_tree, *s_final_queued, *s_c, *s_full,
    *s_unsharded, *s_sharded, *s_engine_locals, *s_gathered, *s_heads, *s_slots,
    *s_post_chunk, *s_ext, *s_tp, *s_registered_unsharded, *s_trainable, *s_trainable_mask,
    *s_is_unsharded, *s_unshard, *s_reshard, *s_local_tensor, *s_dict, *s_requires_grad,
    *s_reading, *s_requires_gradient_sync, *s_reshard_after_backward, *s_replicate_comm,
    *s_all_reduce_hook, *s_accumulated, *s_world, *s_divide_factor, *s_force_sum, *s_grad,
    *s_contiguous, *s_dtype, *s_reduce, *s_reduce_pending, *s_finish_reduce, *s_reduced,
    *s_memory_format, *s_reduce_kw, *s_like_kw;

int fs_hook_shard_names(void)
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
    N(s_dict, "__dict__"); N(s_requires_grad, "requires_grad"); N(s_reading, "reading");
    N(s_requires_gradient_sync, "requires_gradient_sync");
    N(s_reshard_after_backward, "reshard_after_backward"); N(s_replicate_comm, "replicate_comm");
    N(s_all_reduce_hook, "all_reduce_hook"); N(s_accumulated, "accumulated");
    N(s_world, "world"); N(s_divide_factor, "divide_factor"); N(s_force_sum, "force_sum");
    N(s_grad, "grad"); N(s_contiguous, "contiguous"); N(s_dtype, "dtype"); N(s_reduce, "reduce");
    N(s_reduce_pending, "reduce_pending"); N(s_finish_reduce, "finish_reduce");
    N(s_reduced, "reduced"); N(s_memory_format, "memory_format");
#undef N
    if (!s_reduce_kw && !(s_reduce_kw = Py_BuildValue("(ssss)", "all_reduce", "hold", "force_sum",
                                                      "bucket")))
        return -1;
    if (!s_like_kw && !(s_like_kw = Py_BuildValue("(O)", s_memory_format)))
        return -1;
    return 0;
}

/* Whether the lane is open for this state now: Python opened it at lazy
 * init (c_hooks), the state has a group, and nothing watches. */
static int lane_open(HookObject *h)
{
    if (fs_item(h->state, s_c_hooks) != Py_True || h->group == Py_None)
        return PyErr_Occurred() ? -1 : 0;
    int t = fs_hook_watched();
    return t < 0 ? -1 : !t;
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
    PyObject *full = fs_item(g, s_full), *un = fs_item(g, s_unsharded), *sh = fs_item(g, s_sharded);
    PyObject *locs = fs_item(g, s_engine_locals), *gath = fs_item(g, s_gathered);
    PyObject *heads = fs_item(g, s_heads), *slots = fs_item(g, s_slots), *ext = fs_item(g, s_ext);
    PyObject *tp = fs_item(g, s_tp);
    *c = fs_item(g, s_c);
    if (PyErr_Occurred())
        return -1;
    if (!full || full == Py_None || !un || !PyList_CheckExact(un) || !sh ||
        !PyList_CheckExact(sh) || !locs || !PyList_CheckExact(locs) || !gath ||
        !PyList_CheckExact(gath) || !heads || !PyList_CheckExact(heads) || !slots ||
        !PyList_CheckExact(slots) || !ext || !PyDict_CheckExact(ext) || PyDict_GET_SIZE(ext) ||
        !tp || !PyDict_CheckExact(tp) || PyDict_GET_SIZE(tp) || !*c ||
        fs_item(g, s_post_chunk) != Py_None || fs_item(g, s_registered_unsharded) != Py_False)
        return PyErr_Occurred() ? -1 : 0;
    *n = PyList_GET_SIZE(sh);
    if (*n < 1 || *n > 62 || PyList_GET_SIZE(un) != *n || PyList_GET_SIZE(locs) != *n ||
        PyList_GET_SIZE(gath) != *n || PyList_GET_SIZE(heads) != *n)
        return 0;
    long long mask = (1LL << *n) - 1;
    PyObject *hooked = fs_item(h->state, s_hooked);
    if (fs_item(h->state, s_hooked_full) != full || !hooked || !PyLong_CheckExact(hooked) ||
        (PyLong_AsLongLong(hooked) & mask) != mask)
        return PyErr_Occurred() ? -1 : 0;
    int t = fs_hook_attr_true(*c, s_is_unsharded);
    if (t != 0)
        return t < 0 ? -1 : 0;
    for (Py_ssize_t i = 0; i < *n; i++) {
        PyObject *head = PyList_GET_ITEM(heads, i), *sp = PyList_GET_ITEM(sh, i);
        if (!PyTuple_CheckExact(head) || PyTuple_GET_SIZE(head) != 2 ||
            !PyDict_Check(PyTuple_GET_ITEM(head, 0)) ||
            PyList_GET_ITEM(gath, i) != Py_True)
            return 0;
        if (fs_item(PyTuple_GET_ITEM(head, 0), PyTuple_GET_ITEM(head, 1)) != sp)
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
        if ((t = fs_hook_attr_true(sp, s_requires_grad)) != 1 ||
            (t = fs_hook_attr_true(PyList_GET_ITEM(un, i), s_requires_grad)) != 1)
            return t;
    }
    return 1;
}

/* The gather of pre-forward and pre-backward: the engine's all-gather, then
 * the unsharded parameters registered, as ParamGroup.unshard() and
 * register_unsharded() do on their plain path. */
static int gather(HookObject *h, PyObject *c, Py_ssize_t n)
{
    PyObject *g = h->group;
    if (fs_hook_call(c, s_unshard, Py_False) < 0 ||
        fs_hook_register(fs_item(g, s_slots), fs_item(g, s_unsharded)) < 0 ||
        fs_hook_set_int(g, s_trainable, n) < 0 ||
        fs_hook_set_int(g, s_trainable_mask, (1LL << n) - 1) < 0)
        return -1;
    return PyDict_SetItem(g, s_registered_unsharded, Py_True);
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
        if (fs_item(st, s_is_root) != Py_False || fs_item(st, s_forward_prefetch) != Py_None ||
            fs_item(st, s_unshard_async_op) != Py_False)
            return PyErr_Occurred() ? -1 : 0;
        return group_ready(h, c, n);
    case HOOK_PRE_BACKWARD: {
        if (fs_item(st, s_unshard_in_backward) != Py_True ||
            fs_item(st, s_backward_prefetch) != Py_None || fs_item(st, s_unshard_async_op) != Py_False)
            return PyErr_Occurred() ? -1 : 0;
        /* the end-of-backward callback is queued (the first pre-backward
         * of each backward queues it, in Python) */
        PyObject *root = fs_item(st, s_root);
        if (!root || root == Py_None)
            return PyErr_Occurred() ? -1 : 0;
        PyObject *tree = PyObject_GetAttr(root, s_tree);
        if (!tree)
            return -1;
        t = tree == Py_None ? 0 : fs_hook_attr_true(tree, s_final_queued);
        Py_DECREF(tree);
        return t != 1 ? t : group_ready(h, c, n);
    }
    case HOOK_POST_FORWARD: {
        PyObject *g = h->group, *ext = fs_item(g, s_ext), *slots = fs_item(g, s_slots);
        if (fs_item(st, s_is_root) != Py_False || fs_item(st, s_reshard_after_forward) != Py_True ||
            fs_item(st, s_watching) != Py_None || !ext || !PyDict_CheckExact(ext) ||
            PyDict_GET_SIZE(ext) || fs_item(g, s_post_chunk) != Py_None || !slots ||
            !PyList_CheckExact(slots) || !(*c = fs_item(g, s_c)))
            return PyErr_Occurred() ? -1 : 0;
        PyObject *sh = fs_item(g, s_sharded);
        return sh && PyList_CheckExact(sh) ? 1 : (PyErr_Occurred() ? -1 : 0);
    }
    }
    return 0;
}

/* The forward hook's lane: the sharded parameters registered back, the
 * group freed (ParamGroup.reshard()), and the pre-backward hook put on the
 * output when autograd records. */
static PyObject *post_forward(HookObject *h, PyObject *c, PyObject *output)
{
    PyObject *g = h->group;
    if (fs_item(g, s_registered_unsharded) != Py_False) {
        if (fs_hook_register(fs_item(g, s_slots), fs_item(g, s_sharded)) < 0 ||
            PyDict_SetItem(g, s_registered_unsharded, Py_False) < 0)
            return NULL;
    }
    int t = fs_hook_attr_true(c, s_is_unsharded);
    if (t < 0)
        return NULL;
    if (t && fs_hook_call(c, s_reshard, NULL) < 0)
        return NULL;
    if ((t = fs_hook_truth(fs_hooks.grad_enabled)) < 0 || (t && fs_hook_outputs(output, h->then) < 0))
        return NULL;
    Py_RETURN_NONE;
}

static int reduce_ready(HookObject *h, Py_ssize_t *n);
static PyObject *post_backward(HookObject *h, Py_ssize_t n);

/* A parameter's gradient has arrived: its index into the state's `ready`
 * set; once every trainable parameter's has, the group's post-backward. */
static PyObject *arrive(HookObject *h)
{
    PyObject *ready = fs_item(h->state, s_ready);
    if (!ready || !PySet_Check(ready)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "Hook: the state's `ready` must be a set");
        return NULL;
    }
    if (PySet_Add(ready, h->then) < 0)
        return NULL;
    PyObject *trainable = fs_item(h->group, s_trainable);
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
    if (fs_hooks.like == Py_None)
        return 0;
    PyObject *st = h->state, *g = h->group;
    PyObject *reading = fs_item(st, s_reading), *acc = fs_item(g, s_accumulated);
    PyObject *un = fs_item(g, s_unsharded), *sh = fs_item(g, s_sharded), *ext = fs_item(g, s_ext);
    PyObject *tp = fs_item(g, s_tp), *slots = fs_item(g, s_slots), *world = fs_item(g, s_world);
    PyObject *trainable = fs_item(g, s_trainable);
    if (PyErr_Occurred())
        return -1;
    if (!reading || !PyList_CheckExact(reading) || PyList_GET_SIZE(reading) ||
        fs_item(st, s_requires_gradient_sync) != Py_True ||
        fs_item(st, s_reshard_after_backward) != Py_True ||
        fs_item(g, s_replicate_comm) != Py_None || fs_item(g, s_all_reduce_hook) != Py_None ||
        fs_item(g, s_post_chunk) != Py_None || !acc || !PyList_CheckExact(acc) || !un ||
        !PyList_CheckExact(un) || !sh || !PyList_CheckExact(sh) || !ext ||
        !PyDict_CheckExact(ext) || PyDict_GET_SIZE(ext) || !tp || !PyDict_CheckExact(tp) ||
        PyDict_GET_SIZE(tp) || !slots || !PyList_CheckExact(slots) || !world ||
        !PyLong_CheckExact(world) || PyLong_AsLong(world) < 2 || !fs_item(g, s_c) || !trainable ||
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
        int plain = Py_TYPE(gr) == (PyTypeObject *)fs_hooks.tensor_type;
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
    PyObject *code = PyDict_GetItemWithError(fs_hooks.dtype_codes, dt);
    Py_DECREF(dt);
    if (!code) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "flatshard: a gradient's dtype is not supported "
                            "by the C core");
        return -1;
    }
    return (int)PyLong_AsLong(code);
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
    if (fs_hook_append_new(lists[0], g) < 0 || fs_hook_append_new(lists[1], PyLong_FromLong(code)) < 0 ||
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
        args[2] = fs_hooks.contiguous;
        out = PyObject_Vectorcall(fs_hooks.empty_like, args + 1, 1, s_like_kw);
        Py_DECREF(local);
    }
    Py_DECREF(cur);
    if (!out)
        return -1;
    if (!add) {
        PyObject *pair = Py_BuildValue("(nO)", i, out);
        if (fs_hook_append_new(lists[5], pair) < 0) {
            Py_DECREF(out);
            return -1;
        }
    }
    code = code_of(out);
    if (code < 0) {
        Py_DECREF(out);
        return -1;
    }
    if (fs_hook_append_new(lists[2], out) < 0 || fs_hook_append_new(lists[3], PyLong_FromLong(code)) < 0 ||
        PyList_Append(lists[4], add ? Py_True : Py_False) < 0)
        return -1;
    return 0;
}

/* FSDPState._post_backward() on the lane: one engine reduce-scatter that
 * also frees the unsharded buffer, the new sharded gradients set, their
 * parameters' hooks run, and the sharded parameters registered back. */
static PyObject *post_backward(HookObject *h, Py_ssize_t n)
{
    PyObject *g = h->group, *lists[6] = {0}, *r = NULL, *c = fs_item(g, s_c);
    PyObject *un = fs_item(g, s_unsharded), *sh = fs_item(g, s_sharded);
    Py_INCREF(c);
    Py_INCREF(un);
    Py_INCREF(sh);
    PySet_Clear(fs_item(h->state, s_ready));
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
    PyObject *f = fs_item(g, s_divide_factor), *fs = fs_item(g, s_force_sum);
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
    int t = fs_hook_attr_true(c, s_reduce_pending);
    if (t < 0)
        goto done;
    if (t && fs_hook_call(c, s_finish_reduce, NULL) < 0)
        goto done;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(lists[5]); k++) {
        PyObject *pair = PyList_GET_ITEM(lists[5], k);
        PyObject *sp = PyList_GET_ITEM(sh, PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0)));
        PyObject *d = PyObject_CallFunctionObjArgs(fs_hooks.like, PyTuple_GET_ITEM(pair, 1), sp,
                                                   NULL);
        if (!d)
            goto done;
        bad = PyObject_SetAttr(sp, s_grad, d);
        Py_DECREF(d);
        if (bad)
            goto done;
    }
    if (fs_hook_run_param_hooks(sh) < 0)
        goto done;
    PyObject *root = fs_item(h->state, s_root), *tree = root ? PyObject_GetAttr(root, s_tree) : NULL;
    if (!tree)
        goto done;
    bad = PyObject_SetAttr(tree, s_reduced, Py_True);
    Py_DECREF(tree);
    if (bad)
        goto done;
    /* ParamGroup.reshard(): the engine's reduce freed the buffer already */
    if (fs_item(g, s_registered_unsharded) != Py_False &&
        (fs_hook_register(fs_item(g, s_slots), sh) < 0 ||
         PyDict_SetItem(g, s_registered_unsharded, Py_False) < 0))
        goto done;
    if ((t = fs_hook_attr_true(c, s_is_unsharded)) < 0)
        goto done;
    if (t && fs_hook_call(c, s_reshard, NULL) < 0)
        goto done;
    r = Py_NewRef(Py_None);
done:
    for (int k = 0; k < 6; k++)
        Py_XDECREF(lists[k]);
    Py_DECREF(c);
    Py_DECREF(un);
    Py_DECREF(sh);
    return r;
}

PyObject *fs_hook_shard_call(HookObject *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (h->kind == HOOK_ARRIVE) {
        if (nargs == 1)
            return arrive(h);
        h->passed++;
        return PyObject_Vectorcall(h->fallback, args, nargs, NULL);
    }
    PyObject *c = NULL;
    Py_ssize_t n = 0;
    int need = h->kind == HOOK_PRE_BACKWARD ? 1 : 3;
    int t = nargs == need ? lane_takes(h, &c, &n) : 0;
    if (t < 0)
        return NULL;
    if (!t) {
        h->passed++;
        return PyObject_Vectorcall(h->fallback, args, nargs, NULL);
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
