/* py_unit_reduce.c - flatshard._C.Unit's gradient reductions: the unsharded
 * gradient averaged over the group into the shard gradient (reduce-scatter,
 * or all-reduce under NO_SHARD), in the reduce dtype, across replicas too
 * under HYBRID_SHARD, deferred on a device ([Note: deferred collectives] in
 * py_unit.c), copied out to host memory under parameter offload. */
#include "py_unit.h"

#include <stdio.h>
#include <stdlib.h>

static int hold(UnitObject *u, PyObject *o);

/* HYBRID_SHARD: sum a reduce-scattered shard gradient across the replicas
 * too (its sum over the shard group is in buf). Deferred, the replicas'
 * stream first waits for the reduce-scatter on the shard group's stream,
 * and what follows runs on the replicas' stream (*post). */
static fs_status across_replicas(UnitObject *u, void *buf, int64_t count, fs_dtype t,
                                 const char *uname, int defer, void **post)
{
    fs_status s = FS_OK;
    PyObject *ws;
    if (!u->replicate)
        return FS_OK;
    const fs_device_api *d = u->comm->dev;
    fs_comm *c = u->comm->comm, *rc = u->replicate->comm;
    if (defer &&
        ((s = d->record(c, &u->scatter_event, c->last_error, sizeof c->last_error)) != FS_OK ||
         (s = d->wait(u->scatter_event, d->comm_stream(rc), c->last_error,
                      sizeof c->last_error)) != FS_OK))
        return s;
    if (fs_comm_lend_workspace(u->replicate, t, count, &ws) < 0)
        return FS_ERR_PYTHON;
    if (defer)
        d->set_defer(rc, 1);
    FS_COMM_RECORD(u->replicate, s, FS_LOP_ALL_REDUCE, uname, count, t,
                   fs_comm_all_reduce(rc, buf, count, t, FS_RED_SUM));
    if (defer) {
        d->set_defer(rc, 0);
        *post = d->comm_stream(rc);
        if (hold(u, ws) < 0) /* read on the replicas' stream until waited for */
            s = FS_ERR_PYTHON;
        if (ws)
            d->set_workspace(rc, NULL, 0);
        Py_XDECREF(ws);
    } else {
        fs_comm_return_workspace(u->replicate, &ws);
    }
    if (s != FS_OK && s != FS_ERR_PYTHON)
        snprintf(c->last_error, sizeof c->last_error, "across replicas: %s", rc->last_error);
    return s;
}

/* The caller's stream waits for deferred reductions; their buffers go back. */
static int wait_reduced(UnitObject *u)
{
    if (!u->reduce_pending && !u->host_pending)
        return 0;
    fs_comm *c = u->comm->comm;
    if (fs_comm_bind_stream(u->comm) < 0)
        return -1;
    fs_status s = FS_OK;
    if (u->reduce_pending)
        s = u->comm->dev->wait(u->reduce_event, u->comm->stream, c->last_error,
                               sizeof c->last_error);
    /* offload: the host (its optimizer) reads the gradients copied out */
    if (s == FS_OK && u->host_pending)
        s = u->comm->dev->synchronize(u->comm->stream, c->last_error, sizeof c->last_error);
    if (s != FS_OK) {
        fs_raise(fs_unit_mstate(u), s, "waiting for a gradient reduction: %s", c->last_error);
        fs_unit_annotate(u, "reduce-scatter", 0);
        return -1;
    }
    u->reduce_pending = u->host_pending = 0;
    return PyList_SetSlice(u->held, 0, PyList_GET_SIZE(u->held), NULL);
}

/* Keep `o` (may be NULL) alive until the caller's stream waited. */
static int hold(UnitObject *u, PyObject *o)
{
    return o ? PyList_Append(u->held, o) : 0;
}

/* ---------------------------------------------------------------------------
 * the methods */

const char fs_unit_reduce_grad_doc[] =
    "reduce_grad(group, grad, out, accumulate, defer=False)\n"
    "Average the unsharded gradient `grad` (padded_numel) over the group into the\n"
    "shard gradient `out` (shard_numel): out = (accumulate ? out : 0) + mean.\n"
    "`grad` is used as scratch and left undefined. defer (device units): the current\n"
    "stream does not wait for it until wait_reduced() ([Note: deferred collectives]).";


PyObject *fs_unit_reduce_grad(UnitObject *u, PyObject *args)
{
    Py_ssize_t gi;
    PyObject *grad, *out;
    int accumulate, defer = 0;
    if (!PyArg_ParseTuple(args, "nOOp|p", &gi, &grad, &out, &accumulate, &defer))
        return NULL;
    if (gi < 0 || gi >= u->ngroups)
        return PyErr_Format(PyExc_IndexError, "unit '%U': no group %zd", u->name, gi);
    const fs_device_api *d = u->comm->dev;
    defer = defer && d;
    unit_group *g = &u->groups[gi];
    fs_comm *c = u->comm->comm;
    void *gp, *op;
    if (fs_tensor_ptr(grad, &gp) < 0 || fs_tensor_ptr(out, &op) < 0 ||
        fs_comm_bind_stream(u->comm) < 0 || (u->replicate && fs_comm_bind_stream(u->replicate) < 0))
        return NULL;
    void *pre = u->comm->stream;                      /* before the collective */
    void *post = defer ? d->comm_stream(c) : pre;     /* after it */
    /* offload: reduce into device memory, then copy to the host gradient */
    void *host_op = NULL;
    PyObject *dev_out_t = NULL;
    if (u->offload) {
        if (accumulate)
            return PyErr_Format(PyExc_ValueError, "unit '%U': with parameter offload, "
                                "gradients are not accumulated across backward passes",
                                u->name);
        host_op = op;
        if (!(op = fs_unit_take(u, g->shard_numel, g->dtype, &dev_out_t)))
            return NULL;
    }
    /* the mean over every rank holding a replica of this shard too */
    const double inv = 1.0 / (c->world_size * (u->replicate ? u->replicate->comm->world_size : 1));
    const char *uname = PyUnicode_AsUTF8(u->name); /* for the ledger */
    PyObject *red_in_t = NULL, *ws_t = NULL; /* a device's per-reduction buffers */
    void *staging = NULL; /* the host's: the reduce-dtype copy, from the pool */
    fs_status s = FS_OK;
    /* The gradient arrives in the compute dtype; the collective runs in the
     * reduce dtype. fp16 sums are divided first (they could overflow), the
     * others after, in f32 or better ([Note: mixed precision]). */
    void *src = gp;
    double post_scale = inv;
    if (g->reduce != g->compute || g->reduce == FS_F16) {
        void *dst = gp;
        if (g->reduce != g->compute &&
            !(dst = u->empty ? fs_unit_take(u, g->padded_numel, g->reduce, &red_in_t)
                             : (staging = fs_unit_take_staging(
                                    u, g->padded_numel * (int64_t)fs_dtype_size(g->reduce))))) {
            Py_XDECREF(dev_out_t);
            return NULL;
        }
        s = fs_unit_scale_accumulate(u, pre, dst, g->reduce, gp, g->compute, g->padded_numel,
                                     inv, 0);
        src = dst;
        post_scale = 1.0;
    }
    const int no_shard = u->replicated;
    if (s == FS_OK && (!no_shard || c->world_size > 1) &&
        fs_comm_lend_workspace(u->comm, g->reduce, g->padded_numel, &ws_t) < 0) {
        Py_XDECREF(red_in_t);
        Py_XDECREF(dev_out_t);
        fs_unit_give_staging(staging);
        return NULL;
    }
    if (defer)
        d->set_defer(c, 1);
    if (s != FS_OK) {
    } else if (no_shard) { /* summed in the reduce dtype, in place */
        if (c->world_size > 1) /* one rank's sum is its own gradient */
            FS_COMM_RECORD(u->comm, s, FS_LOP_ALL_REDUCE, uname, g->padded_numel, g->reduce,
                           fs_comm_all_reduce(c, src, g->padded_numel, g->reduce, FS_RED_SUM));
        if (s == FS_OK)
            s = fs_unit_scale_accumulate(u, post, op, g->dtype, src, g->reduce, g->shard_numel,
                                         post_scale, accumulate);
    } else {
        /* Where the reduce-scatter lands: the shard gradient itself when it
         * starts empty and keeps the dtype; else a buffer added into it. */
        void *land = op;
        fs_dtype lt = g->dtype;
        if (g->reduce != g->dtype) {
            land = g->red_out;
            lt = g->reduce;
        } else if (accumulate) {
            size_t need = (size_t)g->shard_numel * fs_dtype_size(g->dtype);
            void *p = u->scratch;
            /* a deferred reduction may still read the old scratch: hold it */
            if (need > u->scratch_bytes &&
                ((defer && hold(u, u->scratch_t) < 0) ||
                 !(p = u->empty ? fs_unit_take(u, g->shard_numel, g->dtype, &u->scratch_t)
                                : realloc(u->scratch, need ? need : 1)))) {
                if (!u->empty && !PyErr_Occurred())
                    PyErr_NoMemory();
                if (defer)
                    d->set_defer(c, 0);
                Py_XDECREF(red_in_t);
                Py_XDECREF(dev_out_t);
                fs_unit_give_staging(staging);
                fs_comm_return_workspace(u->comm, &ws_t);
                return NULL;
            }
            if (need > u->scratch_bytes) {
                u->scratch = p;
                u->scratch_bytes = need;
            }
            land = u->scratch;
        }
        FS_COMM_RECORD(u->comm, s, FS_LOP_REDUCE_SCATTER, uname, g->shard_numel, lt,
                       fs_comm_reduce_scatter(c, src, land, g->shard_numel, lt, FS_RED_SUM));
        if (s == FS_OK)
            s = across_replicas(u, land, g->shard_numel, lt, uname, defer, &post);
        if (s == FS_OK && (land != op || post_scale != 1.0))
            s = fs_unit_scale_accumulate(u, post, op, g->dtype, land, lt, g->shard_numel,
                                         post_scale, land == op ? 0 : accumulate);
    }
    if (s == FS_OK && host_op) {
        s = d->copy(host_op, op, (size_t)g->shard_numel * fs_dtype_size(g->dtype), post,
                    c->last_error, sizeof c->last_error);
        u->host_pending = 1; /* the host waits before reading it (wait_reduced) */
    }
    if (defer) {
        d->set_defer(c, 0);
        /* the mark goes on the stream the last of the work went to */
        fs_comm *last = u->replicate && !no_shard ? u->replicate->comm : c;
        if (s == FS_OK)
            s = d->record(last, &u->reduce_event, c->last_error, sizeof c->last_error);
        if (s == FS_OK) { /* what the enqueued work reads and writes stays alive */
            u->reduce_pending = 1;
            if (hold(u, grad) < 0 || hold(u, out) < 0 || hold(u, red_in_t) < 0 ||
                hold(u, ws_t) < 0 || hold(u, dev_out_t) < 0) {
                Py_XDECREF(red_in_t);
                Py_XDECREF(dev_out_t);
                fs_comm_return_workspace(u->comm, &ws_t);
                return NULL;
            }
        }
    }
    Py_XDECREF(dev_out_t);
    Py_XDECREF(red_in_t);
    fs_unit_give_staging(staging);
    fs_comm_return_workspace(u->comm, &ws_t);
    if (s != FS_OK) {
        fs_raise(fs_unit_mstate(u), s, "gradient reduction: %s", c->last_error);
        fs_unit_annotate(u, u->replicated ? "all-reduce" : "reduce-scatter", gi);
        return fs_comm_failed(u->comm);
    }
    u->n_reduce++;
    Py_RETURN_NONE;
}

const char fs_unit_wait_reduced_doc[] =
    "wait_reduced(): the current stream waits for deferred gradient reductions, and\n"
    "their buffers are released (a no-op when none is pending, and on the host).";


PyObject *fs_unit_wait_reduced(UnitObject *u, PyObject *Py_UNUSED(a))
{
    if (wait_reduced(u) < 0)
        return NULL;
    Py_RETURN_NONE;
}

