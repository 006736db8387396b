/* py_comm_defer.c - flatshard._C.Comm's all-gather and reduce-scatter, plain
 * or deferred, and wait_mark: for the Python layer (fully_shard on a device)
 * the protocol the units follow in C ([Note: deferred collectives] in
 * py_unit.c). Deferred on a host Comm is plain: completed, no mark. */
#include "fs_py.h"

/* [Note: deferred collectives] of py_unit.c, for the Python layer (fully_shard):
 * a mark holds the device's event after a deferred collective, and what the
 * collective still uses that the caller does not hold (the float32 staging of
 * a bfloat16/float16 reduction); both go when the mark does. */
#define MARK_CAPSULE "flatshard.device_mark"

typedef struct {
    void *event;
    const fs_device_api *dev;
    PyObject *held;
} device_mark;

static void mark_free(PyObject *cap)
{
    device_mark *mk = PyCapsule_GetPointer(cap, MARK_CAPSULE);
    if (!mk)
        return;
    if (mk->event)
        mk->dev->event_free(mk->event);
    Py_XDECREF(mk->held);
    PyMem_Free(mk);
}

/* After a deferred collective: mark what was issued (steals `held`). */
static PyObject *make_mark(CommObject *self, PyObject *held, const char *op, const char *tag)
{
    device_mark *mk = PyMem_Calloc(1, sizeof *mk);
    if (!mk) {
        Py_XDECREF(held);
        return PyErr_NoMemory();
    }
    mk->dev = self->dev;
    mk->held = held;
    fs_status s = self->dev->record(self->comm, &mk->event, self->comm->last_error,
                                    sizeof self->comm->last_error);
    PyObject *cap = s == FS_OK ? PyCapsule_New(mk, MARK_CAPSULE, mark_free) : NULL;
    if (!cap) {
        if (mk->event)
            self->dev->event_free(mk->event);
        Py_XDECREF(mk->held);
        PyMem_Free(mk);
        return s == FS_OK ? NULL : fs_comm_done(self, s, op, tag);
    }
    return cap;
}

/* A deferred collective on a device Comm: the caller's stream does not wait. */
static void defer_begin(CommObject *self, int defer)
{
    if (defer)
        self->dev->set_defer(self->comm, 1);
}

static void defer_end(CommObject *self, int defer)
{
    if (defer)
        self->dev->set_defer(self->comm, 0);
}

PyObject *fs_comm_issue_all_gather(CommObject *self, PyObject *args, int defer)
{
    unsigned long long sp, rp;
    long long n;
    int t;
    const char *tag = "";
    if (!PyArg_ParseTuple(args, "KKLi|s", &sp, &rp, &n, &t, &tag))
        return NULL;
    if (fs_comm_bind_stream(self) < 0)
        return NULL;
    defer = defer && self->dev;
    fs_status s;
    defer_begin(self, defer);
    FS_COMM_RECORD(self, s, FS_LOP_ALL_GATHER, tag, n, t,
                   fs_comm_all_gather(self->comm, (void *)sp, (void *)rp, n, t));
    defer_end(self, defer);
    if (s != FS_OK || !defer)
        return fs_comm_done(self, s, "all_gather", tag);
    return make_mark(self, NULL, "all_gather (marking it)", tag);
}

PyObject *fs_comm_issue_reduce_scatter(CommObject *self, PyObject *args, int defer)
{
    unsigned long long sp, rp;
    long long n;
    int t, avg;
    const char *tag = "";
    if (!PyArg_ParseTuple(args, "KKLip|s", &sp, &rp, &n, &t, &avg, &tag))
        return NULL;
    PyObject *ws;
    if (fs_comm_bind_stream(self) < 0 ||
        fs_comm_lend_workspace(self, t, n * self->comm->world_size, &ws) < 0)
        return NULL;
    defer = defer && self->dev;
    fs_status s;
    defer_begin(self, defer);
    FS_COMM_RECORD(self, s, FS_LOP_REDUCE_SCATTER, tag, n, t,
                   fs_comm_reduce_scatter(self->comm, (void *)sp, (void *)rp, n, t,
                                          avg ? FS_RED_AVG : FS_RED_SUM));
    defer_end(self, defer);
    if (s != FS_OK || !defer) {
        fs_comm_return_workspace(self, &ws);
        return fs_comm_done(self, s, "reduce_scatter", tag);
    }
    if (ws) /* the backend lets go of it; the mark keeps it until waited for */
        self->dev->set_workspace(self->comm, NULL, 0);
    return make_mark(self, ws, "reduce_scatter (marking it)", tag);
}

PyObject *fs_comm_wait_mark(CommObject *self, PyObject *mark)
{
    if (mark == Py_None)
        Py_RETURN_NONE;
    device_mark *mk = PyCapsule_IsValid(mark, MARK_CAPSULE)
                          ? PyCapsule_GetPointer(mark, MARK_CAPSULE) : NULL;
    if (!self->dev || !mk || mk->dev != self->dev)
        return PyErr_Format(PyExc_TypeError, "wait_mark: mark must be what this device Comm's "
                            "all_gather_deferred or reduce_scatter_deferred returned");
    if (fs_comm_bind_stream(self) < 0)
        return NULL;
    fs_status s = self->dev->wait(mk->event, self->stream, self->comm->last_error,
                                  sizeof self->comm->last_error);
    return fs_comm_done(self, s, "waiting for a deferred collective", "");
}
