/* py_comm.c - flatshard._C.Comm: a collective backend handle for Python.
 *
 * Python holds one Comm per process group and passes it to every Unit.
 * Buffers are given as (data_ptr, numel) of contiguous tensors: host memory
 * for the shm and torch backends; device memory for kind='device', which
 * wraps a backend exported by another object (NCCL's, from flatshard._C_cuda)
 * with that device's kernels (fs_device.h) and orders every collective
 * against the caller's current stream: NCCL's collectives are issued from
 * Python only here (flatshard._C_cuda.NcclComm keeps what is NCCL's alone).
 * The facade in flatshard/runtime/comm.py checks tensors before calling. A
 * collective called here runs as the engine's do, on the Comm's link
 * (engine.h): recorded in its ledger (ledger.h) by FS_LINK_RUN, with float32
 * staging lent by fs_link_lend; a failed one raises with the ledger's last
 * entries. */
#include "fs_py.h"
#include "env.h"

#include <stddef.h> /* offsetof */

/* The optional last argument of each collective: what it is for (ledger). */
#define TAG_DOC "\n`tag` (optional) says what it is for, in the ledger and in errors."

/* kind='device': wrap the fs_comm* exported by `owner` (FS_COMM_CAPSULE),
 * which stays owned (and is destroyed) by it. */
static PyObject *device_comm(PyTypeObject *tp, int rank, int world, PyObject *capsule,
                             PyObject *owner, PyObject *dev, PyObject *stream_fn, PyObject *empty,
                             int device_index)
{
    if (!capsule || !owner || !dev || !stream_fn || !PyCallable_Check(stream_fn) || !empty ||
        !PyCallable_Check(empty))
        return PyErr_Format(PyExc_TypeError, "Comm(kind='device') needs capsule=, owner=, "
                            "device_api=, and callables stream_fn= and empty=");
    if (!PyCapsule_IsValid(capsule, FS_COMM_CAPSULE) ||
        !PyCapsule_IsValid(dev, FS_DEVICE_API_CAPSULE))
        return PyErr_Format(PyExc_TypeError, "Comm(kind='device'): capsule= must be a '"
                            FS_COMM_CAPSULE "' capsule and device_api= a '"
                            FS_DEVICE_API_CAPSULE "' capsule");
    fs_comm *c = PyCapsule_GetPointer(capsule, FS_COMM_CAPSULE);
    const fs_device_api *api = PyCapsule_GetPointer(dev, FS_DEVICE_API_CAPSULE);
    if (api->version != FS_DEVICE_API_VERSION)
        return PyErr_Format(PyExc_RuntimeError, "Comm: device API version %d, this build "
                            "expects %d (rebuild flatshard)", api->version,
                            FS_DEVICE_API_VERSION);
    if (c->rank != rank || c->world_size != world)
        return PyErr_Format(PyExc_ValueError, "Comm(kind='device'): the backend is rank %d of "
                            "%d, not %d of %d", c->rank, c->world_size, rank, world);
    CommObject *self = (CommObject *)tp->tp_alloc(tp, 0);
    if (!self)
        return NULL;
    fs_ledger_init(&self->ledger);
    self->comm = c;
    self->owner = Py_NewRef(owner);
    self->dev = api;
    self->stream_fn = Py_NewRef(stream_fn);
    self->empty = Py_NewRef(empty);
    self->device_index = device_index;
    return (PyObject *)self;
}

int fs_comm_bind_stream(CommObject *self)
{
    if (!self->dev)
        return 0;
    PyObject *r = PyObject_CallNoArgs(self->stream_fn);
    if (!r)
        return -1;
    void *s = PyLong_AsVoidPtr(r);
    Py_DECREF(r);
    if (PyErr_Occurred())
        return -1;
    self->stream = s;
    self->dev->set_caller_stream(self->comm, s);
    return 0;
}

static PyObject *Comm_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"kind", "rank", "world_size", "fn", "name", "create", "slot_bytes",
                             "timeout_s", "capsule", "owner", "device_api", "stream_fn", "empty",
                             "staging", "device_index", NULL};
    const char *kind, *name = NULL, *staging = "auto";
    PyObject *fn = NULL, *capsule = NULL, *owner = NULL, *dev = NULL, *stream_fn = NULL;
    PyObject *empty = NULL;
    int rank, world, create = 0, device_index = -1;
    Py_ssize_t slot_bytes = 0;
    double timeout_s = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sii|$OzpndOOOOOsi", kwlist, &kind, &rank,
                                     &world, &fn, &name, &create, &slot_bytes, &timeout_s,
                                     &capsule, &owner, &dev, &stream_fn, &empty, &staging,
                                     &device_index))
        return NULL;
    /* [Note: staging stores] (backends/shm_staging.h) */
    const int policy = strcmp(staging, "auto") == 0       ? FS_STAGE_AUTO
                       : strcmp(staging, "cached") == 0   ? FS_STAGE_CACHED
                       : strcmp(staging, "streamed") == 0 ? FS_STAGE_STREAMED
                                                          : -1;
    if (policy < 0)
        return PyErr_Format(PyExc_ValueError, "Comm: staging must be 'auto', 'cached' or "
                            "'streamed', got '%s'", staging);
    if (strcmp(kind, "device") == 0)
        return device_comm(tp, rank, world, capsule, owner, dev, stream_fn, empty, device_index);
    fs_mod_state *st = fs_state_from_type(tp);
    CommObject *self = (CommObject *)tp->tp_alloc(tp, 0);
    if (!self)
        return NULL;
    fs_ledger_init(&self->ledger);
    fs_status s;
    char err[512] = "";
    if (strcmp(kind, "torch") == 0 && fn) {
        s = fs_comm_torch_create(fn, rank, world, &self->comm);
    } else if (strcmp(kind, "shm") == 0 && name) {
        Py_BEGIN_ALLOW_THREADS
        s = fs_comm_shm_create(name, rank, world, (size_t)slot_bytes, timeout_s, policy, create,
                               &self->ledger, &self->comm, err, sizeof err);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_Format(PyExc_ValueError, "Comm: kind must be 'torch' (with fn), 'shm' (with "
                     "name) or 'device' (with capsule, owner, device_api and stream_fn), got %s",
                     kind);
        goto fail;
    }
    if (s != FS_OK) {
        fs_raise(st, s, "Comm(kind='%s', rank=%d, world_size=%d): %s", kind, rank, world, err);
        goto fail;
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static void Comm_dealloc(CommObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (!self->owner)
        fs_comm_destroy(self->comm);
    Py_XDECREF(self->owner);
    Py_XDECREF(self->stream_fn);
    Py_XDECREF(self->empty);
    Py_XDECREF(self->on_failure);
    Py_XDECREF(self->on_stop);
    tp->tp_free(self);
    Py_DECREF(tp);
}

PyObject *fs_comm_failed(CommObject *self)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v) {
        char buf[2048], head[96];
        snprintf(head, sizeof head, "flatshard: rank %d's last collectives on this %s Comm:",
                 self->comm->rank, self->comm->ops->name);
        fs_ledger_tail(&self->ledger, 8, head, buf, sizeof buf);
        PyObject *r = PyObject_CallMethod(v, "add_note", "s", buf);
        if (r && self->on_failure) {
            Py_DECREF(r);
            r = PyObject_CallFunctionObjArgs(self->on_failure, (PyObject *)self, v, NULL);
        }
        if (!r) /* a failing report must not hide the collective's own error */
            PyErr_WriteUnraisable(self->on_failure);
        Py_XDECREF(r);
    }
    PyErr_Restore(t, v, tb);
    return NULL;
}

PyObject *fs_comm_done(CommObject *self, fs_status s, const char *op, const char *tag)
{
    if (s == FS_OK)
        Py_RETURN_NONE;
    fs_raise(fs_state_from_type(Py_TYPE(self)), s, "%s%s%s%s on backend %s: %s", op,
             *tag ? " for '" : "", tag, *tag ? "'" : "", self->comm->ops->name,
             self->comm->last_error);
    return fs_comm_failed(self);
}

/* ---------------------------------------------------------------------------
 * collectives: each method parses its arguments into one record, and
 * collective() runs it on the Comm's link, the caller's stream bound
 * (fs_link_collective: recorded in the ledger, float32 staging lent to a
 * device reduction), raised as fs_comm_done says. */

typedef struct {
    fs_ledger_op op;
    const char *tag;
    unsigned long long send, recv; /* one buffer (send) for the in-place ops */
    long long count;               /* recv_count for reduce_scatter */
    int dtype, average, root;
} coll_args;

static PyObject *collective(CommObject *self, const coll_args *a)
{
    const fs_env env = fs_hooks_env(&self->empty);
    fs_link l = fs_glue_link(self);
    if (fs_comm_bind_stream(self) < 0)
        return NULL;
    fs_status s = fs_link_collective(&l, &env, a->op, a->tag, (void *)a->send, (void *)a->recv,
                                     a->count, a->dtype, a->average, a->root);
    if (s != FS_OK && PyErr_Occurred())
        return fs_comm_failed(self); /* Python raised (the backend's call, the staging) */
    return fs_comm_done(self, s, fs_ledger_op_name(a->op), a->tag);
}

PyDoc_STRVAR(all_gather_doc, "all_gather(send_ptr, recv_ptr, count, dtype, tag='')\n"
                             "recv holds world_size*count; rank r's send lands at recv + r*count."
                             TAG_DOC);
static PyObject *Comm_all_gather(CommObject *self, PyObject *args)
{
    coll_args a = {FS_LOP_ALL_GATHER, ""};
    if (!PyArg_ParseTuple(args, "KKLi|s", &a.send, &a.recv, &a.count, &a.dtype, &a.tag))
        return NULL;
    return collective(self, &a);
}

PyDoc_STRVAR(reduce_scatter_doc,
             "reduce_scatter(send_ptr, recv_ptr, recv_count, dtype, average, tag='')" TAG_DOC);
static PyObject *Comm_reduce_scatter(CommObject *self, PyObject *args)
{
    coll_args a = {FS_LOP_REDUCE_SCATTER, ""};
    if (!PyArg_ParseTuple(args, "KKLip|s", &a.send, &a.recv, &a.count, &a.dtype, &a.average,
                          &a.tag))
        return NULL;
    return collective(self, &a);
}

PyDoc_STRVAR(all_reduce_doc, "all_reduce(ptr, count, dtype, average, tag='')" TAG_DOC);
static PyObject *Comm_all_reduce(CommObject *self, PyObject *args)
{
    coll_args a = {FS_LOP_ALL_REDUCE, ""};
    if (!PyArg_ParseTuple(args, "KLip|s", &a.send, &a.count, &a.dtype, &a.average, &a.tag))
        return NULL;
    return collective(self, &a);
}

PyDoc_STRVAR(broadcast_doc, "broadcast(ptr, count, dtype, root, tag=''): root is a rank of this "
                            "group." TAG_DOC);
static PyObject *Comm_broadcast(CommObject *self, PyObject *args)
{
    coll_args a = {FS_LOP_BROADCAST, ""};
    if (!PyArg_ParseTuple(args, "KLii|s", &a.send, &a.count, &a.dtype, &a.root, &a.tag))
        return NULL;
    return collective(self, &a);
}

PyDoc_STRVAR(barrier_doc, "barrier(tag='')" TAG_DOC);
static PyObject *Comm_barrier(CommObject *self, PyObject *args)
{
    coll_args a = {FS_LOP_BARRIER, "", .dtype = FS_U8};
    if (!PyArg_ParseTuple(args, "|s", &a.tag))
        return NULL;
    return collective(self, &a);
}

PyDoc_STRVAR(all_to_all_doc, "all_to_all(send_ptr, recv_ptr, count, dtype, tag='')\n"
                             "send and recv hold world_size*count; send[r*count...] goes to rank\n"
                             "r, landing at its recv[rank*count...]." TAG_DOC);
static PyObject *Comm_all_to_all(CommObject *self, PyObject *args)
{
    coll_args a = {FS_LOP_ALL_TO_ALL, ""};
    if (!PyArg_ParseTuple(args, "KKLi|s", &a.send, &a.recv, &a.count, &a.dtype, &a.tag))
        return NULL;
    return collective(self, &a);
}

/* The engine's quantized collectives ([Note: quantized collectives] in
 * engine/engine.h) on this Comm's link, the ones groups issue. */
PyDoc_STRVAR(quantized_doc,
             "quantized(op, send_ptr, recv_ptr, count, dtype, bits, block, tag='')\n"
             "op 'all_gather' (bits 8; count per rank) or 'reduce_scatter' (a sum; bits 8 or\n"
             "4; count received): the engine's quantized collective on this Comm (host).");
static PyObject *Comm_quantized(CommObject *self, PyObject *args)
{
    const char *op, *tag = "";
    unsigned long long sp, rp;
    long long count, block;
    int dtype, bits;
    if (!PyArg_ParseTuple(args, "sKKLiiL|s", &op, &sp, &rp, &count, &dtype, &bits, &block, &tag))
        return NULL;
    const int gather = strcmp(op, "all_gather") == 0;
    if (!gather && strcmp(op, "reduce_scatter") != 0)
        return PyErr_Format(PyExc_ValueError, "quantized: op must be 'all_gather' or "
                            "'reduce_scatter', got '%s'", op);
    if (self->dev)
        return PyErr_Format(PyExc_ValueError, "quantized: host Comms only");
    fs_link l = fs_glue_link(self);
    const fs_env env = fs_hooks_env(&self->empty);
    fs_status s = fs_link_quantized(&l, &env, gather, bits, block, tag, (void *)sp, (void *)rp,
                                    count, dtype);
    return fs_comm_done(self, s, op, tag);
}

PyDoc_STRVAR(ledger_doc,
             "ledger() -> list of dicts, oldest first: the last collectives issued through this\n"
             "Comm, each {seq, op, unit, bytes, dtype, state} (state: issued, completed,\n"
             "failed, or on a device enqueued: on the stream, finishing later). `bytes` is the\n"
             "count argument in bytes (per rank for all_gather and reduce_scatter).");
static PyObject *Comm_ledger(CommObject *self, PyObject *Py_UNUSED(a))
{
    const fs_ledger *l = &self->ledger;
    PyObject *out = PyList_New(0);
    uint64_t first = l->count > FS_LEDGER_CAP ? l->count - FS_LEDGER_CAP + 1 : 1;
    for (uint64_t seq = first; out && seq <= l->count; seq++) {
        const fs_ledger_entry *e = fs_ledger_get(l, seq);
        PyObject *d = Py_BuildValue("{sKsssssLssss}", "seq", (unsigned long long)e->seq, "op",
                                    fs_ledger_op_name(e->op), "unit", e->unit, "bytes",
                                    (long long)e->bytes, "dtype", fs_dtype_name(e->dtype),
                                    "state", fs_ledger_state_name(e->state));
        if (!d || PyList_Append(out, d) < 0)
            Py_CLEAR(out);
        Py_XDECREF(d);
    }
    return out;
}

/* on_failure and on_stop: a callable or None, held in the CommObject field
 * that the getset's closure names. */
typedef struct {
    size_t offset; /* of the PyObject * field in CommObject */
    const char *name;
} callback_slot;

static const callback_slot on_failure_slot = {offsetof(CommObject, on_failure), "on_failure"};
static const callback_slot on_stop_slot = {offsetof(CommObject, on_stop), "on_stop"};

static PyObject **callback_field(CommObject *self, const callback_slot *slot)
{
    return (PyObject **)((char *)self + slot->offset);
}

static PyObject *Comm_get_callback(CommObject *self, void *c)
{
    PyObject *f = *callback_field(self, c);
    return Py_NewRef(f ? f : Py_None);
}

static int Comm_set_callback(CommObject *self, PyObject *v, void *c)
{
    const callback_slot *slot = c;
    if (v && v != Py_None && !PyCallable_Check(v)) {
        PyErr_Format(PyExc_TypeError, "%s must be callable or None", slot->name);
        return -1;
    }
    Py_XSETREF(*callback_field(self, slot), v && v != Py_None ? Py_NewRef(v) : NULL);
    return 0;
}

static PyObject *Comm_get_failure(CommObject *self, void *c)
{
    switch (self->comm->last_fail) {
    case FS_FAIL_DEAD: return PyUnicode_FromString("dead");
    case FS_FAIL_ABSENT: return PyUnicode_FromString("absent");
    case FS_FAIL_DESYNC: return PyUnicode_FromString("desync");
    default: Py_RETURN_NONE;
    }
}

static PyObject *Comm_get_rank(CommObject *self, void *c) { return PyLong_FromLong(self->comm->rank); }
static PyObject *Comm_get_world(CommObject *self, void *c)
{
    return PyLong_FromLong(self->comm->world_size);
}
static PyObject *Comm_get_backend(CommObject *self, void *c)
{
    return PyUnicode_FromString(self->comm->ops->name);
}

PyDoc_STRVAR(abort_doc,
             "abort(why) -> bool: tell the other ranks this rank stopped (their waits fail\n"
             "with `why`). False when the backend cannot (torch: they fail at its timeout).");
static PyObject *Comm_abort(CommObject *self, PyObject *args)
{
    const char *why;
    if (!PyArg_ParseTuple(args, "s", &why))
        return NULL;
    if (!self->comm->ops->abort)
        Py_RETURN_FALSE;
    self->comm->ops->abort(self->comm, why);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(capsule_doc,
             "capsule() -> this Comm's fs_comm* for Comm(kind='device', capsule=...); valid\n"
             "while this Comm lives (pass it as owner=).");
static PyObject *Comm_capsule(CommObject *self, PyObject *Py_UNUSED(a))
{
    return PyCapsule_New(self->comm, FS_COMM_CAPSULE, NULL);
}

static PyObject *Comm_get_stores_used(CommObject *self, void *c)
{
    uint64_t n[2];
    if (fs_comm_shm_stores_used(self->comm, n) < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("{sKsK}", "cached", (unsigned long long)n[0], "streamed",
                         (unsigned long long)n[1]);
}

static PyObject *Comm_get_device(CommObject *self, void *c)
{
    if (!self->dev)
        Py_RETURN_NONE;
    return PyUnicode_FromString(self->dev->name);
}

static PyObject *Comm_get_device_index(CommObject *self, void *c)
{
    if (!self->dev || self->device_index < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(self->device_index);
}

static PyMethodDef Comm_methods[] = {
    {"capsule", (PyCFunction)Comm_capsule, METH_NOARGS, capsule_doc},
    {"abort", (PyCFunction)Comm_abort, METH_VARARGS, abort_doc},
    {"all_gather", (PyCFunction)Comm_all_gather, METH_VARARGS, all_gather_doc},
    {"reduce_scatter", (PyCFunction)Comm_reduce_scatter, METH_VARARGS, reduce_scatter_doc},
    {"all_reduce", (PyCFunction)Comm_all_reduce, METH_VARARGS, all_reduce_doc},
    {"broadcast", (PyCFunction)Comm_broadcast, METH_VARARGS, broadcast_doc},
    {"barrier", (PyCFunction)Comm_barrier, METH_VARARGS, barrier_doc},
    {"all_to_all", (PyCFunction)Comm_all_to_all, METH_VARARGS, all_to_all_doc},
    {"quantized", (PyCFunction)Comm_quantized, METH_VARARGS, quantized_doc},
    {"ledger", (PyCFunction)Comm_ledger, METH_NOARGS, ledger_doc},
    {NULL},
};

static PyGetSetDef Comm_getset[] = {
    {"rank", (getter)Comm_get_rank, NULL, "this process' rank in the group", NULL},
    {"world_size", (getter)Comm_get_world, NULL, "ranks in the group", NULL},
    {"backend", (getter)Comm_get_backend, NULL, "backend name", NULL},
    {"device", (getter)Comm_get_device, NULL,
     "the device API of a kind='device' Comm ('cuda', or 'host'), else None", NULL},
    {"device_index", (getter)Comm_get_device_index, NULL,
     "which of that API's devices a kind='device' Comm's buffers are on (torch's index, as "
     "given by device_index=), else None", NULL},
    {"failure", (getter)Comm_get_failure, NULL,
     "what the last failed collective met, where the backend can tell: 'dead' (a rank's "
     "process ended), 'absent' (a live rank never came), 'desync' (the ranks are in "
     "different collectives); else None", NULL},
    {"on_stop", (getter)Comm_get_callback, (setter)Comm_set_callback,
     "on_stop(comm, why), called once when this rank stops taking part (out of memory), "
     "after the backend was aborted where it can be; None: no call", (void *)&on_stop_slot},
    {"stores_used", (getter)Comm_get_stores_used, NULL,
     "shm: {'cached': n, 'streamed': n}, how many collectives staged their bytes with each "
     "store ([Note: staging stores]); None on other backends", NULL},
    {"on_failure", (getter)Comm_get_callback, (setter)Comm_set_callback,
     "on_failure(comm, exc), called after a collective failed (exc is about to be raised); "
     "None: no call", (void *)&on_failure_slot},
    {NULL},
};

static PyType_Slot Comm_slots[] = {
    {Py_tp_new, Comm_new},
    {Py_tp_dealloc, Comm_dealloc},
    {Py_tp_methods, Comm_methods},
    {Py_tp_getset, Comm_getset},
    {Py_tp_doc, "Comm(kind, rank, world_size, *, fn=None, name=None, create=False, "
                "slot_bytes=0, timeout_s=0, staging='auto'): collective backend handle.\n"
                "kind='torch' calls fn(op, a, b, arg); kind='shm' maps segment `name` "
                "(rank 0 passes create=True) and stages with cached or streaming stores "
                "(staging: 'auto' measures which is faster, 'cached', 'streamed'); kind='device' wraps owner's backend "
                "(capsule=owner.capsule()) over device memory, with device_api (an "
                "fs_device_api capsule), stream_fn() -> the current stream, "
                "empty(numel, dtype_code) -> a device tensor (float32 staging) and "
                "device_index (which device, for the tensor checks of runtime/comm.py)."},
    {0, NULL},
};

static PyType_Spec Comm_spec = {
    "flatshard._C.Comm", sizeof(CommObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    Comm_slots,
};

int fs_comm_type_add(PyObject *module, fs_mod_state *st)
{
    return fs_add_type(module, &Comm_spec, &st->CommType);
}

/* ---------------------------------------------------------------------------
 * what the engine's callers share: a Comm as the engine sees it, a failure as an exception */

static void *glue_unlock(void) { return PyEval_SaveThread(); }
static void glue_lock(void *saved) { PyEval_RestoreThread(saved); }

fs_link fs_glue_link(CommObject *comm)
{
    fs_link l = {0};
    if (comm)
        l = (fs_link){comm->comm, &comm->ledger, comm->dev, NULL, glue_unlock, glue_lock};
    return l;
}

PyObject *fs_glue_failed(PyTypeObject *tp, fs_status s, const char *err, CommObject *comm,
                         int collective, PyObject *note)
{
    if (s == FS_ERR_HOST && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "flatshard: a torch call failed without an error");
    fs_raise(fs_state_from_type(tp), s, "%s", err);
    if (note) { /* a failed note must not hide the real error */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        PyObject *r = v ? PyObject_CallMethod(v, "add_note", "O", note) : NULL;
        Py_XDECREF(r);
        PyErr_Clear();
        PyErr_Restore(t, v, tb);
    }
    return collective ? fs_comm_failed(comm) : NULL;
}
