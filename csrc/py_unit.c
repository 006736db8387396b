/* py_unit.c - flatshard._C.Unit: one wrapped module's flat buffers and its
 * state machine (unit_fsm.c), driving unshard / reshard / gradient reduction
 * through a Comm.
 *
 * Memory: a group's unsharded buffer is a torch tensor whose storage is
 * resized to zero bytes when resharded and back when unsharded. Views of it
 * (the parameters seen by forward, and the tensors autograd saved) stay
 * valid across the cycle, so nothing has to be re-saved and no stream-
 * lifetime tricks are needed. Storage resizing is the one torch call made
 * from here, through the storage object's resize_ method. */
#include "fs_py.h"

#include <stdlib.h>

#include "copy.h"
#include "unit_fsm.h"

typedef struct {
    PyObject *shard;   /* 1-D tensor, shard_numel: the local shard (persistent) */
    PyObject *full;    /* 1-D tensor, padded_numel; the shard itself under NO_SHARD */
    PyObject *storage; /* full.untyped_storage() */
    int64_t shard_numel;
    int64_t padded_numel;
    fs_dtype dtype;
} unit_group;

typedef struct {
    PyObject_HEAD
    fs_unit_cfg cfg;
    fs_unit_fsm fsm;
    PyObject *name;
    CommObject *comm;
    Py_ssize_t ngroups;
    unit_group *groups;
    int unsharded;          /* every group's full buffer is live and gathered */
    void *scratch;          /* reduce-scatter landing area when accumulating */
    size_t scratch_bytes;
    unsigned long long n_all_gather, n_reduce;
} UnitObject;

static fs_mod_state *mstate(UnitObject *u) { return fs_state_from_type(Py_TYPE(u)); }

/* Add context to the exception now set: which unit, which operation. */
static PyObject *annotate(UnitObject *u, const char *what, Py_ssize_t g)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v) {
        PyObject *note = PyUnicode_FromFormat(
            "flatshard: during %s of unit '%U' (group %zd, state %s, rank %d of %d)", what,
            u->name, g, fs_unit_state_name(u->fsm.state), u->comm->comm->rank,
            u->comm->comm->world_size);
        PyObject *r = note ? PyObject_CallMethod(v, "add_note", "O", note) : NULL;
        Py_XDECREF(r);
        Py_XDECREF(note);
        PyErr_Clear(); /* a failed note must not hide the real error */
    }
    PyErr_Restore(t, v, tb);
    return NULL;
}

static PyObject *Unit_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"name", "comm", "strategy", "groups", "grad_mask", NULL};
    PyObject *name, *comm, *groups;
    int strategy;
    unsigned long long grad_mask;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "UOiOK", kwlist, &name, &comm, &strategy, &groups,
                                     &grad_mask))
        return NULL;
    fs_mod_state *st = fs_state_from_type(tp);
    if (!PyObject_TypeCheck(comm, (PyTypeObject *)st->CommType))
        return PyErr_Format(PyExc_TypeError, "Unit: comm must be a flatshard._C.Comm");
    if (strategy != FS_FULL_SHARD && strategy != FS_SHARD_GRAD_OP && strategy != FS_NO_SHARD)
        return PyErr_Format(PyExc_ValueError, "Unit: strategy %d is not 1, 2 or 3", strategy);
    if (strategy != FS_NO_SHARD && ((CommObject *)comm)->comm->world_size == 1)
        return PyErr_Format(PyExc_ValueError, "Unit: one rank has nothing to shard; use NO_SHARD");
    PyObject *seq = PySequence_Fast(groups, "Unit: groups must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > 64) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "Unit: at most 64 groups, got %zd", n);
    }
    UnitObject *u = (UnitObject *)tp->tp_alloc(tp, 0);
    if (!u) {
        Py_DECREF(seq);
        return NULL;
    }
    u->groups = calloc(n ? (size_t)n : 1, sizeof(unit_group));
    if (!u->groups) {
        Py_DECREF(seq);
        Py_DECREF(u);
        return PyErr_NoMemory();
    }
    Py_INCREF(name);
    u->name = name;
    Py_INCREF(comm);
    u->comm = (CommObject *)comm;
    u->cfg.strategy = strategy;
    u->cfg.is_root = 0;
    u->cfg.grad_mask = grad_mask;
    fs_unit_fsm_init(&u->fsm);
    /* NO_SHARD buffers are always whole; sharded ones start sharded. */
    u->unsharded = strategy == FS_NO_SHARD;
    for (Py_ssize_t i = 0; i < n; i++) {
        unit_group *g = &u->groups[i];
        int dt;
        long long sn, pn;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "OOiLL;Unit: each group is "
                              "(shard, full, dtype, shard_numel, padded_numel)",
                              &g->shard, &g->full, &dt, &sn, &pn)) {
            g->shard = g->full = NULL;
            goto fail;
        }
        Py_INCREF(g->shard);
        Py_INCREF(g->full);
        u->ngroups = i + 1;
        g->dtype = dt;
        g->shard_numel = sn;
        g->padded_numel = pn;
        if (fs_dtype_size(g->dtype) == 0 || sn < 0 ||
            pn != sn * (strategy == FS_NO_SHARD ? 1 : u->comm->comm->world_size)) {
            PyErr_Format(PyExc_ValueError, "Unit %U group %zd: inconsistent sizes/dtype", name, i);
            goto fail;
        }
        if (!(g->storage = PyObject_CallMethod(g->full, "untyped_storage", NULL)))
            goto fail;
    }
    Py_DECREF(seq);
    return (PyObject *)u;
fail:
    Py_DECREF(seq);
    Py_DECREF(u);
    return NULL;
}

static void Unit_dealloc(UnitObject *u)
{
    PyTypeObject *tp = Py_TYPE(u);
    for (Py_ssize_t i = 0; i < u->ngroups; i++) {
        Py_XDECREF(u->groups[i].shard);
        Py_XDECREF(u->groups[i].full);
        Py_XDECREF(u->groups[i].storage);
    }
    free(u->groups);
    free(u->scratch);
    Py_XDECREF(u->name);
    Py_XDECREF(u->comm);
    tp->tp_free(u);
    Py_DECREF(tp);
}

/* ---------------------------------------------------------------------------
 * state machine */

PyDoc_STRVAR(step_doc, "step(event, flags, group=-1) -> actions\n"
                       "Apply a state-machine event (FS_EV_*); returns FS_ACT_* bits.");
static PyObject *Unit_step(UnitObject *u, PyObject *args)
{
    int ev, group = -1;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "iI|i", &ev, &flags, &group))
        return NULL;
    unsigned actions;
    fs_unit_state before = u->fsm.state;
    fs_status s = fs_unit_step(&u->cfg, &u->fsm, ev, flags, group, u->unsharded, &actions);
    if (s != FS_OK)
        return fs_raise(mstate(u), s, "unit '%U': event %s (group %d) in state %s", u->name,
                        fs_event_name(ev), group, fs_unit_state_name(before));
    return PyLong_FromUnsignedLong(actions);
}

/* ---------------------------------------------------------------------------
 * data movement */

static int resize(unit_group *g, int64_t nbytes)
{
    PyObject *r = PyObject_CallMethod(g->storage, "resize_", "L", (long long)nbytes);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

static PyObject *Unit_unshard(UnitObject *u, PyObject *Py_UNUSED(a))
{
    if (u->unsharded)
        Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < u->ngroups; i++) {
        unit_group *g = &u->groups[i];
        void *sp, *fp;
        if (resize(g, g->padded_numel * (int64_t)fs_dtype_size(g->dtype)) < 0 ||
            fs_tensor_ptr(g->shard, &sp) < 0 || fs_tensor_ptr(g->full, &fp) < 0)
            return annotate(u, "unshard", i);
        /* Not in place: the shard is its own buffer, so that resharding can
         * drop the whole unsharded storage. */
        fs_status s;
        FS_COMM_CALL(u->comm, s, fs_comm_all_gather(u->comm->comm, sp, fp, g->shard_numel, g->dtype));
        if (s != FS_OK) {
            fs_raise(mstate(u), s, "all_gather: %s", u->comm->comm->last_error);
            return annotate(u, "all-gather", i);
        }
        u->n_all_gather++;
    }
    u->unsharded = 1;
    Py_RETURN_NONE;
}

static PyObject *Unit_reshard(UnitObject *u, PyObject *Py_UNUSED(a))
{
    if (!u->unsharded || u->cfg.strategy == FS_NO_SHARD)
        Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < u->ngroups; i++)
        if (resize(&u->groups[i], 0) < 0)
            return annotate(u, "reshard", i);
    u->unsharded = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(reduce_grad_doc,
             "reduce_grad(group, grad, out, accumulate)\n"
             "Average the unsharded gradient `grad` (padded_numel) over the group into the\n"
             "shard gradient `out` (shard_numel): out = (accumulate ? out : 0) + mean.\n"
             "`grad` is used as scratch and left undefined.");
static PyObject *Unit_reduce_grad(UnitObject *u, PyObject *args)
{
    Py_ssize_t gi;
    PyObject *grad, *out;
    int accumulate;
    if (!PyArg_ParseTuple(args, "nOOp", &gi, &grad, &out, &accumulate))
        return NULL;
    if (gi < 0 || gi >= u->ngroups)
        return PyErr_Format(PyExc_IndexError, "unit '%U': no group %zd", u->name, gi);
    unit_group *g = &u->groups[gi];
    fs_comm *c = u->comm->comm;
    void *gp, *op;
    if (fs_tensor_ptr(grad, &gp) < 0 || fs_tensor_ptr(out, &op) < 0)
        return NULL;
    const double inv = 1.0 / c->world_size;
    fs_status s;
    if (u->cfg.strategy == FS_NO_SHARD) {
        FS_COMM_CALL(u->comm, s, fs_comm_all_reduce(c, gp, g->padded_numel, g->dtype, FS_RED_SUM));
        if (s == FS_OK)
            s = fs_scale_accumulate(op, g->dtype, gp, g->dtype, g->shard_numel, inv, accumulate);
    } else if (!accumulate) {
        FS_COMM_CALL(u->comm, s, fs_comm_reduce_scatter(c, gp, op, g->shard_numel, g->dtype,
                                                         FS_RED_SUM));
        if (s == FS_OK)
            s = fs_scale_accumulate(op, g->dtype, op, g->dtype, g->shard_numel, inv, 0);
    } else {
        size_t need = (size_t)g->shard_numel * fs_dtype_size(g->dtype);
        if (need > u->scratch_bytes) {
            void *p = realloc(u->scratch, need);
            if (!p)
                return PyErr_NoMemory();
            u->scratch = p;
            u->scratch_bytes = need;
        }
        FS_COMM_CALL(u->comm, s, fs_comm_reduce_scatter(c, gp, u->scratch, g->shard_numel,
                                                         g->dtype, FS_RED_SUM));
        if (s == FS_OK)
            s = fs_scale_accumulate(op, g->dtype, u->scratch, g->dtype, g->shard_numel, inv, 1);
    }
    if (s != FS_OK) {
        fs_raise(mstate(u), s, "gradient reduction: %s", c->last_error);
        return annotate(u, u->cfg.strategy == FS_NO_SHARD ? "all-reduce" : "reduce-scatter", gi);
    }
    u->n_reduce++;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------
 * attributes */

static PyObject *Unit_get_state(UnitObject *u, void *c)
{
    return PyUnicode_FromString(fs_unit_state_name(u->fsm.state));
}
static PyObject *Unit_get_unsharded(UnitObject *u, void *c) { return PyBool_FromLong(u->unsharded); }
static PyObject *Unit_get_name(UnitObject *u, void *c) { return Py_NewRef(u->name); }
static PyObject *Unit_get_root(UnitObject *u, void *c) { return PyBool_FromLong(u->cfg.is_root); }
static int Unit_set_root(UnitObject *u, PyObject *v, void *c)
{
    int b = v ? PyObject_IsTrue(v) : -1;
    if (b < 0) {
        if (!v)
            PyErr_SetString(PyExc_AttributeError, "is_root cannot be deleted");
        return -1;
    }
    u->cfg.is_root = b;
    return 0;
}
static PyObject *Unit_get_comm(UnitObject *u, void *c) { return Py_NewRef((PyObject *)u->comm); }
static PyObject *Unit_get_counts(UnitObject *u, void *c)
{
    return Py_BuildValue("{sKsK}", "all_gather", u->n_all_gather, "reduce", u->n_reduce);
}

static PyMethodDef Unit_methods[] = {
    {"step", (PyCFunction)Unit_step, METH_VARARGS, step_doc},
    {"unshard", (PyCFunction)Unit_unshard, METH_NOARGS,
     "unshard(): gather every group into its full buffer (no-op if live)."},
    {"reshard", (PyCFunction)Unit_reshard, METH_NOARGS,
     "reshard(): free every full buffer (no-op if sharded or NO_SHARD)."},
    {"reduce_grad", (PyCFunction)Unit_reduce_grad, METH_VARARGS, reduce_grad_doc},
    {NULL},
};

static PyGetSetDef Unit_getset[] = {
    {"state", (getter)Unit_get_state, NULL, "state-machine state name", NULL},
    {"is_unsharded", (getter)Unit_get_unsharded, NULL, "full buffers live and gathered", NULL},
    {"name", (getter)Unit_get_name, NULL, "unit name (module path)", NULL},
    {"is_root", (getter)Unit_get_root, (setter)Unit_set_root, "root unit flag", NULL},
    {"counts", (getter)Unit_get_counts, NULL, "collectives issued by this unit", NULL},
    {"comm", (getter)Unit_get_comm, NULL, "the Comm this unit's collectives go through", NULL},
    {NULL},
};

static PyType_Slot Unit_slots[] = {
    {Py_tp_new, Unit_new},
    {Py_tp_dealloc, Unit_dealloc},
    {Py_tp_methods, Unit_methods},
    {Py_tp_getset, Unit_getset},
    {Py_tp_doc, "Unit(name, comm, strategy, groups, grad_mask): one wrapped module's state."},
    {0, NULL},
};

static PyType_Spec Unit_spec = {
    "flatshard._C.Unit", sizeof(UnitObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    Unit_slots,
};

int fs_unit_type_add(PyObject *module, fs_mod_state *st)
{
    st->UnitType = PyType_FromModuleAndSpec(module, &Unit_spec, NULL);
    if (!st->UnitType)
        return -1;
    return PyModule_AddObjectRef(module, "Unit", st->UnitType);
}
