/* py_unit_events.c - an FSDP1 unit's plain backward events: the one
 * implementation of each one's plain path, and the object torch calls for
 * them (no Python frame between torch and the engine).
 *
 *   flatshard._C.UnitHook(UNIT_PRE_BACKWARD, unit)   the hook where backward
 *       reaches the unit's forward outputs (runtime/trees.hook_before_backward)
 *   flatshard._C.UnitHook(UNIT_POST_BACKWARD, unit, group)   the group's
 *       compute buffer's post-accumulate-grad hook
 *
 * [Note: unit plain events] Every step of an ordinary training takes the same
 * path through a unit's backward: at the pre-backward, queue the end of
 * backward once (the root's Latch), gather the unit and prefetch the unit
 * that ran before it in forward (BACKWARD_PRE); at each group's
 * post-backward, take the unsharded gradient, reduce it into the flat
 * shard's gradient (a new one, or added to the one there), run the shard's
 * post-accumulate-grad hooks, and once the unit reshards, prefetch
 * (BACKWARD_POST) and count the freed bytes for the heap trim. That path is
 * written once, here, over the unit's own fields (py_unit.h): Python hands
 * what it depends on when that changes (fsdp/unit.py UnitRuntime.hand_plain:
 * the FS_UNIT_PLAIN_* flags, the root's Latch; RootState.hand_order: `prev`),
 * and what can change within a step is checked at each call with a few
 * reads: a gradient that is not a plain tensor (a subclass: Python decides),
 * a shard gradient the user set to one. Otherwise the hook calls its
 * fallback, the unit's Python method (fsdp/unit.py), which handles every
 * case and reaches the engine through the same Unit, and calls the C here
 * for the parts they share (prefetch_previous, released). The forward's
 * events stay Python's: the wrapper's forward is a Python method anyway, and
 * the views it sets cost the same from either side (benchmarks/results/
 * overhead.md, "The FSDP1 wrapper's backward events in C").
 *
 * CPython C API only; torch is reached through the callables handed in and
 * its public tensor API (grad, _post_accumulate_grad_hooks). */
#include "py_unit.h"

#include <stddef.h>
#include <structmember.h>

int64_t fs_glue_unit_gathered_bytes(const UnitObject *u)
{
    int64_t n = 0;
    for (int i = 0; i < u->u.ngroups; i++)
        n += u->u.groups[i].padded_numel * (int64_t)fs_dtype_size(u->u.groups[i].compute);
    return n;
}

PyObject *fs_glue_unit_failed(UnitObject *u)
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
    Py_XDECREF(fs_glue_unit_done(u, s));
    fs_glue_unit_failed(u);
    return -1;
}

int fs_glue_unit_prefetch_previous(UnitObject *u)
{
    UnitObject *p = (UnitObject *)u->prev;
    if (!p || !p->ready || p->u.fsm.state != FS_STATE_IDLE)
        return 0;
    if (fs_glue_group_bind(FS_GROUP(p)) < 0)
        return -1;
    PyObject *d = fs_glue_unit_done(p, fs_unit_unshard(&p->u, 0, 1));
    if (!d) {
        fs_glue_unit_failed(p);
        return -1;
    }
    Py_DECREF(d);
    return 0;
}

int fs_glue_unit_released(UnitObject *u)
{
    if ((u->plain & FS_UNIT_PREFETCH_POST) && fs_glue_unit_prefetch_previous(u) < 0)
        return -1;
    if (!u->comm->dev) {
        const UnitObject *p = (const UnitObject *)u->prev;
        fs_glue_heap_freed(fs_glue_unit_gathered_bytes(u), !p || p->u.cfg.is_root);
    }
    return 0;
}

/* 1: `t`'s post-accumulate-grad hooks are there; 0: none; -1 with an exception */
static int hooks_due(PyObject *t)
{
    static PyObject *s_hooks;
    PyObject *h = FS_NAME(s_hooks, "_post_accumulate_grad_hooks") ? PyObject_GetAttr(t, s_hooks)
                                                                   : NULL;
    if (!h) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int due = h != Py_None ? PyObject_IsTrue(h) : 0;
    Py_DECREF(h);
    return due;
}

/* The plain pre-backward: 1 done, 0 not plain now (nothing done), -1. */
static int pre_backward(UnitObject *u)
{
    if (!(u->plain & FS_UNIT_PLAIN_PRE_BACKWARD) || !u->latch || u->comm->dev)
        return 0;
    PyObject *latch = fs_weak_get(u->latch);
    if (!latch)  /* the root is gone: Python's */
        return PyErr_Occurred() ? -1 : 0;
    int f = fs_glue_latch_fire(latch);
    Py_DECREF(latch);
    if (f < 0)
        return -1;
    unsigned act;
    if (step(u, FS_EV_PRE_BACKWARD, -1, NULL, NULL, 0, &act) < 0)
        return -1;
    if ((act & FS_ACT_UNSHARD) && (u->plain & FS_UNIT_PREFETCH_PRE) &&
        fs_glue_unit_prefetch_previous(u) < 0)
        return -1;
    return 1;
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
    const int hooks = shard != compute ? hooks_due(shard) : 0;
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
    if ((act & FS_ACT_RESHARD) && fs_glue_unit_released(u) < 0)
        goto out;
    r = 1;
out:
    Py_DECREF(grad);
    Py_XDECREF(cur);
    Py_XDECREF(out);
    return r;
}

/* ------------------------------------------------------------------------
 * UnitHook: it holds the unit weakly. A post-backward hook lives on the
 * unit's own compute buffer, which the unit holds, and torch's tensor hooks
 * are not seen by the collector ([Note: hooks hold their state weakly] in
 * runtime/grad_hooks.py). A hook whose unit is gone does nothing. */

enum { FS_UNIT_HOOK_PRE_BACKWARD = 0, FS_UNIT_HOOK_POST_BACKWARD = 1 };

typedef struct {
    PyObject_HEAD
    int kind;          /* FS_UNIT_HOOK_* */
    int group;         /* POST_BACKWARD: the group index */
    PyObject *unit;    /* a weak reference to the Unit */
    vectorcallfunc vectorcall;
} UnitHookObject;

static PyObject *fallback(UnitObject *u, PyObject *fn, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *owner = u->owner && fn ? fs_weak_get(u->owner) : NULL;
    if (!owner)  /* the Python unit is gone: nobody to run it for */
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *stack[3] = {owner, nargs > 0 ? args[0] : Py_None, nargs > 1 ? args[1] : Py_None};
    PyObject *r = PyObject_Vectorcall(fn, stack, (size_t)nargs + 1, NULL);
    Py_DECREF(owner);
    return r;
}

static PyObject *UnitHook_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames)
{
    UnitHookObject *self = (UnitHookObject *)op;
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames || nargs != 1)
        return PyErr_Format(PyExc_TypeError, "UnitHook: one argument, not %zd", nargs);
    UnitObject *u = (UnitObject *)fs_weak_get(self->unit);
    if (!u)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *r = NULL;
    if (!u->ready) {
        r = Py_NewRef(Py_None);
    } else if (self->kind == FS_UNIT_HOOK_PRE_BACKWARD) {
        int p = pre_backward(u);
        r = p < 0 ? NULL : p ? Py_NewRef(Py_None) : fallback(u, u->on_pre_backward, args, 1);
    } else {
        int p = post_backward(u, self->group, args[0]);
        if (p >= 0) {
            PyObject *a[2] = {NULL, args[0]};
            a[0] = PyLong_FromLong(self->group);
            r = !a[0] ? NULL : p ? Py_NewRef(Py_None) : fallback(u, u->on_post_backward, a, 2);
            Py_XDECREF(a[0]);
        }
    }
    Py_DECREF(u);
    return r;
}

static PyObject *UnitHook_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    int kind, group = -1;
    PyObject *unit;
    if (kw && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "UnitHook(kind, unit[, group]): no keywords");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "iO|i:UnitHook", &kind, &unit, &group))
        return NULL;
    fs_mod_state *st = fs_state_from_type(tp);
    if ((kind != FS_UNIT_HOOK_PRE_BACKWARD && kind != FS_UNIT_HOOK_POST_BACKWARD) ||
        !PyObject_TypeCheck(unit, (PyTypeObject *)st->UnitType) ||
        (kind == FS_UNIT_HOOK_POST_BACKWARD && group < 0)) {
        PyErr_SetString(PyExc_TypeError, "UnitHook(kind, unit[, group]): kind "
                        "UNIT_PRE_BACKWARD or UNIT_POST_BACKWARD, a flatshard._C.Unit, and for "
                        "UNIT_POST_BACKWARD a group index >= 0");
        return NULL;
    }
    PyObject *ref = PyWeakref_NewRef(unit, NULL);
    if (!ref)
        return NULL;
    UnitHookObject *self = (UnitHookObject *)tp->tp_alloc(tp, 0);
    if (!self) {
        Py_DECREF(ref);
        return NULL;
    }
    self->kind = kind;
    self->group = group;
    self->unit = ref;
    self->vectorcall = UnitHook_vectorcall;
    return (PyObject *)self;
}

static void UnitHook_dealloc(UnitHookObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(self->unit);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *UnitHook_get_unit(UnitHookObject *self, void *c)
{
    (void)c;
    PyObject *u = fs_weak_get(self->unit);
    return u ? u : PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

static int UnitHook_set_unit(UnitHookObject *self, PyObject *value, void *c)
{
    (void)c;
    fs_mod_state *st = fs_state_from_type(Py_TYPE(self));
    if (!value || !PyObject_TypeCheck(value, (PyTypeObject *)st->UnitType)) {
        PyErr_SetString(PyExc_TypeError, "UnitHook.unit: a flatshard._C.Unit");
        return -1;
    }
    PyObject *ref = PyWeakref_NewRef(value, NULL);
    if (!ref)
        return -1;
    Py_SETREF(self->unit, ref);
    return 0;
}

static PyGetSetDef UnitHook_getset[] = {
    {"unit", (getter)UnitHook_get_unit, (setter)UnitHook_set_unit,
     "the Unit (None once it is gone; set anew when the unit's engine object is)", NULL},
    {NULL},
};

static PyMemberDef UnitHook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(UnitHookObject, vectorcall), READONLY},
    {"kind", T_INT, offsetof(UnitHookObject, kind), READONLY, "UNIT_PRE_BACKWARD or ..."},
    {"group", T_INT, offsetof(UnitHookObject, group), READONLY, "the group (POST_BACKWARD)"},
    {NULL},
};

static PyType_Slot UnitHook_slots[] = {
    {Py_tp_new, UnitHook_new},
    {Py_tp_dealloc, UnitHook_dealloc},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, UnitHook_members},
    {Py_tp_getset, UnitHook_getset},
    {Py_tp_doc, "UnitHook(kind, unit[, group]): the hook torch calls for one backward event\n"
                "of an FSDP1 unit: UNIT_PRE_BACKWARD (grad) or UNIT_POST_BACKWARD (the group's\n"
                "compute buffer). The plain path where it applies, else the unit's Python\n"
                "method ([Note: unit plain events] in py_unit_events.c)."},
    {0, NULL},
};

static PyType_Spec UnitHook_spec = {
    "flatshard._C.UnitHook", sizeof(UnitHookObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_VECTORCALL, UnitHook_slots,
};

int fs_unit_events_add(PyObject *module, fs_mod_state *st)
{
    st->UnitHookType = PyType_FromModuleAndSpec(module, &UnitHook_spec, NULL);
    if (!st->UnitHookType || PyModule_AddObjectRef(module, "UnitHook", st->UnitHookType) < 0)
        return -1;
    static const struct { const char *name; int v; } k[] = {
        {"UNIT_PRE_BACKWARD", FS_UNIT_HOOK_PRE_BACKWARD},
        {"UNIT_POST_BACKWARD", FS_UNIT_HOOK_POST_BACKWARD},
        {"UNIT_PLAIN_PRE_BACKWARD", FS_UNIT_PLAIN_PRE_BACKWARD},
        {"UNIT_PLAIN_POST_BACKWARD", FS_UNIT_PLAIN_POST_BACKWARD},
        {"UNIT_PREFETCH_PRE", FS_UNIT_PREFETCH_PRE},
        {"UNIT_PREFETCH_POST", FS_UNIT_PREFETCH_POST},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (PyModule_AddIntConstant(module, k[i].name, k[i].v) < 0)
            return -1;
    return 0;
}
