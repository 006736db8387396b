/* py_snapshot.c - flatshard._C.Snapshot: one rank's snapshot segment
 * (engine/snapshot.h) as a Python object, owned by flatshard.Snapshots
 * (python/flatshard/snapshots/). Translation only: it parses the parts
 * (pointers and sizes the host keeps alive until wait()) and turns a status
 * into an exception; the layout, the slots, the copy thread and the checks
 * are the engine's. */
#include "fs_py.h"

#include "snapshot.h"

typedef struct {
    PyObject_HEAD
    fs_snapshot *s;
} SnapObject;

static void *snap_unlock(void) { return PyEval_SaveThread(); }
static void snap_lock(void *saved) { PyEval_RestoreThread(saved); }

static PyObject *Snap_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"name", "create", NULL};
    const char *name;
    int create = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|p:Snapshot", kwlist, &name, &create))
        return NULL;
    SnapObject *self = (SnapObject *)tp->tp_alloc(tp, 0);
    if (!self)
        return NULL;
    char err[512] = "";
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_snapshot_open(name, create, &self->s, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (s != FS_OK) {
        Py_DECREF(self);
        if (s == FS_ERR_BACKEND && !create)
            return PyErr_Format(PyExc_FileNotFoundError, "Snapshot: %s", err);
        return fs_raise(fs_state_from_type(tp), s, "Snapshot: %s", err);
    }
    return (PyObject *)self;
}

static void snap_close(SnapObject *self)
{
    if (self->s) {
        Py_BEGIN_ALLOW_THREADS
        fs_snapshot_close(self->s);
        Py_END_ALLOW_THREADS
        self->s = NULL;
    }
}

static void Snap_dealloc(SnapObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    snap_close(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int check_open(SnapObject *self, const char *op)
{
    if (self->s)
        return 0;
    PyErr_Format(PyExc_ValueError, "Snapshot.%s: the snapshot is closed", op);
    return -1;
}

static int check_slot(int slot, const char *op)
{
    if (slot == 0 || slot == 1)
        return 0;
    PyErr_Format(PyExc_ValueError, "Snapshot.%s: slot=%d, expected 0 or 1", op, slot);
    return -1;
}

PyDoc_STRVAR(write_doc, "write(step, parts, *, budget=0, stop_after=-1)\n"
             "Copy parts, a sequence of (data_ptr, nbytes), as `step` into the slot that does\n"
             "not hold the newest complete step, on the snapshot's thread (waiting first for a\n"
             "copy in flight). The bytes must stay unchanged until wait(). budget > 0: refuse\n"
             "(ValueError) a segment larger than that. stop_after >= 0 is for tests: the copy\n"
             "stops after that many bytes, leaving the slot incomplete.");
static PyObject *Snap_write(SnapObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"step", "parts", "budget", "stop_after", NULL};
    long long step, budget = 0, stop_after = -1;
    PyObject *parts;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LO|$LL:write", kwlist, &step, &parts, &budget,
                                     &stop_after) || check_open(self, "write") < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(parts, "Snapshot.write: parts must be a sequence");
    if (!seq)
        return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    fs_snap_part *ps = PyMem_Calloc(n ? (size_t)n : 1, sizeof *ps);
    PyObject *ret = NULL;
    if (!ps) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long p;
        long long b;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i),
                              "KL;Snapshot.write: each part is (data_ptr, nbytes)", &p, &b))
            goto done;
        ps[i] = (fs_snap_part){(const void *)(uintptr_t)p, b};
    }
    char err[512] = "";
    fs_status s = fs_snapshot_write(self->s, step, ps, n, budget, stop_after, snap_unlock,
                                    snap_lock, err, sizeof err);
    if (s == FS_OK)
        ret = Py_NewRef(Py_None);
    else if (s == FS_ERR_INVALID_ARG)
        PyErr_Format(PyExc_ValueError, "Snapshot.write: %s", err);
    else
        fs_raise(fs_state_from_type(Py_TYPE(self)), s, "Snapshot.write: %s", err);
done:
    PyMem_Free(ps);
    Py_DECREF(seq);
    return ret;
}

PyDoc_STRVAR(wait_doc, "wait()\nUntil the copy in flight has finished (without the GIL).");
static PyObject *Snap_wait(SnapObject *self, PyObject *noargs)
{
    if (check_open(self, "wait") < 0)
        return NULL;
    fs_snapshot_wait(self->s, snap_unlock, snap_lock);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(busy_doc, "busy() -> bool: a copy is in flight.");
static PyObject *Snap_busy(SnapObject *self, PyObject *noargs)
{
    if (check_open(self, "busy") < 0)
        return NULL;
    return PyBool_FromLong(fs_snapshot_busy(self->s));
}

PyDoc_STRVAR(drop_doc, "drop(slot)\nThe slot no longer trusted (a step to compute again).");
static PyObject *Snap_drop(SnapObject *self, PyObject *args)
{
    int slot;
    if (!PyArg_ParseTuple(args, "i:drop", &slot) || check_open(self, "drop") < 0 ||
        check_slot(slot, "drop") < 0)
        return NULL;
    fs_snapshot_drop(self->s, slot, snap_unlock, snap_lock);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(slots_doc, "slots() -> [(complete, step, nparts, capacity_bytes)] * 2");
static PyObject *Snap_slots(SnapObject *self, PyObject *noargs)
{
    if (check_open(self, "slots") < 0)
        return NULL;
    fs_snap_slot_info a, b;
    fs_snapshot_slot_info(self->s, 0, &a);
    fs_snapshot_slot_info(self->s, 1, &b);
    return Py_BuildValue("[(NLLL)(NLLL)]", PyBool_FromLong(a.complete), (long long)a.step,
                         (long long)a.nparts, (long long)a.capacity_bytes,
                         PyBool_FromLong(b.complete), (long long)b.step, (long long)b.nparts,
                         (long long)b.capacity_bytes);
}

PyDoc_STRVAR(segment_bytes_doc, "segment_bytes() -> int: bytes of the segment on the host.");
static PyObject *Snap_segment_bytes(SnapObject *self, PyObject *noargs)
{
    if (check_open(self, "segment_bytes") < 0)
        return NULL;
    return PyLong_FromLongLong(fs_snapshot_segment_bytes(self->s));
}

PyDoc_STRVAR(verify_doc, "verify(slot) -> int\n"
             "-1: the slot is complete and every part's CRC-32C holds; -2: not complete, or its\n"
             "table is damaged; k >= 0: part k is damaged.");
static PyObject *Snap_verify(SnapObject *self, PyObject *args)
{
    int slot;
    if (!PyArg_ParseTuple(args, "i:verify", &slot) || check_open(self, "verify") < 0 ||
        check_slot(slot, "verify") < 0)
        return NULL;
    int64_t bad;
    Py_BEGIN_ALLOW_THREADS
    fs_snapshot_verify(self->s, slot, &bad);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

PyDoc_STRVAR(part_bytes_doc, "part_bytes(slot, part) -> int: -1 when not readable.");
static PyObject *Snap_part_bytes(SnapObject *self, PyObject *args)
{
    int slot;
    long long part;
    if (!PyArg_ParseTuple(args, "iL:part_bytes", &slot, &part) ||
        check_open(self, "part_bytes") < 0 || check_slot(slot, "part_bytes") < 0)
        return NULL;
    return PyLong_FromLongLong(fs_snapshot_part_bytes(self->s, slot, part));
}

PyDoc_STRVAR(read_doc, "read(slot, part, data_ptr, nbytes)\n"
             "Copy part `part` of a complete slot to data_ptr; nbytes must be its size.");
static PyObject *Snap_read(SnapObject *self, PyObject *args)
{
    int slot;
    long long part, bytes;
    unsigned long long dst;
    if (!PyArg_ParseTuple(args, "iLKL:read", &slot, &part, &dst, &bytes) ||
        check_open(self, "read") < 0 || check_slot(slot, "read") < 0)
        return NULL;
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_snapshot_read(self->s, slot, part, (void *)(uintptr_t)dst, bytes);
    Py_END_ALLOW_THREADS
    if (s != FS_OK)
        return PyErr_Format(PyExc_ValueError, "Snapshot.read: slot %d part %lld of %lld bytes: "
                            "the slot is not complete, or the part has another size (%lld)",
                            slot, part, bytes,
                            (long long)fs_snapshot_part_bytes(self->s, slot, part));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(close_doc, "close()\n"
             "The copy in flight finished, the thread stopped, the segment unmapped (it stays\n"
             "on the host: snapshot_unlink removes it). Idempotent.");
static PyObject *Snap_close(SnapObject *self, PyObject *noargs)
{
    snap_close(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(unlink_doc, "snapshot_unlink(name)\nRemove snapshot segment `name` from the host.");
static PyObject *snapshot_unlink(PyObject *m, PyObject *args)
{
    const char *name;
    if (!PyArg_ParseTuple(args, "s:snapshot_unlink", &name))
        return NULL;
    char err[512] = "";
    if (fs_snapshot_unlink(name, err, sizeof err) != FS_OK)
        return PyErr_Format(PyExc_FileNotFoundError, "snapshot_unlink: %s", err);
    Py_RETURN_NONE;
}

static PyMethodDef Snap_methods[] = {
    {"write", (PyCFunction)(void (*)(void))Snap_write, METH_VARARGS | METH_KEYWORDS, write_doc},
    {"wait", (PyCFunction)Snap_wait, METH_NOARGS, wait_doc},
    {"busy", (PyCFunction)Snap_busy, METH_NOARGS, busy_doc},
    {"drop", (PyCFunction)Snap_drop, METH_VARARGS, drop_doc},
    {"slots", (PyCFunction)Snap_slots, METH_NOARGS, slots_doc},
    {"segment_bytes", (PyCFunction)Snap_segment_bytes, METH_NOARGS, segment_bytes_doc},
    {"verify", (PyCFunction)Snap_verify, METH_VARARGS, verify_doc},
    {"part_bytes", (PyCFunction)Snap_part_bytes, METH_VARARGS, part_bytes_doc},
    {"read", (PyCFunction)Snap_read, METH_VARARGS, read_doc},
    {"close", (PyCFunction)Snap_close, METH_NOARGS, close_doc},
    {NULL},
};

static PyType_Slot Snap_slots_spec[] = {
    {Py_tp_new, Snap_new},
    {Py_tp_dealloc, Snap_dealloc},
    {Py_tp_methods, Snap_methods},
    {Py_tp_doc, "Snapshot(name, create=True): one rank's double-buffered snapshot segment in "
                "shared memory (engine/snapshot.h)."},
    {0, NULL},
};

static PyType_Spec Snap_spec = {
    "flatshard._C.Snapshot", sizeof(SnapObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, Snap_slots_spec,
};

static PyMethodDef functions[] = {
    {"snapshot_unlink", snapshot_unlink, METH_VARARGS, unlink_doc},
    {NULL},
};

int fs_snapshot_type_add(PyObject *module, fs_mod_state *st)
{
    (void)st;
    if (fs_add_type(module, &Snap_spec, NULL) < 0)
        return -1;
    return PyModule_AddFunctions(module, functions);
}
