/* py_latch.c - flatshard._C.Latch: a flag the hooks of one tree share, set
 * once per backward; the first time it is set, action(arg) runs (the root
 * queues the end-of-backward callback). Both APIs' pre-backward events fire
 * it: fully_shard's (hooks/shard_events.c) and FSDP1's
 * (hooks/unit_events.c). */
#include "py_latch.h"

#include <stddef.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    int set;
    PyObject *action, *arg;
    PyObject *weakrefs;
} LatchObject;

static int fire(LatchObject *l)
{
    if (l->set)
        return 0;
    l->set = 1;
    PyObject *r = PyObject_CallOneArg(l->action, l->arg);
    if (!r) {
        l->set = 0;
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

int fs_glue_latch_fire(PyObject *latch)
{
    return fire((LatchObject *)latch);
}

static PyObject *Latch_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    PyObject *action, *arg;
    if ((kw && PyDict_GET_SIZE(kw)) || !PyArg_ParseTuple(args, "OO:Latch", &action, &arg))
        return NULL;
    if (!PyCallable_Check(action)) {
        PyErr_SetString(PyExc_TypeError, "Latch(action, arg): action must be callable");
        return NULL;
    }
    LatchObject *self = (LatchObject *)tp->tp_alloc(tp, 0);
    if (!self)
        return NULL;
    self->action = Py_NewRef(action);
    self->arg = Py_NewRef(arg);
    return (PyObject *)self;
}

static int Latch_traverse(LatchObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->action);
    Py_VISIT(self->arg);
    return 0;
}

static int Latch_clear(LatchObject *self)
{
    Py_CLEAR(self->action);
    Py_CLEAR(self->arg);
    return 0;
}

static void Latch_dealloc(LatchObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    Latch_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *Latch_fire(LatchObject *self, PyObject *Py_UNUSED(a))
{
    if (!self->action) {
        PyErr_SetString(PyExc_RuntimeError, "Latch: cleared");
        return NULL;
    }
    return fire(self) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyMethodDef Latch_methods[] = {
    {"fire", (PyCFunction)Latch_fire, METH_NOARGS,
     "fire(): set it; if it was not, action(arg) (a failed action leaves it unset)."},
    {NULL},
};

static PyMemberDef Latch_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(LatchObject, weakrefs), READONLY},
    {"set", T_BOOL, offsetof(LatchObject, set), 0, "whether it is set (fire, or assigned)"},
    {NULL},
};

static PyType_Slot Latch_slots[] = {
    {Py_tp_new, Latch_new},
    {Py_tp_dealloc, Latch_dealloc},
    {Py_tp_traverse, Latch_traverse},
    {Py_tp_clear, Latch_clear},
    {Py_tp_methods, Latch_methods},
    {Py_tp_members, Latch_members},
    {Py_tp_doc, "Latch(action, arg): a flag the hooks of one tree share; the first fire()\n"
                "after it was unset runs action(arg) (the end-of-backward callback queued)."},
    {0, NULL},
};

static PyType_Spec Latch_spec = {
    "flatshard._C.Latch", sizeof(LatchObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC, Latch_slots,
};

int fs_latch_type_add(PyObject *module, fs_mod_state *st)
{
    return fs_add_type(module, &Latch_spec, &st->LatchType);
}
