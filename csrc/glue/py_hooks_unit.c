/* py_hooks_unit.c - the FSDP1 wrapper's hook lane: the common case of a
 * unit's forward steps, pre-backward and post-backward in C, every other
 * case its Python hook ([Note: unit hook lane] in fsdp/unit.py says when a
 * unit may take the lane and what it leaves out).
 *
 * Each event is one call of the unit's engine object (Unit.event: the
 * state machine's step and the gather, free or reduction it asks for), as
 * from Python; around it the lane makes the parameter views the modules
 * compute on (torch's split and view, called from here) and registers them,
 * records the forward order, and sets the reduced gradients. An engine
 * failure goes through the unit's Python `_failed` (an allocation failure
 * becomes the OutOfMemoryError that names this rank's memory). */
#include "py_hooks.h"

enum { EV_PRE_FORWARD = 0, EV_POST_FORWARD = 1, EV_PRE_BACKWARD = 2, EV_POST_BACKWARD = 3 };
enum { ACT_UNSHARD = 1, ACT_RESHARD = 2, ACT_REDUCE_GRAD = 4, ACT_HOOK_BACKWARD = 8 };
enum { FLAG_GRAD_ENABLED = 1 };

static PyObject *s_c_hooks, *s_root, *s_c, *s_is_root, *s_event, *s_order, *s_current, *s_ran,
    *s_position, *s_groups, *s_compute, *s_split_sizes, *s_view_slots, *s_shapes,
    *s_flat_shaped, *s_targets, *s_view, *s_use_orig_params, *s_final_queued,
    *s_backward_prefetch, *s_state, *s_idle, *s_unshard, *s_failed, *s_sync_grads, *s_grad,
    *s_shard, *s_params, *s_grad_buf, *s_grad_views, *s_shard_numel, *s_dtype, *s_shard_device,
    *s_pinned, *s_entries, *s_narrow, *s_shard_offset, *s_piece_numel, *s_gathered_bytes,
    *s_empty_kw;

int fs_hook_unit_names(void)
{
#define N(var, text) if (!FS_NAME(var, text)) return -1
    N(s_c_hooks, "c_hooks"); N(s_root, "root"); N(s_c, "c"); N(s_is_root, "is_root");
    N(s_event, "event"); N(s_order, "order"); N(s_current, "_current"); N(s_ran, "_ran");
    N(s_position, "position"); N(s_groups, "groups"); N(s_compute, "compute");
    N(s_split_sizes, "split_sizes"); N(s_view_slots, "view_slots"); N(s_shapes, "shapes");
    N(s_flat_shaped, "flat_shaped"); N(s_targets, "targets"); N(s_view, "view");
    N(s_use_orig_params, "use_orig_params"); N(s_final_queued, "final_queued");
    N(s_backward_prefetch, "backward_prefetch"); N(s_state, "state"); N(s_idle, "IDLE");
    N(s_unshard, "unshard"); N(s_failed, "_failed"); N(s_sync_grads, "sync_grads");
    N(s_grad, "grad"); N(s_shard, "shard"); N(s_params, "params"); N(s_grad_buf, "grad_buf");
    N(s_grad_views, "grad_views"); N(s_shard_numel, "shard_numel"); N(s_dtype, "dtype");
    N(s_shard_device, "shard_device"); N(s_pinned, "pinned"); N(s_entries, "entries");
    N(s_narrow, "narrow"); N(s_shard_offset, "shard_offset"); N(s_piece_numel, "piece_numel");
    N(s_gathered_bytes, "gathered_bytes");
#undef N
    if (!s_empty_kw && !(s_empty_kw = Py_BuildValue("(sss)", "dtype", "device", "pin_memory")))
        return -1;
    return 0;
}

/* r, or (r NULL) the failed engine call's exception given to the unit's
 * _failed(exc), which raises what it becomes. */
static PyObject *engine_result(PyObject *unit, PyObject *r)
{
    if (r || !(PyErr_ExceptionMatches(PyExc_RuntimeError) ||
               PyErr_ExceptionMatches(PyExc_MemoryError)))
        return r;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb)
        PyException_SetTraceback(v, tb);
    PyObject *again = PyObject_CallMethodOneArg(unit, s_failed, v);
    Py_XDECREF(again); /* it raises; a return would be a bug of _failed's */
    if (again)
        PyErr_Restore(t, v, tb);
    else {
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
    }
    return NULL;
}

/* c.event(ev, flags, group, grad, out, accumulate): the actions, or -1. */
static long event(PyObject *unit, PyObject *c, int ev, int flags, int group, PyObject *grad,
                  PyObject *out, int accumulate)
{
    PyObject *evo = PyLong_FromLong(ev), *fo = PyLong_FromLong(flags), *go = PyLong_FromLong(group);
    long act = -1;
    if (evo && fo && go) {
        PyObject *args[8] = {c, evo, fo, go, grad ? grad : Py_None, out ? out : Py_None,
                             accumulate ? Py_True : Py_False, Py_False};
        PyObject *r = engine_result(unit, PyObject_VectorcallMethod(
                                              s_event, args, 8 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                              NULL));
        if (r) {
            act = PyLong_AsLong(r);
            Py_DECREF(r);
        }
    }
    Py_XDECREF(evo);
    Py_XDECREF(fo);
    Py_XDECREF(go);
    return act;
}

/* The unit's lane is open and it is not the root, whose steps begin and end
 * the forward: 1, 0, -1. *root and *c borrowed from the unit's dict. */
static int lane_open(HookObject *h, PyObject **root, PyObject **c)
{
    PyObject *u = h->state;
    *root = fs_item(u, s_root);
    *c = fs_item(u, s_c);
    if (fs_item(u, s_c_hooks) != Py_True || !*root || *root == Py_None || !*c)
        return PyErr_Occurred() ? -1 : 0;
    int t = fs_hook_attr_true(*c, s_is_root);
    return t < 0 ? -1 : !t;
}

/* ForwardOrder's __dict__ (new reference), from the root. */
static PyObject *order_dict(PyObject *root)
{
    PyObject *order = PyObject_GetAttr(root, s_order);
    if (!order)
        return NULL;
    PyObject *d = PyObject_GenericGetDict(order, NULL);
    Py_DECREF(order);
    return d;
}

/* ForwardOrder.record(unit), its result unused (no forward prefetch). */
static int record(PyObject *root, PyObject *unit)
{
    PyObject *od = order_dict(root);
    if (!od)
        return -1;
    PyObject *cur = fs_item(od, s_current), *ran = fs_item(od, s_ran);
    int rc = 0;
    if (cur && cur != Py_None) {
        PyObject *id = PyLong_FromVoidPtr(unit);
        rc = id && ran && PySet_Check(ran) && PyList_Check(cur) && PySet_Add(ran, id) == 0 ? 0 : -1;
        Py_XDECREF(id);
        Py_ssize_t n = rc == 0 ? PyList_GET_SIZE(cur) : 0;
        if (rc == 0 && (n == 0 || PyList_GET_ITEM(cur, n - 1) != unit))
            rc = PyList_Append(cur, unit);
        if (rc < 0 && !PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "flatshard: the forward order's record is broken");
    }
    Py_DECREF(od);
    return PyErr_Occurred() ? -1 : rc;
}

/* ForwardOrder.previous(unit) (new reference, None for none). */
static PyObject *previous(PyObject *root, PyObject *unit)
{
    PyObject *od = order_dict(root);
    if (!od)
        return NULL;
    PyObject *pos = fs_item(od, s_position), *order = fs_item(od, s_order), *r = NULL;
    PyObject *id = PyLong_FromVoidPtr(unit);
    PyObject *i = id && pos && PyDict_Check(pos) ? fs_item(pos, id) : NULL;
    Py_ssize_t k = i ? PyLong_AsSsize_t(i) : 0;
    if (!PyErr_Occurred())
        r = Py_NewRef(k > 0 && order && PyList_Check(order) && k <= PyList_GET_SIZE(order)
                          ? PyList_GET_ITEM(order, k - 1)
                          : Py_None);
    Py_XDECREF(id);
    Py_DECREF(od);
    return r;
}

/* Each group's views of its compute buffer, shaped as its parameters,
 * set as the modules' attributes (FlatGroup.unsharded_views and
 * UnitRuntime._set_unsharded_views). */
static int set_views(PyObject *groups)
{
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(groups); k++) {
        PyObject *g = PyObject_GenericGetDict(PyList_GET_ITEM(groups, k), NULL);
        if (!g)
            return -1;
        PyObject *compute = fs_item(g, s_compute), *sizes = fs_item(g, s_split_sizes);
        PyObject *slots = fs_item(g, s_view_slots), *shapes = fs_item(g, s_shapes);
        PyObject *flat = fs_item(g, s_flat_shaped), *targets = fs_item(g, s_targets);
        PyObject *chunks = NULL, *views = NULL;
        int rc = -1;
        if (!compute || !sizes || !slots || !PyList_Check(slots) || !shapes || !flat ||
            !targets || !PyList_Check(targets)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "flatshard: a flat group lacks its views' plan");
            goto next;
        }
        chunks = PyObject_CallFunctionObjArgs(fs_hooks.split, compute, sizes, NULL);
        Py_ssize_t n = PyList_GET_SIZE(slots);
        if (!chunks || !(views = PyList_New(n)))
            goto next;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t s = PyLong_AsSsize_t(PyList_GET_ITEM(slots, i));
            PyObject *chunk = s >= 0 ? PySequence_GetItem(chunks, s) : NULL;
            PyObject *is_flat = chunk ? PySequence_GetItem(flat, i) : NULL;
            int f = is_flat ? PyObject_IsTrue(is_flat) : -1;
            Py_XDECREF(is_flat);
            PyObject *v = NULL;
            if (f == 1) { /* a 1-D parameter's chunk is its view already */
                v = chunk;
                chunk = NULL;
            } else if (f == 0) {
                PyObject *shape = PySequence_GetItem(shapes, i);
                v = shape ? fs_hook_method(chunk, s_view, shape) : NULL;
                Py_XDECREF(shape);
            }
            Py_XDECREF(chunk);
            if (!v)
                goto next;
            PyList_SET_ITEM(views, i, v);
        }
        rc = fs_hook_register(targets, views);
    next:
        Py_XDECREF(chunks);
        Py_XDECREF(views);
        Py_DECREF(g);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* use_orig_params: the views dropped from the modules again (the
 * registered parameters show); else they stay as the modules' attributes. */
static int clear_views(PyObject *u, PyObject *groups)
{
    if (fs_item(u, s_use_orig_params) != Py_True)
        return PyErr_Occurred() ? -1 : 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(groups); k++) {
        PyObject *targets = PyObject_GetAttr(PyList_GET_ITEM(groups, k), s_targets);
        if (!targets)
            return -1;
        for (Py_ssize_t i = 0; PyList_Check(targets) && i < PyList_GET_SIZE(targets); i++) {
            PyObject *t = PyList_GET_ITEM(targets, i);
            if (PyTuple_Check(t) && PyTuple_GET_SIZE(t) == 3 &&
                PyDict_Check(PyTuple_GET_ITEM(t, 0)) &&
                PyDict_DelItem(PyTuple_GET_ITEM(t, 0), PyTuple_GET_ITEM(t, 1)) < 0) {
                if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
                    Py_DECREF(targets);
                    return -1;
                }
                PyErr_Clear();
            }
        }
        Py_DECREF(targets);
    }
    return 0;
}

static PyObject *groups_of(PyObject *u)
{
    PyObject *groups = fs_item(u, s_groups);
    if (!groups || !PyList_Check(groups)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "flatshard: a unit's groups must be a list");
        return NULL;
    }
    return groups;
}

static int grad_flag(void)
{
    int t = fs_hook_truth(fs_hooks.grad_enabled);
    return t < 0 ? -1 : (t ? FLAG_GRAD_ENABLED : 0);
}

/* FSDP._pre_forward(args, kwargs) and UnitRuntime.pre_forward: the engine's
 * pre-forward (its gather), the order recorded, the views set. */
static PyObject *pre_forward(HookObject *h, PyObject *c, PyObject *root, PyObject *const *args)
{
    PyObject *groups = groups_of(h->state);
    int flags = grad_flag();
    if (!groups || flags < 0 ||
        event(h->owner, c, EV_PRE_FORWARD, flags, -1, NULL, NULL, 0) < 0 ||
        record(root, h->owner) < 0 || set_views(groups) < 0)
        return NULL;
    return PyTuple_Pack(2, args[0], args[1]);
}

/* FSDP._post_forward(out) and UnitRuntime.post_forward. */
static PyObject *post_forward(HookObject *h, PyObject *c, PyObject *out)
{
    PyObject *groups = groups_of(h->state);
    int flags = grad_flag();
    long act = groups && flags >= 0 ? event(h->owner, c, EV_POST_FORWARD, flags, -1, NULL, NULL, 0)
                                    : -1;
    if (act < 0 || clear_views(h->state, groups) < 0 ||
        ((act & ACT_HOOK_BACKWARD) && fs_hook_outputs(out, h->then) < 0))
        return NULL;
    return Py_NewRef(out);
}

/* UnitRuntime._pre_backward: the engine's pre-backward; the views again
 * where a recomputed forward reads them (use_orig_params, made with grad
 * on); the previous unit prefetched under BACKWARD_PRE. */
static PyObject *pre_backward(HookObject *h, PyObject *c, PyObject *root)
{
    PyObject *u = h->state, *groups = groups_of(u);
    long act = groups ? event(h->owner, c, EV_PRE_BACKWARD, 0, -1, NULL, NULL, 0) : -1;
    if (act < 0)
        return NULL;
    if (!(act & ACT_UNSHARD))
        Py_RETURN_NONE;
    if (fs_item(u, s_use_orig_params) == Py_True) {
        int was = fs_hook_truth(fs_hooks.grad_enabled);
        PyObject *r = was < 0 ? NULL : PyObject_CallOneArg(fs_hooks.set_grad, Py_True);
        if (!r)
            return NULL;
        Py_DECREF(r);
        int rc = set_views(groups);
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        r = PyObject_CallOneArg(fs_hooks.set_grad, was ? Py_True : Py_False);
        Py_XDECREF(r);
        if (t)
            PyErr_Restore(t, v, tb);
        if (rc < 0 || !r)
            return NULL;
    }
    PyObject *bp = fs_item(u, s_backward_prefetch);
    if (bp != fs_hooks.backward_pre)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *prev = previous(root, h->owner);
    if (!prev)
        return NULL;
    int rc = 0;
    if (prev != Py_None) {
        PyObject *pc = PyObject_GetAttr(prev, s_c), *state = pc ? PyObject_GetAttr(pc, s_state)
                                                                : NULL;
        int idle = state ? PyUnicode_Compare(state, s_idle) == 0 : -1;
        if (idle < 0 || (idle && fs_hook_call(prev, s_unshard, Py_True) < 0))
            rc = -1;
        Py_XDECREF(state);
        Py_XDECREF(pc);
    }
    Py_DECREF(prev);
    return rc < 0 || PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

/* Where the reduction lands (UnitRuntime._plan_reduce's host path): *out
 * (new reference) and *accumulate; 0: not the lane's case (a gradient the
 * user set is kept and added: Python's), -1: error. */
static int plan_reduce(PyObject *u, PyObject *g, PyObject **out, int *accumulate)
{
    PyObject *gd = PyObject_GenericGetDict(g, NULL);
    if (!gd)
        return -1;
    int rc = -1;
    *out = NULL;
    *accumulate = 0;
    if (fs_item(u, s_use_orig_params) != Py_True) {
        PyObject *shard = fs_item(gd, s_shard);
        PyObject *cur = shard ? PyObject_GetAttr(shard, s_grad) : NULL;
        if (cur && cur != Py_None) {
            *out = cur;
            *accumulate = 1;
            rc = 1;
            goto done;
        }
        Py_XDECREF(cur);
        if (!shard || !cur)
            goto done;
    } else {
        PyObject *params = fs_item(gd, s_params), *buf = fs_item(gd, s_grad_buf);
        PyObject *views = fs_item(gd, s_grad_views);
        if (!params || !PyList_Check(params))
            goto done;
        int same = buf && buf != Py_None && views && PyList_Check(views) &&
                   PyList_GET_SIZE(views) == PyList_GET_SIZE(params);
        int none = 1;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
            PyObject *cur = PyObject_GetAttr(PyList_GET_ITEM(params, i), s_grad);
            if (!cur)
                goto done;
            same = same && cur == PyList_GET_ITEM(views, i);
            none = none && cur == Py_None;
            Py_DECREF(cur);
        }
        if (same) {
            *out = Py_NewRef(buf);
            *accumulate = 1;
            rc = 1;
            goto done;
        }
        if (!none) {
            rc = 0;
            goto done;
        }
    }
    /* a new shard-sized gradient: FlatGroup.new_shard() */
    PyObject *n = fs_item(gd, s_shard_numel), *dt = fs_item(gd, s_dtype);
    PyObject *dev = fs_item(gd, s_shard_device), *pin = fs_item(gd, s_pinned);
    if (!n || !dt || !dev || !pin)
        goto done;
    PyObject *args[4] = {n, dt, dev, pin};
    *out = PyObject_Vectorcall(fs_hooks.empty, args, 1, s_empty_kw);
    rc = *out ? 1 : -1;
done:
    if (rc < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "flatshard: a flat group lacks what its reduction needs");
    Py_DECREF(gd);
    return rc;
}

/* A new reduced gradient set (UnitRuntime._set_reduced): the flat shard's
 * .grad, or (use_orig_params) each parameter's piece of it. */
static int set_reduced(PyObject *u, PyObject *g, PyObject *out)
{
    if (fs_item(u, s_use_orig_params) != Py_True) {
        PyObject *shard = PyObject_GetAttr(g, s_shard);
        int rc = shard ? PyObject_SetAttr(shard, s_grad, out) : -1;
        Py_XDECREF(shard);
        return rc;
    }
    PyObject *gd = PyObject_GenericGetDict(g, NULL);
    if (!gd)
        return -1;
    PyObject *params = fs_item(gd, s_params), *entries = fs_item(gd, s_entries), *views = NULL;
    int rc = -1;
    if (!params || !PyList_Check(params) || !entries || !PyList_Check(entries) ||
        PyList_GET_SIZE(entries) != PyList_GET_SIZE(params) ||
        !(views = PyList_New(PyList_GET_SIZE(params))))
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
        PyObject *e = PyList_GET_ITEM(entries, i);
        PyObject *off = PyObject_GetAttr(e, s_shard_offset), *len = off ? PyObject_GetAttr(
                                                                              e, s_piece_numel)
                                                                        : NULL;
        PyObject *v = NULL;
        if (len) {
            PyObject *zero = PyLong_FromLong(0);
            PyObject *args[4] = {out, zero, off, len};
            v = zero ? PyObject_VectorcallMethod(s_narrow, args,
                                                 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)
                     : NULL;
            Py_XDECREF(zero);
        }
        Py_XDECREF(off);
        Py_XDECREF(len);
        if (!v || PyObject_SetAttr(PyList_GET_ITEM(params, i), s_grad, v) < 0) {
            Py_XDECREF(v);
            goto done;
        }
        PyList_SET_ITEM(views, i, v);
    }
    rc = PyDict_SetItem(gd, s_grad_buf, out) == 0 && PyDict_SetItem(gd, s_grad_views, views) == 0
             ? 0
             : -1;
done:
    if (rc < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "flatshard: a flat group lacks its entries");
    Py_XDECREF(views);
    Py_DECREF(gd);
    return rc;
}

/* UnitRuntime._post_backward(gi, full) on the host path: 1 done, 0 not the
 * lane's case (nothing changed), -1 error. */
static int post_backward(HookObject *h, PyObject *c, PyObject *root, PyObject *full)
{
    PyObject *u = h->state, *groups = groups_of(u);
    if (!groups)
        return -1;
    Py_ssize_t gi = PyLong_AsSsize_t(h->then);
    if (gi < 0 || gi >= PyList_GET_SIZE(groups))
        return PyErr_Occurred() ? -1 : 0;
    if (fs_item(u, s_sync_grads) != Py_True)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *g = PyList_GET_ITEM(groups, gi), *grad = PyObject_GetAttr(full, s_grad), *out = NULL;
    if (!grad)
        return -1;
    int accumulate, rc = grad == Py_None ? 0 : plan_reduce(u, g, &out, &accumulate);
    if (rc != 1)
        goto done;
    rc = -1;
    Py_INCREF(g);
    long act = PyObject_SetAttr(full, s_grad, Py_None) < 0
                   ? -1
                   : event(h->owner, c, EV_POST_BACKWARD, 0, (int)gi, grad, out, accumulate);
    int orig = fs_item(u, s_use_orig_params) == Py_True;
    if (act >= 0 && (act & ACT_REDUCE_GRAD) && !accumulate && set_reduced(u, g, out) < 0)
        act = -1;
    if (act >= 0 && orig && (act & ACT_REDUCE_GRAD)) {
        PyObject *params = PyObject_GetAttr(g, s_params);
        if (!params || fs_hook_run_param_hooks(params) < 0)
            act = -1;
        Py_XDECREF(params);
    }
    Py_DECREF(g);
    if (act < 0)
        goto done;
    if (act & ACT_RESHARD) {
        /* the heap trim's account ([Note: heap trim]): last when only the
         * root is left */
        PyObject *prev = clear_views(u, groups) < 0 ? NULL : previous(root, h->owner);
        if (!prev)
            goto done;
        int last = 1;
        if (prev != Py_None) {
            PyObject *pc = PyObject_GetAttr(prev, s_c);
            last = pc ? fs_hook_attr_true(pc, s_is_root) : -1;
            Py_XDECREF(pc);
        }
        Py_DECREF(prev);
        PyObject *bytes = fs_item(u, s_gathered_bytes);
        if (last < 0 || !bytes)
            goto done;
        PyObject *r = PyObject_CallFunctionObjArgs(fs_hooks.heap_freed, bytes,
                                                   last ? Py_True : Py_False, NULL);
        if (!r)
            goto done;
        Py_DECREF(r);
    }
    rc = 1;
done:
    Py_DECREF(grad);
    Py_XDECREF(out);
    return rc;
}

PyObject *fs_hook_unit_call(HookObject *h, PyObject *const *args, Py_ssize_t nargs)
{
    static const Py_ssize_t want[] = {2, 1, 1, 1}; /* each kind's arguments */
    PyObject *root, *c, *r = NULL;
    int t = nargs == want[h->kind - HOOK_UNIT_PRE_FORWARD] ? lane_open(h, &root, &c) : 0;
    if (t == 1 && h->kind == HOOK_UNIT_PRE_BACKWARD) /* the root's callback is queued */
        t = fs_hook_attr_true(root, s_final_queued);
    if (t < 0)
        return NULL;
    if (!t) {
        h->passed++;
        return PyObject_Vectorcall(h->fallback, args, nargs, NULL);
    }
    Py_INCREF(root);
    Py_INCREF(c);
    switch (h->kind) {
    case HOOK_UNIT_PRE_FORWARD:
        r = pre_forward(h, c, root, args);
        break;
    case HOOK_UNIT_POST_FORWARD:
        r = post_forward(h, c, args[0]);
        break;
    case HOOK_UNIT_PRE_BACKWARD:
        r = pre_backward(h, c, root);
        break;
    default:
        t = post_backward(h, c, root, args[0]);
        r = t == 1 ? Py_NewRef(Py_None) : NULL;
    }
    Py_DECREF(root);
    Py_DECREF(c);
    if (t == 0) { /* the post-backward's own checks sent it to Python */
        h->passed++;
        return PyObject_Vectorcall(h->fallback, args, nargs, NULL);
    }
    if (r)
        h->taken++;
    return r;
}
