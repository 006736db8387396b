/* unit_events.c - an FSDP1 unit's backward events, which the object torch
 * calls runs (glue/py_unit_hook.c).
 *
 *   flatshard._C.UnitHook(UNIT_PRE_BACKWARD, unit)   the hook where backward
 *       reaches the unit's forward outputs (runtime/trees.hook_before_backward)
 *   flatshard._C.UnitHook(UNIT_POST_BACKWARD, unit, group)   the group's
 *       compute buffer's post-accumulate-grad hook
 *
 * [Note: unit plain events] The pre-backward is one sequence, here, for
 * every case: queue the end of backward once (the root's Latch), gather the
 * unit, and if it gathered set the unsharded views (use_orig_params: a
 * Python step, views()) and prefetch the unit that ran before it in forward
 * (BACKWARD_PRE). The gather is the engine's call from C, or where units
 * join it (gather-ahead with the prefetch) or on a device Python's
 * (on_pre_backward: the same engine call with the units it joins). At each
 * group's post-backward, the plain path takes the unsharded gradient,
 * reduces it into the flat shard's gradient (a new one, or added to the one
 * there), runs the shard's post-accumulate-grad hooks, and once the unit
 * reshards, prefetches (BACKWARD_POST) and counts the freed bytes for the
 * heap trim: in C, over the unit's own fields (glue/unit_object.h). Python
 * hands what the events depend on when that changes (fsdp/unit.py
 * UnitRuntime.hand_plain: the FS_UNIT_* flags, the root's Latch;
 * RootState.hand_order: `prev`), and what can change within a step is
 * checked at each call with a few reads: a gradient that is not a plain
 * tensor (a subclass: Python decides), a shard gradient the user set to
 * one. Otherwise the post-backward calls the unit's Python method
 * (fsdp/unit.py _post_backward), which handles every case (use_orig_params'
 * views, the bucket, SHARD_OPTIM, offload, no_sync, a device's deferred
 * reduction) through the same Unit and the C here for the parts they share
 * (released). The forward's events stay Python's: the wrapper's forward is
 * a Python method anyway, and the views it sets cost the same from either
 * side (benchmarks/results/overhead.md, "The FSDP1 wrapper's backward
 * events in C").
 *
 * CPython C API only; torch is reached through the callables handed in and
 * its public tensor API (grad, _post_accumulate_grad_hooks). */
#include "unit_events.h"

#include "tensor.h"

#include "py_group.h"
#include "py_latch.h"
#include "py_pool.h"

static PyObject *hand_error(UnitObject *u)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb && v)
        PyException_SetTraceback(v, tb);
    PyObject *owner = u->owner && u->on_error ? fs_weak_get(u->owner) : NULL;
    if (!owner) {
        if (PyErr_Occurred()) {
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        } else {
            PyErr_Restore(t, v, tb);
        }
        return NULL;
    }
    PyObject *r = PyObject_CallFunctionObjArgs(u->on_error, owner, v ? v : Py_None, NULL);
    Py_DECREF(owner);
    Py_XDECREF(t);
    Py_XDECREF(v);
    Py_XDECREF(tb);
    if (r) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_RuntimeError, "flatshard: a unit's on_error returned");
    }
    return NULL;
}

/* One engine call of u's state machine, with its work (fs_unit_dispatch);
 * 0, or -1 with the error handed to the owner. */
static int step(UnitObject *u, int ev, int group, PyObject *grad, PyObject *out, int accumulate,
                unsigned *act)
{
    if (fs_glue_group_bind(FS_GROUP(u)) < 0)
        return -1;
    const fs_unit_event_work w = {0, group, grad, out, accumulate, 0, NULL, NULL, 0, 0};
    int failed;
    fs_status s = fs_unit_dispatch(&u->u, ev, &w, act, &failed);
    if (s == FS_OK)
        return 0;
    Py_XDECREF(FS_GROUP(u)->done(FS_GROUP(u), s));
    hand_error(u);
    return -1;
}

int fs_hooks_unit_prefetch_previous(UnitObject *u)
{
    UnitObject *p = (UnitObject *)u->prev;
    if (!p || !p->ready || p->u.fsm.state != FS_STATE_IDLE)
        return 0;
    if (fs_glue_group_bind(FS_GROUP(p)) < 0)
        return -1;
    PyObject *d = FS_GROUP(p)->done(FS_GROUP(p), fs_unit_unshard(&p->u, 0, 1));
    if (!d) {
        hand_error(p);
        return -1;
    }
    Py_DECREF(d);
    return 0;
}

int fs_hooks_unit_released(UnitObject *u)
{
    if ((u->plain & FS_UNIT_PREFETCH_POST) && fs_hooks_unit_prefetch_previous(u) < 0)
        return -1;
    if (!u->comm->dev) {
        const UnitObject *p = (const UnitObject *)u->prev;
        fs_glue_heap_freed(fs_unit_gathered_bytes(&u->u), !p || p->u.cfg.is_root);
    }
    return 0;
}

/* fn(owner, *args) for the Python unit; None where it is gone (nobody to
 * run it for). */
static PyObject *call_unit(UnitObject *u, PyObject *fn, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *owner = u->owner && fn ? fs_weak_get(u->owner) : NULL;
    if (!owner)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *stack[3] = {owner, nargs > 0 ? args[0] : Py_None, nargs > 1 ? args[1] : Py_None};
    PyObject *r = PyObject_Vectorcall(fn, stack, (size_t)nargs + 1, NULL);
    Py_DECREF(owner);
    return r;
}

/* The pre-backward, one sequence: the end of backward queued (once per
 * backward: the root's Latch), the gather (in C, or with gather-ahead's
 * units joined or on a device Python's on_pre_backward), then if it
 * gathered the unsharded views (FS_UNIT_VIEWS) and the BACKWARD_PRE
 * prefetch of the unit before. 0, or -1 with an exception set. */
static int pre_backward(UnitObject *u)
{
    PyObject *latch = u->latch ? fs_weak_get(u->latch) : NULL;
    if (u->latch && !latch && PyErr_Occurred())
        return -1;
    int f = latch ? fs_glue_latch_fire(latch) : 0;
    Py_XDECREF(latch);
    if (f < 0)
        return -1;
    unsigned act;
    if ((u->plain & FS_UNIT_PLAIN_PRE_BACKWARD) && !u->comm->dev) {
        if (step(u, FS_EV_PRE_BACKWARD, -1, NULL, NULL, 0, &act) < 0)
            return -1;
    } else {
        PyObject *r = call_unit(u, u->on_pre_backward, NULL, 0);
        act = r && r != Py_None ? (unsigned)PyLong_AsUnsignedLongMask(r) : 0;
        Py_XDECREF(r);
        if (!r || PyErr_Occurred())
            return -1;
    }
    if (!(act & FS_ACT_UNSHARD))
        return 0;
    if (u->plain & FS_UNIT_VIEWS) {
        PyObject *r = call_unit(u, u->views, NULL, 0);
        if (!r)
            return -1;
        Py_DECREF(r);
    }
    if ((u->plain & FS_UNIT_PREFETCH_PRE) && fs_hooks_unit_prefetch_previous(u) < 0)
        return -1;
    return 0;
}

/* The plain post-backward of group gi, whose compute buffer `full` has its
 * gradient: 1 done, 0 not plain now (nothing done), -1. */
static int post_backward(UnitObject *u, int gi, PyObject *full)
{
    static PyObject *s_grad;
    if (!(u->plain & FS_UNIT_PLAIN_POST_BACKWARD) || !u->latch || u->comm->dev ||
        gi >= u->u.ngroups || !FS_NAME(s_grad, "grad"))
        return PyErr_Occurred() ? -1 : 0;
    const fs_unit_group *g = &u->u.groups[gi];
    PyObject *shard = g->shard, *compute = g->lp ? g->lp : g->full;
    if (full != compute)
        return 0;
    PyObject *grad = PyObject_GetAttr(full, s_grad), *cur = NULL, *out = NULL;
    if (!grad)
        return -1;
    int r = 0;
    if (!Py_IS_TYPE(grad, (PyTypeObject *)u->tensor))  /* None, or a subclass: Python's */
        goto out;
    if (!(cur = PyObject_GetAttr(shard, s_grad))) {
        r = -1;
        goto out;
    }
    if (cur != Py_None && !Py_IS_TYPE(cur, (PyTypeObject *)u->tensor))
        goto out;
    const int hooks = shard != compute ? fs_hooks_grad_hooks_due(shard) : 0;
    if (hooks < 0 || PyObject_SetAttr(full, s_grad, Py_None) < 0) {
        r = -1;
        goto out;
    }
    const int accumulate = cur != Py_None;
    out = accumulate ? Py_NewRef(cur) : PyObject_CallOneArg(u->empty_like, shard);
    unsigned act;
    r = -1;
    if (!out || step(u, FS_EV_POST_BACKWARD, gi, grad, out, accumulate, &act) < 0)
        goto out;
    if ((act & FS_ACT_REDUCE_GRAD) && !accumulate && PyObject_SetAttr(shard, s_grad, out) < 0)
        goto out;
    if ((act & FS_ACT_REDUCE_GRAD) && hooks) {
        PyObject *t = PyTuple_Pack(1, shard);
        PyObject *h = t ? PyObject_CallOneArg(u->run_hooks, t) : NULL;
        Py_XDECREF(t);
        if (!h)
            goto out;
        Py_DECREF(h);
    }
    if ((act & FS_ACT_RESHARD) && fs_hooks_unit_released(u) < 0)
        goto out;
    r = 1;
out:
    Py_DECREF(grad);
    Py_XDECREF(cur);
    Py_XDECREF(out);
    return r;
}

PyObject *fs_hooks_unit_event(UnitObject *u, int kind, int group, PyObject *arg)
{
    if (!u->ready)
        Py_RETURN_NONE;
    if (kind == FS_UNIT_HOOK_PRE_BACKWARD)
        return pre_backward(u) < 0 ? NULL : Py_NewRef(Py_None);
    int p = post_backward(u, group, arg);
    if (p < 0)
        return NULL;
    if (p)
        Py_RETURN_NONE;
    PyObject *a[2] = {PyLong_FromLong(group), arg};
    PyObject *r = a[0] ? call_unit(u, u->on_post_backward, a, 2) : NULL;
    Py_XDECREF(a[0]);
    return r;
}
