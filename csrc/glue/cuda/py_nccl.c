/* py_nccl.c - flatshard._C_cuda.NcclComm: the NCCL backend (cuda/comm_nccl.c)
 * for Python, with the same collectives as flatshard._C.Comm over device
 * pointers plus a `stream` argument (see fs_cuda.h for the ordering). */
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

static int live(NcclCommObject *self)
{
    if (self->comm)
        return 0;
    PyErr_SetString(state_of_type(Py_TYPE(self))->NcclError, "flatshard NCCL: comm is closed");
    return -1;
}

static PyObject *done(NcclCommObject *self, fs_status s, const char *op, const char *tag)
{
    if (s == FS_OK)
        Py_RETURN_NONE;
    if (s == FS_ERR_NO_MEMORY)
        return PyErr_NoMemory();
    return PyErr_Format(state_of_type(Py_TYPE(self))->NcclError,
                        "flatshard %s%s%s%s on backend nccl (rank %d of %d): %s", op,
                        *tag ? " for '" : "", tag, *tag ? "'" : "", self->comm->rank,
                        self->comm->world_size, self->comm->last_error);
}

/* Run a collective without the GIL (enqueueing can wait for peers while
 * NCCL connects on first use), ordered against `stream`. */
#define NCCL_CALL(self, s, stream, tag, expr)                            \
    do {                                                                 \
        fs_nccl_set_caller_stream((self)->comm, (cudaStream_t)(stream)); \
        (self)->comm->what = *(tag) ? (tag) : NULL;                      \
        Py_BEGIN_ALLOW_THREADS s = (expr);                               \
        Py_END_ALLOW_THREADS                                             \
        (self)->comm->what = NULL;                                       \
    } while (0)

#define STREAM_DOC "\n`stream`: the caller's stream (int handle); the collective runs on the\n" \
                   "comm's own stream between two events. `tag`: what it is for, in errors."

PyDoc_STRVAR(all_gather_doc, "all_gather(send, recv, count, dtype, tag='', *, stream=0)"
                             STREAM_DOC);
static PyObject *NcclComm_all_gather(NcclCommObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"send", "recv", "count", "dtype", "tag", "stream", NULL};
    unsigned long long sp, rp, stream = 0;
    long long n;
    int t;
    const char *tag = "";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKLi|s$K", kwlist, &sp, &rp, &n, &t, &tag,
                                     &stream) || live(self) < 0)
        return NULL;
    fs_status s;
    NCCL_CALL(self, s, stream, tag,
              fs_comm_all_gather(self->comm, (void *)sp, (void *)rp, n, t));
    return done(self, s, "all_gather", tag);
}

PyDoc_STRVAR(reduce_scatter_doc,
             "reduce_scatter(send, recv, recv_count, dtype, average, tag='', *, stream=0)\n"
             "bfloat16/float16 accumulate in float32 (needs set_workspace)." STREAM_DOC);
static PyObject *NcclComm_reduce_scatter(NcclCommObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"send", "recv", "recv_count", "dtype", "average", "tag", "stream",
                             NULL};
    unsigned long long sp, rp, stream = 0;
    long long n;
    int t, avg;
    const char *tag = "";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKLip|s$K", kwlist, &sp, &rp, &n, &t, &avg, &tag,
                                     &stream) || live(self) < 0)
        return NULL;
    fs_status s;
    NCCL_CALL(self, s, stream, tag,
              fs_comm_reduce_scatter(self->comm, (void *)sp, (void *)rp, n, t,
                                     avg ? FS_RED_AVG : FS_RED_SUM));
    return done(self, s, "reduce_scatter", tag);
}

PyDoc_STRVAR(all_reduce_doc, "all_reduce(ptr, count, dtype, average, tag='', *, stream=0)"
                             STREAM_DOC);
static PyObject *NcclComm_all_reduce(NcclCommObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"ptr", "count", "dtype", "average", "tag", "stream", NULL};
    unsigned long long p, stream = 0;
    long long n;
    int t, avg;
    const char *tag = "";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KLip|s$K", kwlist, &p, &n, &t, &avg, &tag,
                                     &stream) || live(self) < 0)
        return NULL;
    fs_status s;
    NCCL_CALL(self, s, stream, tag,
              fs_comm_all_reduce(self->comm, (void *)p, n, t, avg ? FS_RED_AVG : FS_RED_SUM));
    return done(self, s, "all_reduce", tag);
}

PyDoc_STRVAR(broadcast_doc, "broadcast(ptr, count, dtype, root, tag='', *, stream=0)" STREAM_DOC);
static PyObject *NcclComm_broadcast(NcclCommObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"ptr", "count", "dtype", "root", "tag", "stream", NULL};
    unsigned long long p, stream = 0;
    long long n;
    int t, root;
    const char *tag = "";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KLii|s$K", kwlist, &p, &n, &t, &root, &tag,
                                     &stream) || live(self) < 0)
        return NULL;
    fs_status s;
    NCCL_CALL(self, s, stream, tag, fs_comm_broadcast(self->comm, (void *)p, n, t, root));
    return done(self, s, "broadcast", tag);
}

PyDoc_STRVAR(barrier_doc, "barrier(tag='', *, stream=0): waits on the host (bounded by the "
                          "comm's timeout)." STREAM_DOC);
static PyObject *NcclComm_barrier(NcclCommObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"tag", "stream", NULL};
    unsigned long long stream = 0;
    const char *tag = "";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|s$K", kwlist, &tag, &stream) || live(self) < 0)
        return NULL;
    fs_status s;
    NCCL_CALL(self, s, stream, tag, fs_comm_barrier(self->comm));
    return done(self, s, "barrier", tag);
}

PyDoc_STRVAR(wait_doc, "wait(timeout_s): block until every collective issued so far finished;\n"
                       "on timeout or an asynchronous NCCL error, abort the comm and raise.");
static PyObject *NcclComm_wait(NcclCommObject *self, PyObject *args)
{
    double timeout_s;
    if (!PyArg_ParseTuple(args, "d", &timeout_s) || live(self) < 0)
        return NULL;
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_nccl_wait(self->comm, timeout_s);
    Py_END_ALLOW_THREADS
    return done(self, s, "wait", "");
}

static PyObject *NcclComm_group_start(NcclCommObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"stream", NULL};
    unsigned long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$K", kwlist, &stream) || live(self) < 0)
        return NULL;
    fs_status s;
    NCCL_CALL(self, s, stream, "", fs_nccl_group_start(self->comm));
    return done(self, s, "group_start", "");
}

static PyObject *NcclComm_group_end(NcclCommObject *self, PyObject *Py_UNUSED(a))
{
    if (live(self) < 0)
        return NULL;
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_nccl_group_end(self->comm);
    Py_END_ALLOW_THREADS
    return done(self, s, "group_end", "");
}

static PyObject *NcclComm_set_workspace(NcclCommObject *self, PyObject *args)
{
    unsigned long long p;
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "Kn", &p, &bytes) || live(self) < 0)
        return NULL;
    fs_nccl_set_workspace(self->comm, (void *)p, (size_t)bytes);
    Py_RETURN_NONE;
}

static PyObject *NcclComm_abort(NcclCommObject *self, PyObject *args)
{
    const char *why;
    if (!PyArg_ParseTuple(args, "s", &why) || live(self) < 0)
        return NULL;
    self->comm->ops->abort(self->comm, why);
    Py_RETURN_TRUE;
}

static PyObject *NcclComm_capsule(NcclCommObject *self, PyObject *Py_UNUSED(a))
{
    if (live(self) < 0)
        return NULL;
    return PyCapsule_New(self->comm, FS_COMM_CAPSULE, NULL);
}

static PyObject *NcclComm_close(NcclCommObject *self, PyObject *Py_UNUSED(a))
{
    fs_comm *c = self->comm;
    self->comm = NULL;
    if (c) {
        Py_BEGIN_ALLOW_THREADS
        fs_comm_destroy(c);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *NcclComm_get_rank(NcclCommObject *self, void *c)
{
    return live(self) < 0 ? NULL : PyLong_FromLong(self->comm->rank);
}
static PyObject *NcclComm_get_world(NcclCommObject *self, void *c)
{
    return live(self) < 0 ? NULL : PyLong_FromLong(self->comm->world_size);
}
static PyObject *NcclComm_get_stream(NcclCommObject *self, void *c)
{
    return live(self) < 0 ? NULL : PyLong_FromVoidPtr(fs_nccl_stream(self->comm));
}
static PyObject *NcclComm_get_backend(NcclCommObject *self, void *c)
{
    return PyUnicode_FromString("nccl");
}

#define KW (METH_VARARGS | METH_KEYWORDS)
static PyMethodDef NcclComm_methods[] = {
    {"all_gather", (PyCFunction)(void (*)(void))NcclComm_all_gather, KW, all_gather_doc},
    {"reduce_scatter", (PyCFunction)(void (*)(void))NcclComm_reduce_scatter, KW,
     reduce_scatter_doc},
    {"all_reduce", (PyCFunction)(void (*)(void))NcclComm_all_reduce, KW, all_reduce_doc},
    {"broadcast", (PyCFunction)(void (*)(void))NcclComm_broadcast, KW, broadcast_doc},
    {"barrier", (PyCFunction)(void (*)(void))NcclComm_barrier, KW, barrier_doc},
    {"wait", (PyCFunction)NcclComm_wait, METH_VARARGS, wait_doc},
    {"group_start", (PyCFunction)(void (*)(void))NcclComm_group_start, KW,
     "group_start(*, stream=0): open an NCCL group ordered after `stream`"},
    {"group_end", (PyCFunction)NcclComm_group_end, METH_NOARGS,
     "group_end(): launch the group; the opening stream waits for it"},
    {"set_workspace", (PyCFunction)NcclComm_set_workspace, METH_VARARGS,
     "set_workspace(ptr, nbytes): float32 staging for bfloat16/float16 reductions"},
    {"abort", (PyCFunction)NcclComm_abort, METH_VARARGS,
     "abort(why) -> True: ncclCommAbort; later calls fail, other ranks' collectives fail"},
    {"capsule", (PyCFunction)NcclComm_capsule, METH_NOARGS,
     "capsule() -> the fs_comm* (comm.h) for flatshard._C; valid while this comm is open"},
    {"close", (PyCFunction)NcclComm_close, METH_NOARGS,
     "close(): destroy the communicator (aborting it if work does not finish in time)"},
    {NULL},
};

static PyGetSetDef NcclComm_getset[] = {
    {"rank", (getter)NcclComm_get_rank, NULL, "this process' rank in the group", NULL},
    {"world_size", (getter)NcclComm_get_world, NULL, "ranks in the group", NULL},
    {"stream", (getter)NcclComm_get_stream, NULL, "the comm's own stream (int handle)", NULL},
    {"backend", (getter)NcclComm_get_backend, NULL, "backend name", NULL},
    {NULL},
};

static PyType_Slot NcclComm_slots[] = {
    {Py_tp_new, NcclComm_new},
    {Py_tp_dealloc, NcclComm_dealloc},
    {Py_tp_methods, NcclComm_methods},
    {Py_tp_getset, NcclComm_getset},
    {Py_tp_doc, "NcclComm(rank, world_size, unique_id, device, timeout_s=300): an NCCL "
                "communicator (blocking until all ranks joined); the same collectives as "
                "flatshard._C.Comm over device pointers."},
    {0, NULL},
};

static PyType_Spec NcclComm_spec = {
    "flatshard._C_cuda.NcclComm", sizeof(NcclCommObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, NcclComm_slots,
};

int fs_nccl_type_add(PyObject *module, cuda_state *st)
{
    st->NcclCommType = PyType_FromModuleAndSpec(module, &NcclComm_spec, NULL);
    if (!st->NcclCommType)
        return -1;
    return PyModule_AddObjectRef(module, "NcclComm", st->NcclCommType);
}
