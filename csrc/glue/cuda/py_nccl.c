/* py_nccl.c - flatshard._C_cuda.NcclComm: an NCCL communicator of the NCCL
 * backend (cuda/comm_nccl.c) for Python, with what only NCCL has: the
 * collective set-up from a unique id, NCCL groups, the bounded wait, the
 * communicator's stream, close. It issues no collective itself: its
 * capsule() is wrapped by flatshard._C.Comm(kind='device') (glue/py_comm.c),
 * whose methods and the engine's run every collective (argument parsing,
 * the caller's stream, float32 staging, the ledger, the GIL, the error). */
#include "py_cuda.h"

#define state_of_type fs_cuda_state_of_type

typedef struct {
    PyObject_HEAD
    fs_comm *comm;
} NcclCommObject;

static PyObject *NcclComm_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"rank", "world_size", "unique_id", "device", "timeout_s", NULL};
    int rank, world, device;
    Py_buffer id;
    double timeout_s = 300.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiy*i|d", kwlist, &rank, &world, &id, &device,
                                     &timeout_s))
        return NULL;
    /* copied before NCCL's join releases the GIL (a bytearray could change) */
    unsigned char raw[128];
    const Py_ssize_t id_len = id.len;
    if (id_len == 128)
        memcpy(raw, id.buf, sizeof raw);
    PyBuffer_Release(&id);
    if (id_len != 128)
        return PyErr_Format(PyExc_ValueError, "NcclComm: unique_id must be 128 bytes, got %zd",
                            id_len);
    NcclCommObject *self = (NcclCommObject *)tp->tp_alloc(tp, 0);
    if (!self)
        return NULL;
    char err[512] = "";
    fs_status s;
    Py_BEGIN_ALLOW_THREADS /* blocks until every rank has joined */
    s = fs_comm_nccl_create(raw, rank, world, device, timeout_s, &self->comm, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (s == FS_OK)
        return (PyObject *)self;
    if (s == FS_ERR_NO_MEMORY)
        PyErr_NoMemory();
    else
        PyErr_Format(state_of_type(tp)->NcclError, "flatshard NCCL init (rank %d of %d, "
                     "device %d): %s", rank, world, device, err);
    Py_DECREF(self);
    return NULL;
}

static void NcclComm_dealloc(NcclCommObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    /* At interpreter exit the CUDA runtime may already be torn down: leave
     * the communicator to the process' end rather than call into it. */
    if (self->comm && !Py_IsFinalizing())
        fs_comm_destroy(self->comm);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *done(NcclCommObject *self, fs_status s, const char *op)
{
    if (s == FS_OK)
        Py_RETURN_NONE;
    if (s == FS_ERR_NO_MEMORY)
        return PyErr_NoMemory();
    return PyErr_Format(state_of_type(Py_TYPE(self))->NcclError,
                        "flatshard %s on backend nccl (rank %d of %d): %s", op, self->comm->rank,
                        self->comm->world_size, self->comm->last_error);
}

PyDoc_STRVAR(wait_doc, "wait(timeout_s): block until every collective issued so far finished;\n"
                       "on timeout or an asynchronous NCCL error, abort the comm and raise.");
static PyObject *NcclComm_wait(NcclCommObject *self, PyObject *args)
{
    double timeout_s;
    if (!PyArg_ParseTuple(args, "d", &timeout_s))
        return NULL;
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_nccl_wait(self->comm, timeout_s);
    Py_END_ALLOW_THREADS
    return done(self, s, "wait");
}

PyDoc_STRVAR(group_start_doc,
             "group_start(*, stream=0): open an NCCL group ordered after `stream` (the caller's,\n"
             "an int handle); the collectives issued until group_end() launch as one.");
static PyObject *NcclComm_group_start(NcclCommObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"stream", NULL};
    unsigned long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$K", kwlist, &stream))
        return NULL;
    fs_nccl_set_caller_stream(self->comm, (cudaStream_t)stream);
    fs_status s;
    Py_BEGIN_ALLOW_THREADS /* may wait for peers while NCCL connects */
    s = fs_nccl_group_start(self->comm);
    Py_END_ALLOW_THREADS
    return done(self, s, "group_start");
}

static PyObject *NcclComm_group_end(NcclCommObject *self, PyObject *Py_UNUSED(a))
{
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_nccl_group_end(self->comm);
    Py_END_ALLOW_THREADS
    return done(self, s, "group_end");
}

static PyObject *NcclComm_capsule(NcclCommObject *self, PyObject *Py_UNUSED(a))
{
    return PyCapsule_New(self->comm, FS_COMM_CAPSULE, NULL);
}

static PyObject *NcclComm_close(NcclCommObject *self, PyObject *Py_UNUSED(a))
{
    Py_BEGIN_ALLOW_THREADS
    fs_nccl_close(self->comm);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *NcclComm_get_rank(NcclCommObject *self, void *c)
{
    return PyLong_FromLong(self->comm->rank);
}
static PyObject *NcclComm_get_world(NcclCommObject *self, void *c)
{
    return PyLong_FromLong(self->comm->world_size);
}
static PyObject *NcclComm_get_stream(NcclCommObject *self, void *c)
{
    return PyLong_FromVoidPtr(fs_nccl_stream(self->comm));
}

static PyMethodDef NcclComm_methods[] = {
    {"wait", (PyCFunction)NcclComm_wait, METH_VARARGS, wait_doc},
    {"group_start", (PyCFunction)(void (*)(void))NcclComm_group_start,
     METH_VARARGS | METH_KEYWORDS, group_start_doc},
    {"group_end", (PyCFunction)NcclComm_group_end, METH_NOARGS,
     "group_end(): launch the group; the opening stream waits for it"},
    {"capsule", (PyCFunction)NcclComm_capsule, METH_NOARGS,
     "capsule() -> the fs_comm* (comm.h) for flatshard._C.Comm(kind='device', capsule=...,\n"
     "owner=this comm), which issues its collectives; valid while this object lives"},
    {"close", (PyCFunction)NcclComm_close, METH_NOARGS,
     "close(): destroy the communicator (aborting it if work does not finish in time);\n"
     "every later call, here or through a Comm over it, raises that it is closed"},
    {NULL},
};

static PyGetSetDef NcclComm_getset[] = {
    {"rank", (getter)NcclComm_get_rank, NULL, "this process' rank in the group", NULL},
    {"world_size", (getter)NcclComm_get_world, NULL, "ranks in the group", NULL},
    {"stream", (getter)NcclComm_get_stream, NULL,
     "the comm's own stream (int handle; 0 once closed)", NULL},
    {NULL},
};

static PyType_Slot NcclComm_slots[] = {
    {Py_tp_new, NcclComm_new},
    {Py_tp_dealloc, NcclComm_dealloc},
    {Py_tp_methods, NcclComm_methods},
    {Py_tp_getset, NcclComm_getset},
    {Py_tp_doc, "NcclComm(rank, world_size, unique_id, device, timeout_s=300): an NCCL "
                "communicator (blocking until all ranks joined). Its collectives are "
                "flatshard._C.Comm(kind='device', capsule=comm.capsule(), owner=comm, ...)'s."},
    {0, NULL},
};

static PyType_Spec NcclComm_spec = {
    "flatshard._C_cuda.NcclComm", sizeof(NcclCommObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, NcclComm_slots,
};

int fs_nccl_type_add(PyObject *module, cuda_state *st)
{
    st->NcclCommType = PyType_FromModuleAndSpec(module, &NcclComm_spec, NULL);
    return st->NcclCommType ? PyModule_AddObjectRef(module, "NcclComm", st->NcclCommType) : -1;
}
