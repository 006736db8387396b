/* py_eager.c - flatshard._C.EagerCall: the eager fast path of a hook that
 * torch.compile must run eagerly (python/flatshard/runtime/eager.py).
 *
 * EagerCall(fn, disabled, set_eval_frame) called with any arguments asks
 * the frame evaluation once by setting none (set_eval_frame(None)): where
 * none was set (plain eager code) it calls fn directly; inside a compiled
 * region it sets the prior one back and calls `disabled` (torch's disable
 * wrapper of fn). In C so that the check adds no Python frame: every hook
 * event of both wrappers passes through one, five a fully_shard unit a step.
 *
 * It binds as a function does (a method of the class that install() put it
 * on) and has a __dict__, where eager.py writes the marks Dynamo reads off
 * a disabled function (functools.update_wrapper, _torchdynamo_*). It holds
 * no state of flatshard's: the three callables it was made with.
 *
 * CPython C API only. */
#include "fs_py.h"

#include <stddef.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *fn;
    PyObject *disabled;
    PyObject *set_eval_frame;
    PyObject *dict;
    vectorcallfunc vectorcall;
} EagerCallObject;

static PyObject *EagerCall_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf,
                                      PyObject *kwnames)
{
    EagerCallObject *self = (EagerCallObject *)op;
    PyObject *prior = PyObject_CallOneArg(self->set_eval_frame, Py_None);
    if (!prior)
        return NULL;
    if (prior == Py_None) {
        Py_DECREF(prior);
        return PyObject_Vectorcall(self->fn, args, nargsf, kwnames);
    }
    PyObject *back = PyObject_CallOneArg(self->set_eval_frame, prior);
    Py_DECREF(prior);
    if (!back)
        return NULL;
    Py_DECREF(back);
    return PyObject_Vectorcall(self->disabled, args, nargsf, kwnames);
}

static PyObject *EagerCall_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    PyObject *fn, *disabled, *sef;
    if (kw && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "EagerCall(fn, disabled, set_eval_frame): no keywords");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOO:EagerCall", &fn, &disabled, &sef))
        return NULL;
    if (!PyCallable_Check(fn) || !PyCallable_Check(disabled) || !PyCallable_Check(sef)) {
        PyErr_SetString(PyExc_TypeError, "EagerCall(fn, disabled, set_eval_frame): three "
                        "callables");
        return NULL;
    }
    EagerCallObject *self = (EagerCallObject *)tp->tp_alloc(tp, 0);
    if (!self)
        return NULL;
    self->fn = Py_NewRef(fn);
    self->disabled = Py_NewRef(disabled);
    self->set_eval_frame = Py_NewRef(sef);
    self->vectorcall = EagerCall_vectorcall;
    return (PyObject *)self;
}

/* A method of the class it is on, as a function is: bound to the instance. */
static PyObject *EagerCall_get(PyObject *self, PyObject *obj, PyObject *type)
{
    (void)type;
    if (!obj || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static int EagerCall_traverse(EagerCallObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->fn);
    Py_VISIT(self->disabled);
    Py_VISIT(self->set_eval_frame);
    Py_VISIT(self->dict);
    return 0;
}

static int EagerCall_clear(EagerCallObject *self)
{
    Py_CLEAR(self->fn);
    Py_CLEAR(self->disabled);
    Py_CLEAR(self->set_eval_frame);
    Py_CLEAR(self->dict);
    return 0;
}

static void EagerCall_dealloc(EagerCallObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    EagerCall_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMemberDef EagerCall_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(EagerCallObject, vectorcall), READONLY, NULL},
    {"__dictoffset__", T_PYSSIZET, offsetof(EagerCallObject, dict), READONLY, NULL},
    {"fn", T_OBJECT, offsetof(EagerCallObject, fn), READONLY, "the hook, called in eager code"},
    {"disabled", T_OBJECT, offsetof(EagerCallObject, disabled), READONLY,
     "torch's disable wrapper of fn, called inside a compiled region"},
    {NULL},
};

static PyGetSetDef EagerCall_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyType_Slot EagerCall_slots[] = {
    {Py_tp_getset, EagerCall_getset},
    {Py_tp_new, EagerCall_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, EagerCall_get},
    {Py_tp_traverse, EagerCall_traverse},
    {Py_tp_clear, EagerCall_clear},
    {Py_tp_dealloc, EagerCall_dealloc},
    {Py_tp_members, EagerCall_members},
    {Py_tp_doc, "EagerCall(fn, disabled, set_eval_frame): fn in eager code, disabled inside a\n"
                "compiled region (the frame evaluation asked once, by setting none)."},
    {0, NULL},
};

static PyType_Spec EagerCall_spec = {
    .name = "flatshard._C.EagerCall",
    .basicsize = sizeof(EagerCallObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
             Py_TPFLAGS_METHOD_DESCRIPTOR,
    .slots = EagerCall_slots,
};

int fs_eager_type_add(PyObject *module, fs_mod_state *st)
{
    return fs_add_type(module, &EagerCall_spec, NULL);
}
