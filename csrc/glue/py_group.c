/* py_group.c - what flatshard._C.Unit (py_unit.c) and flatshard._C.ShardGroup
 * (py_shard_group.c) share: the constructor's checks and the head of both
 * objects (FS_GROUP_OBJECT_HEAD in group_object.h), binding their Comms' streams
 * for an engine call, the along and bucket arguments, an engine failure as
 * an exception, and the getters over the engine's group core
 * (engine/group.h). Not a type of its own. */
#include "py_group.h"

#include "py_bucket.h"

#include <stdio.h>

#include <string.h>

/* "Unit" for flatshard._C.Unit */
static const char *short_name(PyTypeObject *tp)
{
    const char *dot = strrchr(tp->tp_name, '.');
    return dot ? dot + 1 : tp->tp_name;
}

int fs_glue_group_check(PyTypeObject *tp, const char *type, PyObject *comm, PyObject *replicate,
                        PyObject *empty)
{
    PyTypeObject *ct = (PyTypeObject *)fs_state_from_type(tp)->CommType;
    if (!PyObject_TypeCheck(comm, ct)) {
        PyErr_Format(PyExc_TypeError, "%s: comm must be a flatshard._C.Comm", type);
        return -1;
    }
    const fs_device_api *dev = ((CommObject *)comm)->dev;
    if (replicate != Py_None &&
        (!PyObject_TypeCheck(replicate, ct) || ((CommObject *)replicate)->dev != dev)) {
        PyErr_Format(PyExc_TypeError, "%s: replicate must be a flatshard._C.Comm on the same "
                     "device as comm", type);
        return -1;
    }
    if ((dev != NULL) != (empty != Py_None) || (empty != Py_None && !PyCallable_Check(empty))) {
        PyErr_Format(PyExc_TypeError, "%s: a Comm bound to a device needs "
                     "empty=callable(numel, dtype_code) -> tensor, and only such a Comm", type);
        return -1;
    }
    return 0;
}

void fs_glue_group_init(GroupObject *self, fs_group_core *core, fs_glue_done done,
                        PyObject *name, PyObject *comm, PyObject *replicate, PyObject *empty)
{
    self->core = core;
    self->done = done;
    self->name = Py_NewRef(name);
    self->comm = (CommObject *)Py_NewRef(comm);
    self->replicate = replicate != Py_None ? (CommObject *)Py_NewRef(replicate) : NULL;
    self->empty = empty != Py_None ? Py_NewRef(empty) : NULL;
}

void fs_glue_group_clear(GroupObject *self)
{
    Py_CLEAR(self->empty);
    Py_CLEAR(self->name);
    Py_CLEAR(self->comm);
    Py_CLEAR(self->replicate);
}

int fs_glue_group_traverse(GroupObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->name);
    Py_VISIT(self->comm);
    Py_VISIT(self->replicate);
    Py_VISIT(self->empty);
    return 0;
}

int fs_glue_group_bind(GroupObject *self)
{
    if (!self->ready) { /* cleared by the collector: its engine object is gone */
        PyErr_SetString(PyExc_RuntimeError, "flatshard: this engine group was freed");
        return -1;
    }
    CommObject *r = self->replicate;
    if (fs_comm_bind_stream(self->comm) < 0 || (r && fs_comm_bind_stream(r) < 0))
        return -1;
    fs_group_set_streams(self->core, self->comm->stream, r ? r->stream : NULL);
    return 0;
}

/* [Note: out of memory on one rank] A rank whose allocation failed stops
 * taking part in the group's collectives, and its peers would wait for it
 * in their next one until the timeout. So it tells them, for every kind of
 * group (FSDP1 units, fully_shard groups), once per Comm, with a message
 * naming the rank, the operation and the group:
 *   - the Comm is aborted: the peers' waits fail at once with the message
 *     (shm; the torch backend cannot abort);
 *   - the message is left in the process group's store (the Comm's
 *     on_stop, runtime/diagnostics.py), where a peer's failure
 *     note reads it when its wait fails (the torch backend: at the group's
 *     timeout).
 * Here for the engine's failures, and through tell_out_of_memory() for an
 * allocation failure that Python sees (torch's, for fully_shard's first
 * gather, fsdp2/param.py; and any the FSDP1 wrapper turns into its
 * OutOfMemoryError, fsdp/unit.py, a no-op where the engine told them first). */
static void tell_peers(GroupObject *self, const char *what, const char *err)
{
    CommObject *co = self->comm;
    char why[512];
    if (co->stopped ||
        !fs_group_abort_out_of_memory(self->core, co->comm, co->dev != NULL, what, err, why,
                                      sizeof why))
        return;
    co->stopped = 1;
    if (co->on_stop) {
        /* The caller's exception (the allocation's) is what the user sees: a
         * store that cannot take the note (gone with a dead peer) must not
         * replace it. */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyObject *r = PyObject_CallFunction(co->on_stop, "Os", (PyObject *)co, why);
        if (!r)
            PyErr_Clear();
        Py_XDECREF(r);
        PyErr_Restore(t, v, tb);
    }
}

/* An engine failure that is an allocation's: its own status, or a host
 * call's MemoryError (the pool's storage); the exception stays set. */
static void tell_if_out_of_memory(GroupObject *self, fs_status s)
{
    const char *what = self->core->err_what ? self->core->err_what : "an engine call";
    if (s == FS_ERR_NO_MEMORY) {
        tell_peers(self, what, self->core->err);
        return;
    }
    if (s != FS_ERR_HOST || !PyErr_Occurred() || !PyErr_ExceptionMatches(PyExc_MemoryError))
        return;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyObject *text = v ? PyObject_Str(v) : NULL;
    const char *err = text ? PyUnicode_AsUTF8(text) : NULL;
    if (!err)
        PyErr_Clear();
    tell_peers(self, what, err ? err : "MemoryError");
    Py_XDECREF(text);
    PyErr_Restore(t, v, tb);
}

PyObject *fs_glue_group_tell_out_of_memory(PyObject *self, PyObject *args)
{
    const char *what, *err;
    if (!PyArg_ParseTuple(args, "ss:tell_out_of_memory", &what, &err))
        return NULL;
    tell_peers(FS_GROUP(self), what, err);
    Py_RETURN_NONE;
}

PyObject *fs_glue_group_failed(GroupObject *self, fs_status s, int collective, PyObject *note)
{
    tell_if_out_of_memory(self, s);
    PyObject *r = fs_glue_failed(Py_TYPE(self), s, self->core->err, self->comm, collective, note);
    Py_XDECREF(note);
    return r;
}

Py_ssize_t fs_glue_group_along(GroupObject *self, PyObject *along, const char *op)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (!PyTuple_Check(along)) {
        PyErr_Format(PyExc_TypeError, "%s: along must be a tuple of %ss", op, short_name(tp));
        return -1;
    }
    if (self->comm->dev) {
        PyErr_Format(PyExc_ValueError, "%s: along is for host Comms (a device's gathers are "
                     "not coalesced)", op);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(along); i++) {
        PyObject *o = PyTuple_GET_ITEM(along, i);
        if (Py_TYPE(o) != tp || FS_GROUP(o)->comm != self->comm) {
            PyErr_Format(PyExc_TypeError, "%s: along[%zd] is not a %s on the same Comm", op, i,
                         short_name(tp));
            return -1;
        }
    }
    return PyTuple_GET_SIZE(along);
}

int fs_glue_group_bucket_arg(GroupObject *self, PyObject *o, int defer, const char *op,
                             fs_reduce_bucket **out)
{
    *out = NULL;
    if (o == Py_None)
        return 0;
    if (!(*out = fs_glue_bucket(Py_TYPE(self), o)))
        return -1;
    if (!self->comm->dev && !defer)
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: bucket is for host Comms, without defer", op);
    return -1;
}

PyObject *fs_glue_group_flush_bucket(PyObject *self, PyObject *args)
{
    GroupObject *g = FS_GROUP(self);
    PyObject *owners;
    fs_reduce_bucket *b = fs_glue_bucket_args(g, args, "flush_bucket", &owners);
    if (!b || fs_glue_group_bind(g) < 0)
        return NULL;
    int failed;
    fs_status s = fs_group_flush_bucket(b, g->core, &failed);
    GroupObject *by = failed < 0 ? g : FS_GROUP(PyTuple_GET_ITEM(owners, failed));
    return by->done(by, s);
}

PyObject *fs_glue_group_cancel_bucket(PyObject *self, PyObject *args)
{
    PyObject *owners;
    fs_reduce_bucket *b = fs_glue_bucket_args(FS_GROUP(self), args, "cancel_bucket", &owners);
    if (!b)
        return NULL;
    fs_group_cancel_bucket(b);
    Py_RETURN_NONE;
}

int fs_glue_parse_quant(PyObject *args, fs_comm_quant *q)
{
    int wb, gb;
    long long block;
    if (!PyArg_ParseTuple(args, "iiL", &wb, &gb, &block))
        return -1;
    *q = (fs_comm_quant){wb, gb, block};
    return 0;
}

PyObject *fs_glue_group_get_name(GroupObject *self, void *closure)
{
    return Py_NewRef(self->name);
}

PyObject *fs_glue_group_get_comm(GroupObject *self, void *closure)
{
    return Py_NewRef((PyObject *)self->comm);
}

PyObject *fs_glue_group_get_flag(GroupObject *self, void *closure)
{
    return PyBool_FromLong(*(const int *)((const char *)self->core + (size_t)closure));
}

PyObject *fs_glue_group_get_counts(GroupObject *self, void *closure)
{
    const fs_group_core *c = self->core;
    unsigned long long sg, sr;
    fs_group_sent_bytes(c, &sg, &sr); /* [Note: bytes sent] in engine.h */
    return Py_BuildValue("{sKsKsKsKsKsKsK}", "all_gather", c->n_all_gather, "reduce", c->n_reduce,
                         "deferred_gather", c->n_deferred_gather, "deferred_reduce",
                         c->n_deferred_reduce, "post_gather", c->n_post_gather,
                         "sent_gather_bytes", sg, "sent_reduce_bytes", sr);
}
