/* py_unit.c - flatshard._C.Unit: one wrapped module's flat buffers and its
 * state machine (unit_fsm.c), driving unshard / reshard / gradient reduction
 * through a Comm.
 *
 * Memory: a group's unsharded buffer is a torch tensor whose storage holds
 * zero bytes when resharded and the whole buffer when unsharded. Views of it
 * (the parameters seen by forward, and the tensors autograd saved) stay
 * valid across the cycle, so nothing has to be re-saved and no stream-
 * lifetime tricks are needed. fs_unit_set_storage (py_unit_pool.c) is the one
 * place the bytes change hands: host memory from flatshard's pool ([Note:
 * pooled storage]), a device's through the storage's resize_.
 *
 * Device memory: when the Comm is bound to a device (Comm(kind='device'),
 * e.g. CUDA with NCCL), casts and accumulations go through the device's
 * table (fs_device.h), enqueued on the caller's current stream, and the
 * unit's own buffers come from `empty(numel, dtype)` (torch's allocator, so
 * torch's memory statistics stay true): the compute-dtype shard and the
 * reduction output persist, the reduce-dtype gradient and the float32
 * staging of low-precision reductions are taken for one reduction and given
 * back. Freeing them after enqueueing is safe: the caller's stream already
 * waits for the collective (comm.h), and torch's allocator reuses a block
 * in that stream's order.
 *
 * [Note: deferred collectives] A prefetch (unshard(prefetch=True)) on a device
 * issues its all-gathers without making the caller's stream wait, and marks
 * them (gather_event): the compute enqueued meanwhile (the unit before it)
 * runs beside them. The caller's stream waits for the mark where the unit's
 * buffers are next used: ready(), a plain unshard(), or reshard() (which
 * must not hand the memory back to the allocator while the collective may
 * still write it). The all-gather input (lp_shard) is only rewritten by the
 * unit's next gather, which comes after one of those.
 *
 * (py_unit_reduce.c) A reduction can be deferred too (reduce_grad(..., defer=True)): the work
 * that follows the collective (dividing, casting, accumulating into the
 * shard gradient) is enqueued on the backend's own stream after it, and
 * every buffer it touches (autograd's gradient, the reduce-dtype copy, the
 * float32 staging, the output) is held until the caller's stream has waited
 * for its mark (wait_reduced()), which the caller does before the unit's
 * next reduction and at the end of backward: the backward compute of the
 * units before it runs meanwhile, one reduction in flight. */
#include "py_unit.h"

#include <stdlib.h>

#include "copy.h"

/* ---------------------------------------------------------------------------
 * buffers and kernels: host loops, or the device's (fs_device.h) */

/* numel elements of t: a tensor from u->empty on a device (*owner holds it;
 * a previous one is released), else malloc'd host memory (*owner NULL). */
void *fs_unit_take(UnitObject *u, int64_t numel, fs_dtype t, PyObject **owner)
{
    if (!u->empty) {
        void *p = malloc(numel ? (size_t)numel * fs_dtype_size(t) : 1);
        return p ? p : PyErr_NoMemory();
    }
    /* At least one element: an empty tensor's data pointer is NULL, which
     * would read as a failure here. */
    PyObject *tensor = PyObject_CallFunction(u->empty, "Li", (long long)(numel ? numel : 1),
                                             (int)t);
    void *p = NULL;
    if (!tensor || fs_tensor_ptr(tensor, &p) < 0) {
        Py_XDECREF(tensor);
        return NULL;
    }
    Py_XSETREF(*owner, tensor);
    return p;
}

/* On a device, enqueued on `stream`. */
fs_status fs_unit_cast(UnitObject *u, void *stream, void *dst, fs_dtype dt, const void *src,
                       fs_dtype st, int64_t n)
{
    const fs_device_api *d = u->comm->dev;
    fs_comm *c = u->comm->comm;
    if (d) /* enqueued: no need to release the GIL */
        return d->cast(dst, dt, src, st, n, stream, c->last_error, sizeof c->last_error);
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_cast(dst, dt, src, st, n);
    Py_END_ALLOW_THREADS
    return s;
}

/* On a device, enqueued on `stream` (the caller's, or the backend's own for
 * work that follows a deferred collective). */
fs_status fs_unit_scale_accumulate(UnitObject *u, void *stream, void *dst, fs_dtype dt,
                                   const void *src, fs_dtype st, int64_t n, double scale,
                                   int accumulate)
{
    const fs_device_api *d = u->comm->dev;
    fs_comm *c = u->comm->comm;
    if (d)
        return d->scale_accumulate(dst, dt, src, st, n, scale, accumulate, stream,
                                   c->last_error, sizeof c->last_error);
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_scale_accumulate(dst, dt, src, st, n, scale, accumulate);
    Py_END_ALLOW_THREADS
    return s;
}

/* Add context to the exception now set: which unit, which operation. */
PyObject *fs_unit_annotate(UnitObject *u, const char *what, Py_ssize_t g)
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
    static char *kwlist[] = {"name", "comm", "strategy", "groups", "grad_mask", "empty",
                             "offload", "replicate", NULL};
    PyObject *name, *comm, *groups, *empty = Py_None, *replicate = Py_None;
    int strategy, offload = 0;
    unsigned long long grad_mask;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "UOiOK|$OpO", kwlist, &name, &comm, &strategy,
                                     &groups, &grad_mask, &empty, &offload, &replicate))
        return NULL;
    fs_mod_state *st = fs_state_from_type(tp);
    if (!PyObject_TypeCheck(comm, (PyTypeObject *)st->CommType))
        return PyErr_Format(PyExc_TypeError, "Unit: comm must be a flatshard._C.Comm");
    if (replicate != Py_None &&
        (!PyObject_TypeCheck(replicate, (PyTypeObject *)st->CommType) ||
         (((CommObject *)replicate)->dev != NULL) != (((CommObject *)comm)->dev != NULL) ||
         strategy == FS_NO_SHARD || offload))
        return PyErr_Format(PyExc_TypeError, "Unit: replicate must be a flatshard._C.Comm of "
                            "the same kind as comm, for a sharding strategy without offload");
    if ((((CommObject *)comm)->dev != NULL) != (empty != Py_None) ||
        (empty != Py_None && !PyCallable_Check(empty)))
        return PyErr_Format(PyExc_TypeError, "Unit: a Comm bound to a device needs "
                            "empty=callable(numel, dtype_code) -> tensor, and only such a Comm");
    if (offload && (empty == Py_None || strategy == FS_NO_SHARD))
        return PyErr_Format(PyExc_ValueError, "Unit: offload=True (host shards) needs a Comm "
                            "bound to a device, and a sharding strategy");
    if (strategy != FS_FULL_SHARD && strategy != FS_SHARD_GRAD_OP && strategy != FS_NO_SHARD)
        return PyErr_Format(PyExc_ValueError, "Unit: strategy %d is not 1, 2 or 3", strategy);
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
    u->replicate = replicate != Py_None ? (CommObject *)Py_NewRef(replicate) : NULL;
    u->empty = empty != Py_None ? Py_NewRef(empty) : NULL;
    u->offload = offload;
    if (!(u->held = PyList_New(0)) || !(u->gather_held = PyList_New(0))) {
        Py_DECREF(seq);
        Py_DECREF(u);
        return NULL;
    }
    u->cfg.strategy = strategy;
    u->cfg.is_root = 0;
    u->cfg.grad_mask = grad_mask;
    fs_unit_fsm_init(&u->fsm);
    /* NO_SHARD buffers are always whole; sharded ones start sharded. Under
     * mixed precision NO_SHARD's compute buffer (lp) is a cast of the whole
     * shard, made at forward and freed after backward like SHARD_GRAD_OP's
     * gather: the state machine runs as SHARD_GRAD_OP, the data movement
     * stays NO_SHARD's (a local cast; an all-reduce for gradients). */
    u->replicated = strategy == FS_NO_SHARD;
    u->unsharded = strategy == FS_NO_SHARD;
    for (Py_ssize_t i = 0; i < n; i++) {
        unit_group *g = &u->groups[i];
        int dt, cdt = -1, rdt = -1;
        long long sn, pn;
        PyObject *lp = Py_None;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "OOiLL|Oii;Unit: each group is "
                              "(shard, full, dtype, shard_numel, padded_numel[, lp, "
                              "compute_dtype, reduce_dtype])",
                              &g->shard, &g->full, &dt, &sn, &pn, &lp, &cdt, &rdt)) {
            g->shard = g->full = NULL;
            goto fail;
        }
        Py_INCREF(g->shard);
        Py_INCREF(g->full);
        u->ngroups = i + 1;
        g->dtype = dt;
        g->compute = cdt < 0 ? (fs_dtype)dt : (fs_dtype)cdt;
        g->reduce = rdt < 0 ? g->compute : (fs_dtype)rdt;
        if (lp != Py_None) {
            g->lp = Py_NewRef(lp);
            if (!(g->lp_storage = PyObject_CallMethod(lp, "untyped_storage", NULL)))
                goto fail;
        }
        if ((g->compute != g->dtype) != (g->lp != NULL) || !fs_dtype_is_float(g->reduce)) {
            PyErr_Format(PyExc_ValueError, "Unit %U group %zd: a compute dtype other than the "
                         "parameters' needs an lp buffer", name, i);
            goto fail;
        }
        if (g->lp && u->replicated) { /* lp, not the full buffer, is what moves */
            u->cfg.strategy = FS_SHARD_GRAD_OP;
            u->unsharded = 0;
        }
        if ((g->lp && !u->replicated &&
             !(g->lp_shard = fs_unit_take(u, sn, g->compute, &g->lp_shard_t))) ||
            (g->reduce != g->dtype &&
             !(g->red_out = fs_unit_take(u, sn, g->reduce, &g->red_out_t))))
            goto fail;
        g->shard_numel = sn;
        g->padded_numel = pn;
        if (fs_dtype_size(g->dtype) == 0 || sn < 0 ||
            pn != sn * (strategy == FS_NO_SHARD ? 1 : u->comm->comm->world_size)) {
            PyErr_Format(PyExc_ValueError, "Unit %U group %zd: inconsistent sizes/dtype", name, i);
            goto fail;
        }
        if (!(g->storage = PyObject_CallMethod(g->full, "untyped_storage", NULL)))
            goto fail;
        /* One rank with full == shard has nothing to move: only NO_SHARD fits. */
        if (strategy != FS_NO_SHARD && u->comm->comm->world_size == 1 && !g->lp && !offload) {
            PyErr_Format(PyExc_ValueError, "Unit %U: one rank has nothing to shard; use "
                         "NO_SHARD", name);
            goto fail;
        }
    }
    u->full_unsharded = u->replicated || u->unsharded; /* NO_SHARD: full is the shard */
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
        Py_XDECREF(u->groups[i].lp);
        Py_XDECREF(u->groups[i].lp_storage);
        if (!u->empty) { /* else the tensors below own them */
            free(u->groups[i].lp_shard);
            free(u->groups[i].red_out);
        }
        Py_XDECREF(u->groups[i].lp_shard_t);
        Py_XDECREF(u->groups[i].red_out_t);
    }
    free(u->groups);
    if (!u->empty)
        free(u->scratch);
    if (u->gather_event)
        u->comm->dev->event_free(u->gather_event);
    if (u->reduce_event)
        u->comm->dev->event_free(u->reduce_event);
    if (u->scatter_event)
        u->comm->dev->event_free(u->scatter_event);
    Py_XDECREF(u->held);
    Py_XDECREF(u->gather_held);
    Py_XDECREF(u->scratch_t);
    Py_XDECREF(u->empty);
    Py_XDECREF(u->name);
    Py_XDECREF(u->comm);
    Py_XDECREF(u->replicate);
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
        return fs_raise(fs_unit_mstate(u), s, "unit '%U': event %s (group %d) in state %s", u->name,
                        fs_event_name(ev), group, fs_unit_state_name(before));
    return PyLong_FromUnsignedLong(actions);
}

/* ---------------------------------------------------------------------------
 * data movement */

/* Gather every group's shard into `full` (full_precision) or into its compute
 * buffer (lp under mixed precision, cast first; else full). */
/* The caller's stream waits for a deferred gather ([Note: deferred collectives]). */
static int wait_gathered(UnitObject *u)
{
    if (!u->gather_pending)
        return 0;
    fs_comm *c = u->comm->comm;
    fs_status s;
    if (fs_comm_bind_stream(u->comm) < 0)
        return -1;
    s = u->comm->dev->wait(u->gather_event, u->comm->stream, c->last_error,
                           sizeof c->last_error);
    if (s != FS_OK) {
        fs_raise(fs_unit_mstate(u), s, "waiting for a prefetched all-gather: %s", c->last_error);
        fs_unit_annotate(u, "unshard", 0);
        return -1;
    }
    u->gather_pending = 0;
    return PyList_SetSlice(u->gather_held, 0, PyList_GET_SIZE(u->gather_held), NULL);
}

static PyObject *gather_groups(UnitObject *u, int full_precision, int allocate, int keep);

static PyObject *gather(UnitObject *u, int full_precision, int defer)
{
    const fs_device_api *d = u->comm->dev;
    defer = defer && d;
    if (!defer)
        return gather_groups(u, full_precision, 1, 0);
    fs_comm *c = u->comm->comm;
    d->set_defer(c, 1);
    PyObject *r = gather_groups(u, full_precision, 1, 1);
    d->set_defer(c, 0);
    if (!r)
        return NULL;
    fs_status s = d->record(c, &u->gather_event, c->last_error, sizeof c->last_error);
    if (s != FS_OK) {
        Py_DECREF(r);
        fs_raise(fs_unit_mstate(u), s, "marking a prefetched all-gather: %s", c->last_error);
        return fs_unit_annotate(u, "unshard", 0);
    }
    u->gather_pending = 1;
    return r;
}

/* allocate: give the gathered buffers their storage first (0: it is live).
 * keep: a deferred gather, whose per-gather buffers are held until waited. */
static PyObject *gather_groups(UnitObject *u, int full_precision, int allocate, int keep)
{
    if (fs_comm_bind_stream(u->comm) < 0)
        return fs_unit_annotate(u, "unshard", 0);
    for (Py_ssize_t i = 0; i < u->ngroups; i++) {
        unit_group *g = &u->groups[i];
        int use_lp = g->lp && !full_precision;
        fs_dtype t = use_lp ? g->compute : g->dtype;
        void *sp, *dp;
        if (u->replicated) { /* NO_SHARD: no collective, the whole shard is cast */
            if (!use_lp)
                continue; /* the full buffer is the shard */
            fs_status s;
            if ((allocate && fs_unit_set_storage(u, g->lp_storage, g->padded_numel *
                                                 (int64_t)fs_dtype_size(g->compute)) < 0) ||
                fs_tensor_ptr(g->shard, &sp) < 0 || fs_tensor_ptr(g->lp, &dp) < 0)
                return fs_unit_annotate(u, "unshard", i);
            if ((s = fs_unit_cast(u, u->comm->stream, dp, g->compute, sp, g->dtype,
                                  g->padded_numel)) != FS_OK) {
                fs_raise(fs_unit_mstate(u), s, "cast: %s", u->comm->comm->last_error);
                return fs_unit_annotate(u, "unshard", i);
            }
            continue;
        }
        if ((allocate && fs_unit_set_storage(u, use_lp ? g->lp_storage : g->storage,
                                             g->padded_numel * (int64_t)fs_dtype_size(t)) < 0) ||
            fs_tensor_ptr(g->shard, &sp) < 0 || fs_tensor_ptr(use_lp ? g->lp : g->full, &dp) < 0)
            return fs_unit_annotate(u, "unshard", i);
        fs_status s = FS_OK;
        PyObject *staged = NULL; /* released after the gather (kept if it is deferred) */
        /* A deferred gather of host shards copies and casts on the backend's
         * stream, after the caller's work so far: beside the caller's compute. */
        void *on = u->comm->stream;
        if (u->offload) { /* the host shard, staged on the device for this gather */
            const fs_device_api *d = u->comm->dev;
            fs_comm *c = u->comm->comm;
            void *stage = fs_unit_take(u, g->shard_numel, g->dtype, &staged);
            if (!stage || (keep && PyList_Append(u->gather_held, staged) < 0)) {
                Py_XDECREF(staged);
                return fs_unit_annotate(u, "unshard", i);
            }
            if (keep && (s = d->follow_caller(c, c->last_error, sizeof c->last_error)) == FS_OK)
                on = d->comm_stream(c);
            if (s == FS_OK)
                s = d->copy(stage, sp, (size_t)g->shard_numel * fs_dtype_size(g->dtype), on,
                            c->last_error, sizeof c->last_error);
            sp = stage;
        }
        if (s == FS_OK && use_lp) { /* one pass: the master shard, cast to the compute dtype */
            s = fs_unit_cast(u, on, g->lp_shard, g->compute, sp, g->dtype, g->shard_numel);
            sp = g->lp_shard;
        }
        /* Not in place: the shard is its own buffer, so that resharding can
         * drop the whole unsharded storage. */
        if (s == FS_OK)
            FS_COMM_RECORD(u->comm, s, FS_LOP_ALL_GATHER, PyUnicode_AsUTF8(u->name),
                           g->shard_numel, t,
                           fs_comm_all_gather(u->comm->comm, sp, dp, g->shard_numel, t));
        /* Not kept: the caller's stream waits for the gather, and the
         * allocator reuses the block in that stream's order. */
        Py_XDECREF(staged);
        if (s != FS_OK) {
            fs_raise(fs_unit_mstate(u), s, "all_gather: %s", u->comm->comm->last_error);
            fs_unit_annotate(u, "all-gather", i);
            return fs_comm_failed(u->comm);
        }
        u->n_all_gather++;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(unshard_doc,
             "unshard(full_precision=False, prefetch=False): gather every group (no-op if\n"
             "live, but for waiting on a prefetch). full_precision: gather the parameters'\n"
             "own dtype even under mixed precision (summon_full_params, state dicts).\n"
             "prefetch: on a device, do not make the current stream wait for the gather\n"
             "until ready(), a plain unshard() or reshard().");
static PyObject *Unit_unshard(UnitObject *u, PyObject *args)
{
    int fp = 0, prefetch = 0;
    if (!PyArg_ParseTuple(args, "|pp", &fp, &prefetch))
        return NULL;
    int mixed = u->ngroups > 0 && u->groups[0].lp != NULL;
    int *live = fp && mixed ? &u->full_unsharded : &u->unsharded;
    if (!prefetch && wait_gathered(u) < 0)
        return NULL;
    if (*live)
        Py_RETURN_NONE;
    PyObject *r = gather(u, fp, prefetch && !fp);
    if (!r)
        return NULL;
    *live = 1;
    if (!mixed)
        u->full_unsharded = 1;
    return r;
}

PyDoc_STRVAR(regather_doc,
             "regather(): gather the compute buffers again from the shards into their live\n"
             "storage, with no reallocation (units kept whole, e.g. SHARD_OPTIM after an\n"
             "optimizer step, or after loading a state dict). A live full-precision gather\n"
             "under mixed precision is stale then, and is freed. Gathers if not live.");
static PyObject *Unit_regather(UnitObject *u, PyObject *Py_UNUSED(a))
{
    if (u->cfg.strategy == FS_NO_SHARD) /* the full buffer is the shard itself */
        Py_RETURN_NONE;
    if (wait_gathered(u) < 0)
        return NULL;
    int mixed = u->ngroups > 0 && u->groups[0].lp != NULL;
    if (mixed && u->full_unsharded && !u->replicated) {
        for (Py_ssize_t i = 0; i < u->ngroups; i++)
            if (fs_unit_set_storage(u, u->groups[i].storage, 0) < 0)
                return fs_unit_annotate(u, "regather", i);
        u->full_unsharded = 0;
    }
    int live = u->unsharded;
    PyObject *r = gather_groups(u, 0, !live, 0);
    if (r) {
        u->unsharded = 1;
        if (!mixed)
            u->full_unsharded = 1;
    }
    return r;
}

PyDoc_STRVAR(ready_doc, "ready(): the current stream waits for a prefetched all-gather\n"
                        "(a no-op when none is pending, and on the host).");
static PyObject *Unit_ready(UnitObject *u, PyObject *Py_UNUSED(a))
{
    if (wait_gathered(u) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Unit_reshard(UnitObject *u, PyObject *Py_UNUSED(a))
{
    if ((!u->unsharded && !u->full_unsharded) || u->cfg.strategy == FS_NO_SHARD)
        Py_RETURN_NONE;
    if (wait_gathered(u) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < u->ngroups; i++)
        if ((!u->replicated && fs_unit_set_storage(u, u->groups[i].storage, 0) < 0) ||
            (u->groups[i].lp && fs_unit_set_storage(u, u->groups[i].lp_storage, 0) < 0))
            return fs_unit_annotate(u, "reshard", i);
    u->unsharded = 0;
    u->full_unsharded = u->replicated; /* NO_SHARD's full buffer is the shard: kept */
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------
 * attributes */

static PyObject *Unit_get_state(UnitObject *u, void *c)
{
    return PyUnicode_FromString(fs_unit_state_name(u->fsm.state));
}
static PyObject *Unit_get_unsharded(UnitObject *u, void *c) { return PyBool_FromLong(u->unsharded); }
static PyObject *Unit_get_pending(UnitObject *u, void *c)
{
    return PyBool_FromLong(u->gather_pending);
}
static PyObject *Unit_get_reduce_pending(UnitObject *u, void *c)
{
    return PyBool_FromLong(u->reduce_pending);
}
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
    {"unshard", (PyCFunction)Unit_unshard, METH_VARARGS, unshard_doc},
    {"ready", (PyCFunction)Unit_ready, METH_NOARGS, ready_doc},
    {"wait_reduced", (PyCFunction)fs_unit_wait_reduced, METH_NOARGS,
     fs_unit_wait_reduced_doc},
    {"regather", (PyCFunction)Unit_regather, METH_NOARGS, regather_doc},
    {"reshard", (PyCFunction)Unit_reshard, METH_NOARGS,
     "reshard(): free every full buffer (no-op if sharded or NO_SHARD)."},
    {"reduce_grad", (PyCFunction)fs_unit_reduce_grad, METH_VARARGS, fs_unit_reduce_grad_doc},
    {NULL},
};

static PyGetSetDef Unit_getset[] = {
    {"state", (getter)Unit_get_state, NULL, "state-machine state name", NULL},
    {"is_unsharded", (getter)Unit_get_unsharded, NULL, "full buffers live and gathered", NULL},
    {"gather_pending", (getter)Unit_get_pending, NULL,
     "a prefetched all-gather the current stream has not waited for yet", NULL},
    {"reduce_pending", (getter)Unit_get_reduce_pending, NULL,
     "deferred gradient reductions the current stream has not waited for yet", NULL},
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
