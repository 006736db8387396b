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

/* The callables an event of `kind` needs, by the fields' order below:
 * bit i for field i (hook_grads, span, step, root_end, watching, cast,
 * prefetch, pre_backward, hook_outputs, grad_enabled, begin). */
static const unsigned needs[] = {
    [FS_EVENT_PRE_FORWARD] = 0x457,
    [FS_EVENT_POST_FORWARD] = 0x3BF & ~0x040,
    [FS_EVENT_PRE_BACKWARD] = 0x047,
};

static PyObject *Event_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"kind", "group", "hook_grads", "span", "step", "root_end",
                             "watching", "cast", "prefetch", "pre_backward", "hook_outputs",
                             "grad_enabled", "begin", "tensor", "opts", NULL};
    int kind, opts = 0;
    PyObject *group, *fn[11] = {NULL}, *tensor = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO|$OOOOOOOOOOOOi:Event", kwlist, &kind, &group,
                                     &fn[0], &fn[1], &fn[2], &fn[3], &fn[4], &fn[5], &fn[6],
                                     &fn[7], &fn[8], &fn[9], &fn[10], &tensor, &opts))
        return NULL;
    int ok = kind >= FS_EVENT_PRE_FORWARD && kind <= FS_EVENT_PRE_BACKWARD &&
             (group == Py_None || is_group(tp, group));
    for (int i = 0; ok && i < 11; i++)
        ok = !(needs[kind] >> i & 1) || (fn[i] && PyCallable_Check(fn[i]));
    if (ok && kind == FS_EVENT_POST_FORWARD)
        ok = tensor && PyType_Check(tensor);
    if (!ok) {
        PyErr_SetString(PyExc_TypeError, "Event(kind, group, *, hook_grads, ...): kind "
                        "EVENT_PRE_FORWARD, EVENT_POST_FORWARD or EVENT_PRE_BACKWARD, group a "
                        "flatshard._C.ShardGroup or None, and the callables its steps call "
                        "(hooks/shard_events.h)");
        return NULL;
    }
    EventObject *self = (EventObject *)tp->tp_alloc(tp, 0);
    if (!self)
        return NULL;
    fs_shard_event *ev = &self->ev;
    ev->kind = kind;
    ev->opts = opts;
    ev->group = Py_NewRef(group);
    PyObject **field[] = {&ev->hook_grads, &ev->span, &ev->step, &ev->root_end, &ev->watching,
                          &ev->cast, &ev->prefetch, &ev->pre_backward, &ev->hook_outputs,
                          &ev->grad_enabled, &ev->begin};
    for (int i = 0; i < 11; i++)
        *field[i] = Py_XNewRef(fn[i]);
    ev->tensor = Py_XNewRef(tensor);
    self->vectorcall = Event_vectorcall;
    return (PyObject *)self;
}

#define FS_EVENT_FIELDS(X)                                                                       \
    X(hook_grads) X(latch) X(span) X(step) X(root_end) X(watching) X(cast) X(prefetch)           \
        X(pre_backward) X(hook_outputs) X(grad_enabled) X(tensor) X(begin)

static int Event_traverse(EventObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->ev.group);
#define VISIT(f) Py_VISIT(self->ev.f);
    FS_EVENT_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int Event_clear(EventObject *self)
{
    /* group stays: a call may still come while the collector runs */
#define CLEAR(f) Py_CLEAR(self->ev.f);
    FS_EVENT_FIELDS(CLEAR)
#undef CLEAR
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
    if (!value || (value != Py_None && !is_group(Py_TYPE(self), value))) {
        PyErr_SetString(PyExc_TypeError, "Event.group: a flatshard._C.ShardGroup or None");
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
    {"opts", T_INT, offsetof(EventObject, ev.opts), 0,
     "OPT_*: what the event's sequence does beyond its plain steps"},
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
     "Event(kind, group, *, hook_grads, span, step, root_end, watching, cast, prefetch,\n"
     "pre_backward, hook_outputs, grad_enabled, begin, tensor, opts=0): the hook torch\n"
     "calls for one event of a fully_shard state: EVENT_PRE_FORWARD (module, args,\n"
     "kwargs), EVENT_POST_FORWARD (module, args, output) or EVENT_PRE_BACKWARD (grad):\n"
     "the event's one sequence, its steps as opts says (hooks/shard_events.h)."},
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
        {"PB_SYNC", FS_PB_SYNC},
        {"PB_RESHARD", FS_PB_RESHARD},
        {"PB_RESHARD_C", FS_PB_RESHARD_C},
        {"PB_REDUCE_C", FS_PB_REDUCE_C},
        {"PB_RANGE", FS_PB_RANGE},
        {"OPT_BEGIN", FS_OPT_BEGIN},
        {"OPT_WATCH", FS_OPT_WATCH},
        {"OPT_STEP", FS_OPT_STEP},
        {"OPT_RESHARD", FS_OPT_RESHARD},
        {"OPT_ROOT", FS_OPT_ROOT},
        {"OPT_CAST", FS_OPT_CAST},
        {"OPT_GATHER", FS_OPT_GATHER},
        {"OPT_PREFETCH_IN", FS_OPT_PREFETCH_IN},
        {"OPT_PREFETCH_OUT", FS_OPT_PREFETCH_OUT},
    };
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++)
        if (PyModule_AddIntConstant(module, plain[i].name, plain[i].v) < 0)
            return -1;
    return 0;
}
