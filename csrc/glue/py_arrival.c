/* py_arrival.c - flatshard._C.Arrival: parameter i's post-accumulate-grad
 * hook, whose work is hooks/shard_events.c's (fs_hooks_shard_arrive). It
 * holds the group weakly. The hook lives on the group's own unsharded
 * parameter, which the group holds, and torch's tensor hooks are not seen
 * by the collector, so a strong reference would keep a dropped model alive
 * ([Note: hooks hold their state weakly] in runtime/grad_hooks.py). A hook
 * whose group is gone does nothing. */
#include "shard_events.h"

#include <stddef.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *group; /* a weak reference to the ShardGroup */
    int index;
    vectorcallfunc vectorcall;
} ArrivalObject;

static PyObject *Arrival_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames)
{
    (void)args;
    (void)nargsf;
    (void)kwnames;
    ArrivalObject *self = (ArrivalObject *)op;
    PyObject *g = fs_weak_get(self->group);
    if (!g)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *r = fs_hooks_shard_arrive((ShardGroupObject *)g, self->index);
    Py_DECREF(g);
    return r;
}

static int is_group(PyTypeObject *tp, PyObject *o)
{
    return PyObject_TypeCheck(o, (PyTypeObject *)fs_state_from_type(tp)->ShardGroupType);
}

static PyObject *Arrival_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    PyObject *group;
    int index;
    if (kw && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "Arrival(group, i): no keywords");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "Oi:Arrival", &group, &index))
        return NULL;
    if (!is_group(tp, group) || index < 0) {
        PyErr_SetString(PyExc_TypeError, "Arrival(group, i): a flatshard._C.ShardGroup and "
                        "a parameter index >= 0");
        return NULL;
    }
    PyObject *ref = PyWeakref_NewRef(group, NULL);
    if (!ref)
        return NULL;
    ArrivalObject *self = (ArrivalObject *)tp->tp_alloc(tp, 0);
    if (!self) {
        Py_DECREF(ref);
        return NULL;
    }
    self->group = ref;
    self->index = index;
    self->vectorcall = Arrival_vectorcall;
    return (PyObject *)self;
}

static void Arrival_dealloc(ArrivalObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(self->group);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMemberDef Arrival_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(ArrivalObject, vectorcall), READONLY},
    {"index", T_INT, offsetof(ArrivalObject, index), READONLY, "the parameter's index"},
    {NULL},
};

static PyType_Slot Arrival_slots[] = {
    {Py_tp_new, Arrival_new},
    {Py_tp_dealloc, Arrival_dealloc},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, Arrival_members},
    {Py_tp_doc, "Arrival(group, i): the gradient hook of parameter i of ShardGroup group,\n"
                "called with the parameter ([Note: post-backward sequence] in hooks/shard_events.c)."},
    {0, NULL},
};

static PyType_Spec Arrival_spec = {
    "flatshard._C.Arrival", sizeof(ArrivalObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_VECTORCALL, Arrival_slots,
};

int fs_arrival_type_add(PyObject *module, fs_mod_state *st)
{
    st->ArrivalType = PyType_FromModuleAndSpec(module, &Arrival_spec, NULL);
    return st->ArrivalType ? PyModule_AddObjectRef(module, "Arrival", st->ArrivalType) : -1;
}
