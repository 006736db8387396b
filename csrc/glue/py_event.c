/* py_event.c - flatshard._C.Event: the hook torch calls for one event of a
 * fully_shard state (a module's forward pre-hook, its forward hook, or the
 * hook where backward reaches the module's outputs). It holds what it was
 * made with (hooks/shard_events.h: fs_shard_event); the event's sequence is
 * hooks/shard_events.c's. */
#include "shard_events.h"

#include <stddef.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    fs_shard_event ev;
    vectorcallfunc vectorcall;
} EventObject;

static PyObject *Event_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames)
{
    return fs_hooks_shard_event(&((EventObject *)op)->ev, args, nargsf, kwnames);
}

static int is_group(PyTypeObject *tp, PyObject *o)
{
    return PyObject_TypeCheck(o, (PyTypeObject *)fs_state_from_type(tp)->ShardGroupType);
}

static PyObject *Event_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"kind", "group", "fallback", "hook_grads", "pre_backward",
                             "hook_outputs", "grad_enabled", "tensor", NULL};
    int kind;
    PyObject *group, *fallback, *hook_grads, *pre_backward = NULL, *hook_outputs = NULL,
                                             *grad_enabled = NULL, *tensor = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOO|$OOOO:Event", kwlist, &kind, &group,
                                     &fallback, &hook_grads, &pre_backward, &hook_outputs,
                                     &grad_enabled, &tensor))
        return NULL;
    if (kind < FS_EVENT_PRE_FORWARD || kind > FS_EVENT_PRE_BACKWARD || !is_group(tp, group) ||
        !PyCallable_Check(fallback) || !PyCallable_Check(hook_grads)) {
        PyErr_SetString(PyExc_TypeError, "Event(kind, group, fallback, hook_grads): kind "
                        "EVENT_PRE_FORWARD, EVENT_POST_FORWARD or EVENT_PRE_BACKWARD, a "
                        "flatshard._C.ShardGroup, two callables");
        return NULL;
    }
    if (kind == FS_EVENT_POST_FORWARD &&
        (!pre_backward || !hook_outputs || !grad_enabled || !tensor ||
         !PyCallable_Check(pre_backward) || !PyCallable_Check(hook_outputs) ||
         !PyCallable_Check(grad_enabled) || !PyType_Check(tensor))) {
        PyErr_SetString(PyExc_TypeError, "Event(EVENT_POST_FORWARD, ...): pre_backward, "
                        "hook_outputs and grad_enabled callables and tensor a type");
        return NULL;
    }
    EventObject *self = (EventObject *)tp->tp_alloc(tp, 0);
    if (!self)
        return NULL;
    self->ev.kind = kind;
    self->ev.group = Py_NewRef(group);
    self->ev.fallback = Py_NewRef(fallback);
    self->ev.hook_grads = Py_NewRef(hook_grads);
    self->ev.pre_backward = Py_XNewRef(pre_backward);
    self->ev.hook_outputs = Py_XNewRef(hook_outputs);
    self->ev.grad_enabled = Py_XNewRef(grad_enabled);
    self->ev.tensor = Py_XNewRef(tensor);
    self->vectorcall = Event_vectorcall;
    return (PyObject *)self;
}

static int Event_traverse(EventObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->ev.group);
    Py_VISIT(self->ev.fallback);
    Py_VISIT(self->ev.hook_grads);
    Py_VISIT(self->ev.latch);
    Py_VISIT(self->ev.pre_backward);
    Py_VISIT(self->ev.hook_outputs);
    Py_VISIT(self->ev.grad_enabled);
    Py_VISIT(self->ev.tensor);
    return 0;
}

static int Event_clear(EventObject *self)
{
    /* group stays: a call may still come while the collector runs */
    Py_CLEAR(self->ev.fallback);
    Py_CLEAR(self->ev.hook_grads);
    Py_CLEAR(self->ev.latch);
    Py_CLEAR(self->ev.pre_backward);
    Py_CLEAR(self->ev.hook_outputs);
    Py_CLEAR(self->ev.grad_enabled);
    Py_CLEAR(self->ev.tensor);
    return 0;
}

static void Event_dealloc(EventObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Event_clear(self);
    Py_CLEAR(self->ev.group);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *Event_get_group(EventObject *self, void *c)
{
    (void)c;
    return Py_NewRef(self->ev.group);
}

static int Event_set_group(EventObject *self, PyObject *value, void *c)
{
    (void)c;
    if (!value || !is_group(Py_TYPE(self), value)) {
        PyErr_SetString(PyExc_TypeError, "Event.group: a flatshard._C.ShardGroup");
        return -1;
    }
    Py_SETREF(self->ev.group, Py_NewRef(value));
    return 0;
}

static PyObject *Event_get_latch(EventObject *self, void *c)
{
    (void)c;
    return Py_NewRef(self->ev.latch ? self->ev.latch : Py_None);
}

static int Event_set_latch(EventObject *self, PyObject *value, void *c)
{
    (void)c;
    fs_mod_state *st = fs_state_from_type(Py_TYPE(self));
    if (!value || (value != Py_None && !PyObject_TypeCheck(value, (PyTypeObject *)st->LatchType))) {
        PyErr_SetString(PyExc_TypeError, "Event.latch: a flatshard._C.Latch or None");
        return -1;
    }
    Py_XSETREF(self->ev.latch, value == Py_None ? NULL : Py_NewRef(value));
    return 0;
}

static PyGetSetDef Event_getset[] = {
    {"group", (getter)Event_get_group, (setter)Event_set_group,
     "the engine group (set anew when the group is made again)", NULL},
    {"latch", (getter)Event_get_latch, (setter)Event_set_latch,
     "PRE_BACKWARD: the tree's Latch (set: the end of backward is queued), or None", NULL},
    {NULL},
};

static PyMemberDef Event_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(EventObject, vectorcall), READONLY},
    {"kind", T_INT, offsetof(EventObject, ev.kind), READONLY, "EVENT_*"},
    {NULL},
};

static PyType_Slot Event_slots[] = {
    {Py_tp_new, Event_new},
    {Py_tp_dealloc, Event_dealloc},
    {Py_tp_traverse, Event_traverse},
    {Py_tp_clear, Event_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, Event_members},
    {Py_tp_getset, Event_getset},
    {Py_tp_doc,
     "Event(kind, group, fallback, hook_grads, *, pre_backward, hook_outputs,\n"
     "grad_enabled, tensor): the hook torch calls for one event of a fully_shard state:\n"
     "EVENT_PRE_FORWARD (module, args, kwargs), EVENT_POST_FORWARD (module, args,\n"
     "output) or EVENT_PRE_BACKWARD (grad). The plain path where it applies, else\n"
     "fallback(*args) ([Note: plain events] in hooks/shard_events.c)."},
    {0, NULL},
};

static PyType_Spec Event_spec = {
    "flatshard._C.Event", sizeof(EventObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC |
        Py_TPFLAGS_HAVE_VECTORCALL,
    Event_slots,
};

int fs_event_type_add(PyObject *module, fs_mod_state *st)
{
    st->EventType = PyType_FromModuleAndSpec(module, &Event_spec, NULL);
    if (!st->EventType || PyModule_AddObjectRef(module, "Event", st->EventType) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "EVENT_PRE_FORWARD", FS_EVENT_PRE_FORWARD) < 0 ||
        PyModule_AddIntConstant(module, "EVENT_POST_FORWARD", FS_EVENT_POST_FORWARD) < 0 ||
        PyModule_AddIntConstant(module, "EVENT_PRE_BACKWARD", FS_EVENT_PRE_BACKWARD) < 0)
        return -1;
    static const struct { const char *name; int v; } plain[] = {
        {"PLAIN_PRE_FORWARD", FS_PLAIN_PRE_FORWARD},
        {"PLAIN_POST_FORWARD", FS_PLAIN_POST_FORWARD},
        {"PLAIN_PRE_BACKWARD", FS_PLAIN_PRE_BACKWARD},
        {"PLAIN_GATHER_BACKWARD", FS_PLAIN_GATHER_BACKWARD},
        {"PLAIN_POST_BACKWARD", FS_PLAIN_POST_BACKWARD},
    };
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++)
        if (PyModule_AddIntConstant(module, plain[i].name, plain[i].v) < 0)
            return -1;
    return 0;
}
