/* py_unit_hook.c - flatshard._C.UnitHook: the hook torch calls for one
 * backward event of an FSDP1 unit, whose sequence is hooks/unit_events.c's
 * (fs_hooks_unit_event). It holds the unit weakly. A post-backward hook lives on the
 * unit's own compute buffer, which the unit holds, and torch's tensor hooks
 * are not seen by the collector ([Note: hooks hold their state weakly] in
 * runtime/grad_hooks.py). A hook whose unit is gone does nothing. */
#include "unit_events.h"

#include <stddef.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    int kind;          /* FS_UNIT_HOOK_* */
    int group;         /* POST_BACKWARD: the group index */
    PyObject *unit;    /* a weak reference to the Unit */
    vectorcallfunc vectorcall;
} UnitHookObject;

static PyObject *UnitHook_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf,
                                     PyObject *kwnames)
{
    UnitHookObject *self = (UnitHookObject *)op;
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames || nargs != 1)
        return PyErr_Format(PyExc_TypeError, "UnitHook: one argument, not %zd", nargs);
    PyObject *u = fs_weak_get(self->unit);
    if (!u)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *r = fs_hooks_unit_event((UnitObject *)u, self->kind, self->group, args[0]);
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
                "method ([Note: unit plain events] in hooks/unit_events.c)."},
    {0, NULL},
};

static PyType_Spec UnitHook_spec = {
    "flatshard._C.UnitHook", sizeof(UnitHookObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_VECTORCALL, UnitHook_slots,
};

int fs_unit_hook_type_add(PyObject *module, fs_mod_state *st)
{
    if (fs_add_type(module, &UnitHook_spec, &st->UnitHookType) < 0)
        return -1;
    static const struct { const char *name; int v; } k[] = {
        {"UNIT_PRE_BACKWARD", FS_UNIT_HOOK_PRE_BACKWARD},
        {"UNIT_POST_BACKWARD", FS_UNIT_HOOK_POST_BACKWARD},
        {"UNIT_PLAIN_PRE_BACKWARD", FS_UNIT_PLAIN_PRE_BACKWARD},
        {"UNIT_PLAIN_POST_BACKWARD", FS_UNIT_PLAIN_POST_BACKWARD},
        {"UNIT_PREFETCH_PRE", FS_UNIT_PREFETCH_PRE},
        {"UNIT_PREFETCH_POST", FS_UNIT_PREFETCH_POST},
        {"UNIT_VIEWS", FS_UNIT_VIEWS},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (PyModule_AddIntConstant(module, k[i].name, k[i].v) < 0)
            return -1;
    return 0;
}
