/* py_shard_events.c - a fully_shard group's plain events: the one
 * implementation of each event's plain path, and the objects torch calls
 * for them (no Python frame between torch and the engine).
 *
 *   flatshard._C.Event(kind, group, fallback, ...)  a module's forward
 *       pre-hook (PRE_FORWARD), forward hook (POST_FORWARD), or the hook
 *       where backward reaches the module's outputs (PRE_BACKWARD)
 *   flatshard._C.Arrival(group, i)   parameter i's post-accumulate-grad hook
 *   flatshard._C.Latch(action, arg)  a flag the hooks of one tree share: the
 *       end-of-backward callback was queued in this backward (action(arg)
 *       queues it, the first time)
 *
 * [Note: plain events] Every step of an ordinary training takes the same
 * path through each event: gather the group and register the unsharded
 * parameters (pre-forward, pre-backward), register the sharded ones and free
 * (post-forward), and once every trainable parameter's gradient has arrived,
 * reduce-scatter the gradients into the sharded ones, free and register the
 * sharded parameters (post-backward). That path is written once, here, over
 * the group's own fields (py_shard_group.h); Python hands what it depends on
 * when that changes (FSDPState.hand_plain: the FS_PLAIN_* flags, the sums of
 * backwards without sync), and what can change within a step is checked at
 * each call with a few field reads: parameters assigned or a requires_grad
 * flipped since (py_params.h), the unsharded buffer not made yet, frozen
 * parameters, a hook on the reduce output, a gradient Python must hand, a
 * profiler or dispatch mode watching (their ranges and counts are Python's).
 * Any of those, and the event calls its fallback, the state's Python hook
 * (fsdp2/state.py), which handles every case and reaches the engine through
 * the same group; nothing is done twice, for the plain path acts only where
 * it finishes. The Event and Arrival objects hold no state of their own
 * beyond what they were made with.
 *
 * CPython C API only; torch is reached through the callables handed in and
 * its public tensor API (grad_fn, register_prehook, register_hook,
 * requires_grad). */
#include "py_shard_group.h"

#include <stddef.h>
#include <string.h>
#include <structmember.h>

/* ------------------------------------------------------------------------
 * The plain path of each event, on the group's fields */

/* 1: a profiler or dispatch mode watches; 0: none; -1 with an exception set */
static int watched(ShardGroupObject *g)
{
    /* held: a callable may hand the group another tuple (set_post_backward) */
    PyObject *watch = Py_XNewRef(g->watch);
    Py_ssize_t n = watch ? PyTuple_GET_SIZE(watch) : 0;
    int t = 0;
    for (Py_ssize_t i = 0; i < n && !t; i++) {
        PyObject *r = PyObject_CallNoArgs(PyTuple_GET_ITEM(watch, i));
        t = r ? PyObject_IsTrue(r) : -1;
        Py_XDECREF(r);
    }
    Py_XDECREF(watch);
    return t;
}

/* The plain gather (pre-forward, pre-backward): 0 the modules hold the
 * unsharded parameters (gathered now or before), with *hooks set where a
 * trainable one has no gradient hook yet; 1 not plain now (nothing done);
 * -1 with an exception set. */
static int gather(ShardGroupObject *g, int *hooks)
{
    *hooks = 0;
    if (g->comm->dev)
        return 1;
    if (g->g.core.unsharded)  /* a prefetch gathered it (and registered it) */
        return g->g.core.gather_pending ? 1 : 0;
    int r = fs_params_changed(&g->params);
    if (r)
        return r < 0 ? -1 : 1;
    if (!g->full || !g->shards)  /* the first gather makes the buffer (Python) */
        return 1;
    if (fs_glue_group_bind(FS_GROUP(g)) < 0)
        return -1;
    PyObject *d = fs_glue_shard_done(g, fs_shard_unshard(&g->g, 0));
    if (!d)
        return -1;
    Py_DECREF(d);
    if (fs_params_register_unsharded(&g->params) < 0)
        return -1;
    *hooks = fs_params_needs_hooks(&g->params);
    return 0;
}

/* The sharded parameters registered, the unsharded buffer freed. */
static int release(ShardGroupObject *g)
{
    if (fs_params_register_sharded(&g->params) < 0)
        return -1;
    if (!g->g.core.unsharded && !g->g.core.gather_pending)
        return 0;
    if (fs_glue_group_bind(FS_GROUP(g)) < 0)
        return -1;
    PyObject *d = fs_glue_shard_done(g, fs_shard_reshard(&g->g));
    if (!d)
        return -1;
    Py_DECREF(d);
    return 0;
}

void fs_glue_shard_clear_arrived(ShardGroupObject *g)
{
    if (g->narrived)
        memset(g->arrived, 0, (size_t)g->arrived_cap);
    g->narrived = 0;
}

int fs_glue_shard_post_backward(ShardGroupObject *g)
{
    const fs_params *p = &g->params;
    if (!(g->plain & FS_PLAIN_POST_BACKWARD) || g->sums || p->trainable != p->n ||
        g->grads.hold || g->comm->dev)
        return 0;
    int w = watched(g);
    if (w)
        return w < 0 ? -1 : 0;
    fs_glue_shard_clear_arrived(g);
    PyObject *r = fs_glue_shard_reduce(g, Py_None, 0, 1, NULL);
    if (!r)
        return -1;
    const int asked = r == Py_None;
    Py_DECREF(r);
    if (asked)  /* a gradient of a subclass: Python hands its values */
        return 0;
    return release(g) < 0 ? -1 : 1;
}

/* ------------------------------------------------------------------------
 * Latch: set once, and the first time action(arg) runs */

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

/* ------------------------------------------------------------------------
 * Arrival: it holds the group weakly. The hook lives on the group's own
 * unsharded parameter, which the group holds, and torch's tensor hooks are
 * not seen by the collector, so a strong reference would keep a dropped
 * model alive ([Note: hooks hold their state weakly] in
 * runtime/grad_hooks.py). A hook whose group is gone does nothing. */

typedef struct {
    PyObject_HEAD
    PyObject *group; /* a weak reference to the ShardGroup */
    int index;
    vectorcallfunc vectorcall;
} ArrivalObject;

/* Parameter i's gradient arrived; once every trainable parameter's has, the
 * post-backward: the plain one, else the state's. */
static PyObject *arrive(ShardGroupObject *g, int i)
{
    if (i >= g->params.n)  /* a hook of parameters set before: none of ours */
        Py_RETURN_NONE;
    if (i >= g->arrived_cap) {
        unsigned char *a = PyMem_Realloc(g->arrived, (size_t)g->params.n);
        if (!a)
            return PyErr_NoMemory();
        memset(a + g->arrived_cap, 0, (size_t)(g->params.n - g->arrived_cap));
        g->arrived = a;
        g->arrived_cap = g->params.n;
    }
    if (!g->arrived[i]) {
        g->arrived[i] = 1;
        g->narrived++;
    }
    if (g->narrived != g->params.trainable)
        Py_RETURN_NONE;
    int r = fs_glue_shard_post_backward(g);
    if (r)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *owner = g->owner && g->fallback ? fs_weak_get(g->owner) : NULL;
    if (!owner)  /* the state is gone: nobody to run it for */
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *out = PyObject_CallOneArg(g->fallback, owner);
    Py_DECREF(owner);
    if (!out)
        return NULL;
    Py_DECREF(out);
    Py_RETURN_NONE;
}

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
    PyObject *r = arrive((ShardGroupObject *)g, self->index);
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
                "called with the parameter ([Note: plain events] in py_shard_events.c)."},
    {0, NULL},
};

static PyType_Spec Arrival_spec = {
    "flatshard._C.Arrival", sizeof(ArrivalObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_VECTORCALL, Arrival_slots,
};

/* ------------------------------------------------------------------------
 * Event */

enum { FS_EVENT_PRE_FORWARD = 0, FS_EVENT_POST_FORWARD = 1, FS_EVENT_PRE_BACKWARD = 2 };

typedef struct {
    PyObject_HEAD
    int kind;                /* FS_EVENT_* */
    PyObject *group;         /* the ShardGroup (settable: a group made anew) */
    PyObject *fallback;      /* the state's Python hook, called with the same arguments */
    PyObject *hook_grads;    /* hook_grads(): gradient hooks on the new unsharded parameters */
    PyObject *latch;         /* PRE_BACKWARD: the tree's Latch (NULL before lazy init) */
    PyObject *pre_backward;  /* POST_FORWARD: the hook for the outputs' gradients */
    PyObject *hook_outputs;  /* POST_FORWARD: hook_outputs(output, pre_backward), any output */
    PyObject *grad_enabled;  /* POST_FORWARD: torch.is_grad_enabled */
    PyObject *tensor;        /* POST_FORWARD: torch.Tensor (one plain output: hooked here) */
    vectorcallfunc vectorcall;
} EventObject;

static PyObject *call_fallback(EventObject *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames)
{
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

static int run_hooks(EventObject *self, int hooks)
{
    if (!hooks)
        return 0;
    PyObject *r = PyObject_CallNoArgs(self->hook_grads);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* hook(grad) where backward reaches `out`, one plain tensor: a pre-hook on
 * its grad_fn, or a tensor hook on a leaf that requires grad (what
 * runtime/trees.hook_before_backward does for that case). */
static int hook_tensor(PyObject *out, PyObject *hook)
{
    PyObject *node = PyObject_GetAttrString(out, "grad_fn");
    if (!node)
        return -1;
    PyObject *h = NULL;
    if (node != Py_None) {
        h = PyObject_CallMethod(node, "register_prehook", "O", hook);
    } else {
        PyObject *rg = PyObject_GetAttrString(out, "requires_grad");
        int t = rg ? PyObject_IsTrue(rg) : -1;
        Py_XDECREF(rg);
        h = t > 0 ? PyObject_CallMethod(out, "register_hook", "O", hook)
                  : t == 0 ? Py_NewRef(Py_None) : NULL;
    }
    Py_DECREF(node);
    if (!h)
        return -1;
    Py_DECREF(h);
    return 0;
}

static PyObject *post_forward(EventObject *self, ShardGroupObject *g, PyObject *out)
{
    if (release(g) < 0)
        return NULL;
    PyObject *grad = PyObject_CallNoArgs(self->grad_enabled);
    int on = grad ? PyObject_IsTrue(grad) : -1;
    Py_XDECREF(grad);
    if (on <= 0)
        return on < 0 ? NULL : Py_NewRef(Py_None);
    if (Py_IS_TYPE(out, (PyTypeObject *)self->tensor))
        return hook_tensor(out, self->pre_backward) < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *r = PyObject_CallFunctionObjArgs(self->hook_outputs, out, self->pre_backward, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *Event_vectorcall(PyObject *op, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames)
{
    EventObject *self = (EventObject *)op;
    ShardGroupObject *g = (ShardGroupObject *)self->group;
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    const int flags = g->plain;
    int want, hooks = 0;
    switch (self->kind) {
    case FS_EVENT_PRE_FORWARD:
        want = FS_PLAIN_PRE_FORWARD;
        break;
    case FS_EVENT_POST_FORWARD:
        want = FS_PLAIN_POST_FORWARD;
        break;
    default:  /* before lazy init no latch: Python's */
        want = self->latch ? FS_PLAIN_PRE_BACKWARD : -1;
    }
    if (want < 0 || !(flags & want) || kwnames || nargs != (self->kind == FS_EVENT_PRE_BACKWARD
                                                            ? 1 : 3))
        return call_fallback(self, args, nargsf, kwnames);
    /* frozen parameters: Python watches the forward's inputs and holds the
     * reshard back for them */
    if (self->kind != FS_EVENT_PRE_BACKWARD && g->params.trainable != g->params.n)
        return call_fallback(self, args, nargsf, kwnames);
    int w = watched(g);
    if (w)
        return w < 0 ? NULL : call_fallback(self, args, nargsf, kwnames);
    if (self->kind == FS_EVENT_POST_FORWARD)
        return post_forward(self, g, args[2]);
    /* the first pre-backward of a backward queues its end */
    if (self->kind == FS_EVENT_PRE_BACKWARD && fs_glue_latch_fire(self->latch) < 0)
        return NULL;
    if (self->kind == FS_EVENT_PRE_BACKWARD && !(flags & FS_PLAIN_GATHER_BACKWARD))
        Py_RETURN_NONE;
    int r = gather(g, &hooks);
    if (r < 0 || run_hooks(self, hooks) < 0)
        return NULL;
    if (r || (self->kind == FS_EVENT_PRE_FORWARD && g->params.trainable != g->params.n))
        return call_fallback(self, args, nargsf, kwnames); /* it finds the group gathered */
    Py_RETURN_NONE;
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
    self->kind = kind;
    self->group = Py_NewRef(group);
    self->fallback = Py_NewRef(fallback);
    self->hook_grads = Py_NewRef(hook_grads);
    self->pre_backward = Py_XNewRef(pre_backward);
    self->hook_outputs = Py_XNewRef(hook_outputs);
    self->grad_enabled = Py_XNewRef(grad_enabled);
    self->tensor = Py_XNewRef(tensor);
    self->vectorcall = Event_vectorcall;
    return (PyObject *)self;
}

static int Event_traverse(EventObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->group);
    Py_VISIT(self->fallback);
    Py_VISIT(self->hook_grads);
    Py_VISIT(self->latch);
    Py_VISIT(self->pre_backward);
    Py_VISIT(self->hook_outputs);
    Py_VISIT(self->grad_enabled);
    Py_VISIT(self->tensor);
    return 0;
}

static int Event_clear(EventObject *self)
{
    /* group stays: a call may still come while the collector runs */
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->hook_grads);
    Py_CLEAR(self->latch);
    Py_CLEAR(self->pre_backward);
    Py_CLEAR(self->hook_outputs);
    Py_CLEAR(self->grad_enabled);
    Py_CLEAR(self->tensor);
    return 0;
}

static void Event_dealloc(EventObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Event_clear(self);
    Py_CLEAR(self->group);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *Event_get_group(EventObject *self, void *c)
{
    (void)c;
    return Py_NewRef(self->group);
}

static int Event_set_group(EventObject *self, PyObject *value, void *c)
{
    (void)c;
    if (!value || !is_group(Py_TYPE(self), value)) {
        PyErr_SetString(PyExc_TypeError, "Event.group: a flatshard._C.ShardGroup");
        return -1;
    }
    Py_SETREF(self->group, Py_NewRef(value));
    return 0;
}

static PyObject *Event_get_latch(EventObject *self, void *c)
{
    (void)c;
    return Py_NewRef(self->latch ? self->latch : Py_None);
}

static int Event_set_latch(EventObject *self, PyObject *value, void *c)
{
    (void)c;
    fs_mod_state *st = fs_state_from_type(Py_TYPE(self));
    if (!value || (value != Py_None && !PyObject_TypeCheck(value, (PyTypeObject *)st->LatchType))) {
        PyErr_SetString(PyExc_TypeError, "Event.latch: a flatshard._C.Latch or None");
        return -1;
    }
    Py_XSETREF(self->latch, value == Py_None ? NULL : Py_NewRef(value));
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
    {"kind", T_INT, offsetof(EventObject, kind), READONLY, "EVENT_*"},
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
     "fallback(*args) ([Note: plain events] in py_shard_events.c)."},
    {0, NULL},
};

static PyType_Spec Event_spec = {
    "flatshard._C.Event", sizeof(EventObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC |
        Py_TPFLAGS_HAVE_VECTORCALL,
    Event_slots,
};

/* ------------------------------------------------------------------------ */

static int add_type(PyObject *module, PyType_Spec *spec, PyObject **slot, const char *name)
{
    *slot = PyType_FromModuleAndSpec(module, spec, NULL);
    return *slot ? PyModule_AddObjectRef(module, name, *slot) : -1;
}

int fs_shard_events_add(PyObject *module, fs_mod_state *st)
{
    if (add_type(module, &Latch_spec, &st->LatchType, "Latch") < 0 ||
        add_type(module, &Arrival_spec, &st->ArrivalType, "Arrival") < 0 ||
        add_type(module, &Event_spec, &st->EventType, "Event") < 0)
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
