/* py_comm.c - flatshard._C.Comm: a collective backend handle for Python.
 *
 * Python holds one Comm per process group and passes it to every Unit.
 * Buffers are given as (data_ptr, numel) of contiguous host tensors; the
 * facade in flatshard/comm.py checks tensors before calling. */
#include "fs_py.h"

static PyObject *Comm_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"kind", "rank", "world_size", "fn", "name", "create", "slot_bytes",
                             "timeout_s", NULL};
    const char *kind, *name = NULL;
    PyObject *fn = NULL;
    int rank, world, create = 0;
    Py_ssize_t slot_bytes = 0;
    double timeout_s = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sii|$Ozpnd", kwlist, &kind, &rank, &world, &fn,
                                     &name, &create, &slot_bytes, &timeout_s))
        return NULL;
    fs_mod_state *st = fs_state_from_type(tp);
    CommObject *self = (CommObject *)tp->tp_alloc(tp, 0);
    if (!self)
        return NULL;
    fs_status s;
    char err[512] = "";
    if (strcmp(kind, "torch") == 0 && fn) {
        s = fs_comm_torch_create(fn, rank, world, &self->comm);
    } else if (strcmp(kind, "shm") == 0 && name) {
        Py_BEGIN_ALLOW_THREADS
        s = fs_comm_shm_create(name, rank, world, (size_t)slot_bytes, timeout_s, create,
                               &self->comm, err, sizeof err);
        Py_END_ALLOW_THREADS
    } else {
        Py_DECREF(self);
        return PyErr_Format(PyExc_ValueError, "Comm: kind must be 'torch' (with fn) or 'shm' "
                            "(with name), got %s", kind);
    }
    if (s != FS_OK) {
        Py_DECREF(self);
        return fs_raise(st, s, "Comm(kind='%s', rank=%d, world_size=%d): %s", kind, rank, world,
                        err);
    }
    return (PyObject *)self;
}

static void Comm_dealloc(CommObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    fs_comm_destroy(self->comm);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *done(CommObject *self, fs_status s, const char *op)
{
    if (s != FS_OK)
        return fs_raise(fs_state_from_type(Py_TYPE(self)), s, "%s on backend %s: %s", op,
                        self->comm->ops->name, self->comm->last_error);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(all_gather_doc, "all_gather(send_ptr, recv_ptr, count, dtype)\n"
                             "recv holds world_size*count; rank r's send lands at recv + r*count.");
static PyObject *Comm_all_gather(CommObject *self, PyObject *args)
{
    unsigned long long sp, rp;
    long long n;
    int t;
    if (!PyArg_ParseTuple(args, "KKLi", &sp, &rp, &n, &t))
        return NULL;
    fs_status s;
    FS_COMM_CALL(self, s, fs_comm_all_gather(self->comm, (void *)sp, (void *)rp, n, t));
    return done(self, s, "all_gather");
}

PyDoc_STRVAR(reduce_scatter_doc, "reduce_scatter(send_ptr, recv_ptr, recv_count, dtype, average)");
static PyObject *Comm_reduce_scatter(CommObject *self, PyObject *args)
{
    unsigned long long sp, rp;
    long long n;
    int t, avg;
    if (!PyArg_ParseTuple(args, "KKLip", &sp, &rp, &n, &t, &avg))
        return NULL;
    fs_status s;
    FS_COMM_CALL(self, s, fs_comm_reduce_scatter(self->comm, (void *)sp, (void *)rp, n, t,
                                                 avg ? FS_RED_AVG : FS_RED_SUM));
    return done(self, s, "reduce_scatter");
}

PyDoc_STRVAR(all_reduce_doc, "all_reduce(ptr, count, dtype, average)");
static PyObject *Comm_all_reduce(CommObject *self, PyObject *args)
{
    unsigned long long p;
    long long n;
    int t, avg;
    if (!PyArg_ParseTuple(args, "KLip", &p, &n, &t, &avg))
        return NULL;
    fs_status s;
    FS_COMM_CALL(self, s,
                 fs_comm_all_reduce(self->comm, (void *)p, n, t, avg ? FS_RED_AVG : FS_RED_SUM));
    return done(self, s, "all_reduce");
}

PyDoc_STRVAR(broadcast_doc, "broadcast(ptr, count, dtype, root): root is a rank of this group.");
static PyObject *Comm_broadcast(CommObject *self, PyObject *args)
{
    unsigned long long p;
    long long n;
    int t, root;
    if (!PyArg_ParseTuple(args, "KLii", &p, &n, &t, &root))
        return NULL;
    fs_status s;
    FS_COMM_CALL(self, s, fs_comm_broadcast(self->comm, (void *)p, n, t, root));
    return done(self, s, "broadcast");
}

static PyObject *Comm_barrier(CommObject *self, PyObject *Py_UNUSED(a))
{
    fs_status s;
    FS_COMM_CALL(self, s, fs_comm_barrier(self->comm));
    return done(self, s, "barrier");
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

static PyMethodDef Comm_methods[] = {
    {"all_gather", (PyCFunction)Comm_all_gather, METH_VARARGS, all_gather_doc},
    {"reduce_scatter", (PyCFunction)Comm_reduce_scatter, METH_VARARGS, reduce_scatter_doc},
    {"all_reduce", (PyCFunction)Comm_all_reduce, METH_VARARGS, all_reduce_doc},
    {"broadcast", (PyCFunction)Comm_broadcast, METH_VARARGS, broadcast_doc},
    {"barrier", (PyCFunction)Comm_barrier, METH_NOARGS, "barrier()"},
    {NULL},
};

static PyGetSetDef Comm_getset[] = {
    {"rank", (getter)Comm_get_rank, NULL, "this process' rank in the group", NULL},
    {"world_size", (getter)Comm_get_world, NULL, "ranks in the group", NULL},
    {"backend", (getter)Comm_get_backend, NULL, "backend name", NULL},
    {NULL},
};

static PyType_Slot Comm_slots[] = {
    {Py_tp_new, Comm_new},
    {Py_tp_dealloc, Comm_dealloc},
    {Py_tp_methods, Comm_methods},
    {Py_tp_getset, Comm_getset},
    {Py_tp_doc, "Comm(kind, rank, world_size, *, fn=None, name=None, create=False, "
                "slot_bytes=0, timeout_s=0): collective backend handle.\n"
                "kind='torch' calls fn(op, a, b, arg); kind='shm' maps segment `name` "
                "(rank 0 passes create=True)."},
    {0, NULL},
};

static PyType_Spec Comm_spec = {
    "flatshard._C.Comm", sizeof(CommObject), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    Comm_slots,
};

int fs_comm_type_add(PyObject *module, fs_mod_state *st)
{
    st->CommType = PyType_FromModuleAndSpec(module, &Comm_spec, NULL);
    if (!st->CommType)
        return -1;
    return PyModule_AddObjectRef(module, "Comm", st->CommType);
}
