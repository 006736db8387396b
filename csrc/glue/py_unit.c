/* py_unit.c - flatshard._C.Unit: the Python face of one engine unit
 * (engine/unit.h). Argument parsing, the Python objects the unit's handles
 * stand for, and errors turned into exceptions; the engine does the work.
 * Engine calls are made with the GIL held: the engine hands it back itself
 * around collectives and long host loops (the links' unlock, engine.h), and
 * calls the host table (hooks/env.c) with it held.
 *
 * One call per hook event: event() steps the state machine and does what
 * it asks (gather, free, reduce) in the same call; the caller does only the
 * torch-side work the returned actions leave (parameter views, hooks). */
#include "py_unit.h"
#include "env.h"

#include "py_group.h"
#include "unit_events.h"

#include <stddef.h>
#include <stdlib.h>
#include <structmember.h>

/* ---------------------------------------------------------------------------
 * calling the engine */

/* The note every unit error carries: which unit, operation, state, rank. */
static PyObject *note(UnitObject *self, const char *what, int g)
{
    fs_comm *c = self->comm->comm;
    return PyUnicode_FromFormat(
        "flatshard: during %s of unit '%U' (group %d, state %s, rank %d of %d)", what,
        self->name, g, fs_unit_state_name(self->u.fsm.state), c->rank, c->world_size);
}

/* An engine status as None or an exception naming the unit and operation. */
static PyObject *done(UnitObject *self, fs_status s)
{
    if (s == FS_OK)
        Py_RETURN_NONE;
    const fs_group_core *c = &self->u.core;
    PyObject *n = s == FS_ERR_BAD_STATE ? NULL /* the state machine's words say it all */
                  : note(self, c->err_what ? c->err_what : "unit operation", c->err_group);
    return fs_glue_group_failed(FS_GROUP(self), s, s != FS_ERR_BAD_STATE && c->err_collective,
                                n);
}

PyObject *fs_glue_unit_done(UnitObject *self, fs_status s)
{
    return done(self, s);
}

static PyObject *group_done(GroupObject *self, fs_status s)
{
    return done((UnitObject *)self, s);
}

/* ---------------------------------------------------------------------------
 * life */

static int keep(UnitObject *self, PyObject *o, void **handle)
{
    *handle = NULL;
    if (!o || o == Py_None)
        return 0;
    self->refs[self->nrefs++] = Py_NewRef(o);
    *handle = o;
    return 0;
}

static int keep_storage(UnitObject *self, PyObject *tensor, void **handle)
{
    *handle = NULL;
    if (!tensor)
        return 0;
    PyObject *st = PyObject_CallMethod(tensor, "untyped_storage", NULL);
    if (!st)
        return -1;
    self->refs[self->nrefs++] = st;
    *handle = st;
    return 0;
}

static PyObject *Unit_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"name", "comm", "strategy", "groups", "grad_mask", "empty",
                             "offload", "replicate", NULL};
    PyObject *name, *comm, *groups, *empty = Py_None, *replicate = Py_None;
    int strategy, offload = 0;
    unsigned long long grad_mask;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "UOiOK|$OpO", kwlist, &name, &comm, &strategy,
                                     &groups, &grad_mask, &empty, &offload, &replicate))
        return NULL;
    if (fs_glue_group_check(tp, "Unit", comm, replicate, empty) < 0)
        return NULL;
    if (offload && (empty == Py_None || strategy == FS_NO_SHARD))
        return PyErr_Format(PyExc_ValueError, "Unit: offload=True (host shards) needs a Comm "
                            "bound to a device, and a sharding strategy");
    PyObject *seq = PySequence_Fast(groups, "Unit: groups must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > 64) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "Unit: at most 64 groups, got %zd", n);
    }
    UnitObject *self = (UnitObject *)tp->tp_alloc(tp, 0);
    fs_unit_group *gs = calloc(n ? (size_t)n : 1, sizeof *gs);
    if (!self || !gs || !(self->refs = calloc((size_t)(5 * n + 1), sizeof(PyObject *)))) {
        if (self && gs)
            PyErr_NoMemory();
        free(gs);
        Py_DECREF(seq);
        Py_XDECREF(self);
        return gs ? NULL : PyErr_NoMemory();
    }
    fs_glue_group_init(FS_GROUP(self), &self->u.core, group_done, name, comm, replicate,
                       empty);
    for (Py_ssize_t i = 0; i < n; i++) {
        fs_unit_group *g = &gs[i];
        PyObject *shard, *full, *lp = Py_None;
        int dt, cdt = -1, rdt = -1;
        long long sn, pn;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "OOiLL|Oii;Unit: each group is "
                              "(shard, full, dtype, shard_numel, padded_numel[, lp, "
                              "compute_dtype, reduce_dtype])",
                              &shard, &full, &dt, &sn, &pn, &lp, &cdt, &rdt) ||
            keep(self, shard, &g->shard) < 0 || keep(self, full, &g->full) < 0 ||
            keep(self, lp, &g->lp) < 0 || keep_storage(self, full, &g->storage) < 0 ||
            keep_storage(self, lp != Py_None ? lp : NULL, &g->lp_storage) < 0)
            goto fail;
        if ((unsigned)dt >= FS_DTYPE_COUNT || (cdt >= 0 && (unsigned)cdt >= FS_DTYPE_COUNT) ||
            (rdt >= 0 && (unsigned)rdt >= FS_DTYPE_COUNT)) {
            PyErr_Format(PyExc_ValueError, "Unit %U group %zd: invalid dtype code", name, i);
            goto fail;
        }
        g->dtype = dt;
        g->compute = cdt < 0 ? (fs_dtype)dt : (fs_dtype)cdt;
        g->reduce = rdt < 0 ? g->compute : (fs_dtype)rdt;
        g->shard_numel = sn;
        g->padded_numel = pn;
    }
    Py_CLEAR(seq);
    fs_status s = fs_unit_init(&self->u, PyUnicode_AsUTF8(name), fs_hooks_env(&self->empty),
                               fs_glue_link(self->comm), fs_glue_link(self->replicate),
                               strategy, grad_mask, gs, (int)n, offload);
    self->ready = 1;
    free(gs);
    gs = NULL;
    if (s != FS_OK) {
        if (s != FS_ERR_HOST)
            PyErr_Format(PyExc_ValueError, "Unit %U group %d: %s", name,
                         self->u.core.err_group, self->u.core.err);
        goto fail;
    }
    return (PyObject *)self;
fail:
    free(gs);
    Py_XDECREF(seq);
    Py_DECREF(self);
    return NULL;
}

static int Unit_traverse(UnitObject *self, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < self->nrefs; i++)
        Py_VISIT(self->refs[i]);
    Py_VISIT(self->latch);
    Py_VISIT(self->prev);
    Py_VISIT(self->owner);
    Py_VISIT(self->on_pre_backward);
    Py_VISIT(self->views);
    Py_VISIT(self->on_post_backward);
    Py_VISIT(self->on_error);
    Py_VISIT(self->run_hooks);
    Py_VISIT(self->empty_like);
    Py_VISIT(self->tensor);
    return fs_glue_group_traverse(FS_GROUP(self), visit, arg);
}

static void clear_handed(UnitObject *self)
{
    self->plain = 0;
    Py_CLEAR(self->latch);
    Py_CLEAR(self->prev);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->on_pre_backward);
    Py_CLEAR(self->views);
    Py_CLEAR(self->on_post_backward);
    Py_CLEAR(self->on_error);
    Py_CLEAR(self->run_hooks);
    Py_CLEAR(self->empty_like);
    Py_CLEAR(self->tensor);
}

/* The buffers lead back to the unit (a flat parameter's gradient hook holds
 * the Python state that holds it), and the engine's handles point at them:
 * the engine object goes first (then every call refuses: py_group.c). */
static int Unit_clear(UnitObject *self)
{
    if (self->ready)
        fs_unit_destroy(&self->u);
    self->ready = 0;
    for (Py_ssize_t i = 0; i < self->nrefs; i++)
        Py_CLEAR(self->refs[i]);
    self->nrefs = 0;
    clear_handed(self);
    return 0;
}

static void Unit_dealloc(UnitObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    Unit_clear(self);
    free(self->refs);
    fs_glue_group_clear(FS_GROUP(self));
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* ---------------------------------------------------------------------------
 * methods */

PyDoc_STRVAR(event_doc,
             "event(event, flags=0, group=-1, grad=None, out=None, accumulate=False,\n"
             "      defer=False, along=None) -> actions\n"
             "Apply a state-machine event (EV_*) and do what it asks, in one call: gather\n"
             "on UNSHARD (then wait for a prefetch: the buffers are used next), free on\n"
             "RESHARD, and on REDUCE_GRAD average the unsharded gradient `grad` of `group`\n"
             "over the ranks into `out` (the shard gradient, or under SHARD_OPTIM the whole\n"
             "one: out = (accumulate ? out : 0) + mean; `grad` is left undefined; defer: a\n"
             "device's current stream waits at finish_reduce()) before freeing. FINALIZE\n"
             "first waits for deferred reductions.\n"
             "along: a tuple of Units on this Comm (host) gathered now too, in the same\n"
             "all-gather as this unit's (the engine skips those already gathered or with\n"
             "nothing to gather, and stops where the batch is full).\n"
             "bucket (a ReduceBucket; a host Comm): the reduce-scatter joins it; `out` is\n"
             "written at flush_bucket() ([Note: reduction buckets] in engine/engine.h).\n"
             "Returns the ACT_* bits, for the torch-side work they leave (views, hooks).");
static PyObject *Unit_event(UnitObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"event", "flags", "group", "grad", "out", "accumulate", "defer",
                             "along", "bucket", NULL};
    int ev, group = -1, accumulate = 0, defer = 0;
    unsigned int flags = 0;
    PyObject *grad = Py_None, *out = Py_None, *along = Py_None, *bucket_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|IiOOppOO", kwlist, &ev, &flags, &group, &grad,
                                     &out, &accumulate, &defer, &along, &bucket_o))
        return NULL;
    fs_reduce_bucket *bucket;
    if (fs_glue_group_bucket_arg(FS_GROUP(self), bucket_o, defer, "event", &bucket) < 0)
        return NULL;
    Py_ssize_t n = along == Py_None ? 0 : fs_glue_group_along(FS_GROUP(self), along, "event");
    if (n < 0)
        return NULL;
    fs_unit **units = n ? PyMem_New(fs_unit *, n) : NULL;
    if (n && !units)
        return PyErr_NoMemory();
    PyObject *r = NULL;
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        units[i] = &((UnitObject *)PyTuple_GET_ITEM(along, i))->u;
    const fs_unit_event_work w = {flags, group, grad != Py_None ? grad : NULL,
                                  out != Py_None ? out : NULL, accumulate, defer, bucket,
                                  units, (int)n, 0};
    unsigned act;
    int failed;
    fs_status s = fs_unit_dispatch(&self->u, ev, &w, &act, &failed);
    r = s != FS_OK ? done(failed < 0 ? self : (UnitObject *)PyTuple_GET_ITEM(along, failed), s)
                   : PyLong_FromUnsignedLong(act);
done:
    PyMem_Free(units);
    return r;
}

PyDoc_STRVAR(step_doc, "step(event, flags, group=-1) -> actions\n"
                       "Apply a state-machine event (EV_*) only; returns ACT_* bits.");
static PyObject *Unit_step(UnitObject *self, PyObject *args)
{
    int ev, group = -1;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "iI|i", &ev, &flags, &group))
        return NULL;
    unsigned actions;
    fs_status s = fs_unit_event(&self->u, ev, flags, group, &actions);
    if (s != FS_OK)
        return done(self, s);
    return PyLong_FromUnsignedLong(actions);
}

PyDoc_STRVAR(unshard_doc,
             "unshard(full_precision=False, prefetch=False): gather every group (no-op if\n"
             "live, but for waiting on a prefetch). full_precision: gather the parameters'\n"
             "own dtype even under mixed precision (summon_full_params, state dicts).\n"
             "prefetch: on a device, do not make the current stream wait for the gather\n"
             "until wait(), a plain unshard() or reshard().");
static PyObject *Unit_unshard(UnitObject *self, PyObject *args)
{
    int fp = 0, prefetch = 0;
    if (!PyArg_ParseTuple(args, "|pp", &fp, &prefetch) || fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    return done(self, fs_unit_unshard(&self->u, fp, prefetch));
}

PyDoc_STRVAR(regather_doc,
             "regather(): gather the compute buffers again from the shards into their live\n"
             "storage, with no reallocation (SHARD_OPTIM after an optimizer step, or after\n"
             "loading a state dict). A live full-precision gather under mixed precision is\n"
             "stale then, and is freed. Gathers if not live.");
static PyObject *Unit_regather(UnitObject *self, PyObject *Py_UNUSED(a))
{
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    return done(self, fs_unit_regather(&self->u));
}

PyDoc_STRVAR(wait_doc, "wait(): the current stream waits for a prefetched all-gather\n"
                       "(a no-op when none is pending, and on the host).");
static PyObject *Unit_wait(UnitObject *self, PyObject *Py_UNUSED(a))
{
    if (!self->u.core.gather_pending)
        Py_RETURN_NONE;
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    return done(self, fs_unit_wait(&self->u));
}

PyDoc_STRVAR(reshard_doc, "reshard(): free every unsharded buffer (no-op if sharded, NO_SHARD\n"
                          "or SHARD_OPTIM).");
static PyObject *Unit_reshard(UnitObject *self, PyObject *Py_UNUSED(a))
{
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    return done(self, fs_unit_reshard(&self->u));
}

PyDoc_STRVAR(finish_reduce_doc,
             "finish_reduce(): what is left of the deferred gradient reductions: the current\n"
             "stream waits for them, and their buffers are released (a no-op when none is\n"
             "pending, and on the host).");
static PyObject *Unit_finish_reduce(UnitObject *self, PyObject *Py_UNUSED(a))
{
    if (!fs_unit_reducing(&self->u)) /* nothing to bind the streams for */
        Py_RETURN_NONE;
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    return done(self, fs_unit_finish_reduce(&self->u));
}

/* ---------------------------------------------------------------------------
 * attributes */

static PyObject *Unit_get_state(UnitObject *self, void *c)
{
    return PyUnicode_FromString(fs_unit_state_name(self->u.fsm.state));
}
static PyObject *Unit_get_bucketable(UnitObject *self, void *c)
{
    return PyBool_FromLong(fs_unit_bucketable(&self->u));
}

static PyObject *Unit_get_root(UnitObject *self, void *c)
{
    return PyBool_FromLong(self->u.cfg.is_root);
}
static int Unit_set_root(UnitObject *self, PyObject *v, void *c)
{
    int b = v ? PyObject_IsTrue(v) : -1;
    if (b < 0) {
        if (!v)
            PyErr_SetString(PyExc_AttributeError, "is_root cannot be deleted");
        return -1;
    }
    fs_unit_set_root(&self->u, b);
    return 0;
}

/* [Note: unit plain events]: what Python hands */

PyDoc_STRVAR(set_events_doc,
             "set_events(owner, on_pre_backward, views, on_post_backward, on_error, run_hooks,\n"
             "           empty_like, tensor): the Python unit (held weakly) and what the\n"
             "backward events call: on_pre_backward(owner) -> actions (Python's gather) and\n"
             "views(owner) where the pre-backward's options say, on_post_backward(owner,\n"
             "group, full) where the plain path does not apply, on_error(owner, exc) for an\n"
             "engine failure (raises), run_hooks(params), empty_like(shard); tensor: the\n"
             "type a plain gradient is ([Note: unit plain events] in hooks/unit_events.c).");
static PyObject *Unit_set_events(UnitObject *self, PyObject *args)
{
    PyObject *owner, *fns[6], *tensor;
    if (!PyArg_ParseTuple(args, "OOOOOOOO:set_events", &owner, &fns[0], &fns[1], &fns[2],
                          &fns[3], &fns[4], &fns[5], &tensor))
        return NULL;
    for (int i = 0; i < 6; i++)
        if (!PyCallable_Check(fns[i]))
            return PyErr_Format(PyExc_TypeError, "set_events: argument %d must be callable",
                                i + 2);
    if (!PyType_Check(tensor))
        return PyErr_Format(PyExc_TypeError, "set_events: tensor must be a type");
    PyObject *ref = PyWeakref_NewRef(owner, NULL);
    if (!ref)
        return NULL;
    Py_XSETREF(self->owner, ref);
    Py_XSETREF(self->on_pre_backward, Py_NewRef(fns[0]));
    Py_XSETREF(self->views, Py_NewRef(fns[1]));
    Py_XSETREF(self->on_post_backward, Py_NewRef(fns[2]));
    Py_XSETREF(self->on_error, Py_NewRef(fns[3]));
    Py_XSETREF(self->run_hooks, Py_NewRef(fns[4]));
    Py_XSETREF(self->empty_like, Py_NewRef(fns[5]));
    Py_XSETREF(self->tensor, Py_NewRef(tensor));
    Py_RETURN_NONE;
}

static PyObject *Unit_get_handed(UnitObject *self, void *c)
{
    PyObject *o = *(PyObject **)((char *)self + (Py_ssize_t)c);
    return Py_NewRef(o ? o : Py_None);
}

static PyObject *Unit_get_latch(UnitObject *self, void *c)
{
    (void)c;
    PyObject *l = self->latch ? fs_weak_get(self->latch) : NULL;
    return l ? l : PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
}

static int Unit_set_latch(UnitObject *self, PyObject *v, void *c)
{
    (void)c;
    fs_mod_state *st = fs_state_from_type(Py_TYPE(self));
    if (!v || (v != Py_None && !PyObject_TypeCheck(v, (PyTypeObject *)st->LatchType))) {
        PyErr_SetString(PyExc_TypeError, "Unit.latch: a flatshard._C.Latch or None");
        return -1;
    }
    PyObject *ref = v == Py_None ? NULL : PyWeakref_NewRef(v, NULL);
    if (v != Py_None && !ref)
        return -1;
    Py_XSETREF(self->latch, ref);
    return 0;
}

static int Unit_set_prev(UnitObject *self, PyObject *v, void *c)
{
    (void)c;
    if (!v || (v != Py_None && !Py_IS_TYPE(v, Py_TYPE(self)))) {
        PyErr_SetString(PyExc_TypeError, "Unit.prev: a flatshard._C.Unit or None");
        return -1;
    }
    Py_XSETREF(self->prev, v == Py_None || v == (PyObject *)self ? NULL : Py_NewRef(v));
    return 0;
}

static PyObject *Unit_get_gathered_bytes(UnitObject *self, void *c)
{
    (void)c;
    return PyLong_FromLongLong(fs_unit_gathered_bytes(&self->u));
}

PyDoc_STRVAR(prefetch_previous_doc,
             "prefetch_previous(): gather the unit that ran before this one in the last\n"
             "forward (`prev`) if it is idle (a backward prefetch); its failure is raised\n"
             "as its own.");
static PyObject *Unit_prefetch_previous(UnitObject *self, PyObject *Py_UNUSED(a))
{
    return fs_hooks_unit_prefetch_previous(self) < 0 ? NULL : Py_NewRef(Py_None);
}

PyDoc_STRVAR(released_doc,
             "released(): what follows this unit's reshard in backward: the BACKWARD_POST\n"
             "prefetch (PREFETCH_POST) and, on the host, the freed bytes counted for the\n"
             "heap trim ([Note: heap trim]).");
static PyObject *Unit_released(UnitObject *self, PyObject *Py_UNUSED(a))
{
    return fs_hooks_unit_released(self) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *Unit_set_comm_quant(UnitObject *self, PyObject *args)
{
    fs_comm_quant q;
    if (fs_glue_parse_quant(args, &q) < 0)
        return NULL;
    return done(self, fs_unit_set_quant(&self->u, q));
}

static PyMethodDef Unit_methods[] = {
    FS_GROUP_METHODS,
    {"set_comm_quant", (PyCFunction)Unit_set_comm_quant, METH_VARARGS, FS_SET_COMM_QUANT_DOC},
    {"event", (PyCFunction)(void (*)(void))Unit_event, METH_VARARGS | METH_KEYWORDS, event_doc},
    {"step", (PyCFunction)Unit_step, METH_VARARGS, step_doc},
    {"unshard", (PyCFunction)Unit_unshard, METH_VARARGS, unshard_doc},
    {"wait", (PyCFunction)Unit_wait, METH_NOARGS, wait_doc},
    {"finish_reduce", (PyCFunction)Unit_finish_reduce, METH_NOARGS, finish_reduce_doc},
    {"regather", (PyCFunction)Unit_regather, METH_NOARGS, regather_doc},
    {"reshard", (PyCFunction)Unit_reshard, METH_NOARGS, reshard_doc},
    {"set_events", (PyCFunction)Unit_set_events, METH_VARARGS, set_events_doc},
    {"prefetch_previous", (PyCFunction)Unit_prefetch_previous, METH_NOARGS,
     prefetch_previous_doc},
    {"released", (PyCFunction)Unit_released, METH_NOARGS, released_doc},
    {NULL},
};

static PyGetSetDef Unit_getset[] = {
    FS_GROUP_GETSET,
    {"state", (getter)Unit_get_state, NULL, "state-machine state name", NULL},
    {"bucketable", (getter)Unit_get_bucketable, NULL,
     "its reductions can wait in a host bucket (event(bucket=True))", NULL},
    {"name", (getter)fs_glue_group_get_name, NULL, "unit name (module path)", NULL},
    {"is_root", (getter)Unit_get_root, (setter)Unit_set_root, "root unit flag", NULL},
    {"comm", (getter)fs_glue_group_get_comm, NULL, "the Comm this unit's collectives go through",
     NULL},
    {"latch", (getter)Unit_get_latch, (setter)Unit_set_latch,
     "the root's Latch (the end of backward queued; held weakly), or None", NULL},
    {"prev", (getter)Unit_get_handed, (setter)Unit_set_prev,
     "the Unit that ran before this one in the last forward, or None",
     (void *)offsetof(UnitObject, prev)},
    {"gathered_bytes", (getter)Unit_get_gathered_bytes, NULL,
     "the bytes its compute buffers hold while gathered", NULL},
    {NULL},
};

static PyMemberDef Unit_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(UnitObject, weakrefs), READONLY},
    {"plain", T_INT, offsetof(UnitObject, plain), 0,
     "PLAIN_* and PREFETCH_* bits: which backward events take the plain path\n"
     "([Note: unit plain events] in hooks/unit_events.c)"},
    {NULL},
};

static PyType_Slot Unit_slots[] = {
    {Py_tp_new, Unit_new},
    {Py_tp_dealloc, Unit_dealloc},
    {Py_tp_traverse, Unit_traverse},
    {Py_tp_clear, Unit_clear},
    {Py_tp_methods, Unit_methods},
    {Py_tp_getset, Unit_getset},
    {Py_tp_members, Unit_members},
    {Py_tp_doc, "Unit(name, comm, strategy, groups, grad_mask): one wrapped module's state,\n"
                "driving the engine's unit (engine/unit.h)."},
    {0, NULL},
};

static PyType_Spec Unit_spec = {
    "flatshard._C.Unit", sizeof(UnitObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    Unit_slots,
};

int fs_unit_type_add(PyObject *module, fs_mod_state *st)
{
    return fs_add_type(module, &Unit_spec, &st->UnitType);
}
