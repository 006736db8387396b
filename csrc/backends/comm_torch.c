/* comm_torch.c - collective backend over any torch.distributed process group.
 *
 * The general fallback (gloo on CPU, multi-host CPU jobs). The C core cannot
 * call a ProcessGroup without torch's C++ headers, so this backend calls a
 * Python function `fn(op, a, b, arg)` supplied by flatshard's Python layer,
 * handing it DLPack capsules over the raw buffers (zero copy); that function
 * issues the torch.distributed call and waits for it. Reductions are always
 * asked for as SUM and averaged here, because gloo's AVG silently sums.
 *
 * Takes the GIL for each call (it calls Python), so it may be called with or
 * without it. Not for the hot path of GPU jobs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>

#include "comm.h"
#include "copy.h"
#include "dlpack.h"

typedef struct {
    PyObject *fn; /* strong reference */
} torch_impl;

/* ---------------------------------------------------------------------------
 * DLPack capsules over raw buffers */

typedef struct {
    DLManagedTensor managed;
    int64_t shape[1];
} owned_dl;

static void owned_dl_delete(DLManagedTensor *self) { free(self->manager_ctx); }

static void capsule_destructor(PyObject *cap)
{
    /* Renamed to "used_dltensor" once a consumer took ownership. */
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
        m->deleter(m);
    }
}

static int dl_dtype(fs_dtype t, DLDataType *out)
{
    static const DLDataType map[FS_DTYPE_COUNT] = {
        {FS_kDLFloat, 32, 1}, {FS_kDLFloat, 16, 1}, {FS_kDLBfloat, 16, 1}, {FS_kDLFloat, 64, 1},
        {FS_kDLUInt, 8, 1},   {FS_kDLInt, 32, 1},   {FS_kDLInt, 64, 1},
    };
    if ((unsigned)t >= FS_DTYPE_COUNT)
        return -1;
    *out = map[t];
    return 0;
}

/* New capsule viewing numel elements of dtype t at ptr (host memory). */
static PyObject *fs_dlpack_capsule(void *ptr, int64_t numel, fs_dtype t)
{
    owned_dl *o = calloc(1, sizeof *o);
    if (!o)
        return PyErr_NoMemory();
    o->shape[0] = numel;
    DLTensor *d = &o->managed.dl_tensor;
    static char empty;
    d->data = numel ? ptr : (void *)&empty; /* consumers reject NULL data */
    d->device.device_type = FS_kDLCPU;
    d->device.device_id = 0;
    d->ndim = 1;
    d->shape = o->shape;
    d->strides = NULL;
    d->byte_offset = 0;
    if (dl_dtype(t, &d->dtype) < 0) {
        free(o);
        PyErr_SetString(PyExc_ValueError, "invalid dtype code");
        return NULL;
    }
    o->managed.manager_ctx = o;
    o->managed.deleter = owned_dl_delete;
    PyObject *cap = PyCapsule_New(&o->managed, "dltensor", capsule_destructor);
    if (!cap)
        free(o);
    return cap;
}

/* ---------------------------------------------------------------------------
 * calls into the Python side */

static fs_status call(fs_comm *c, const char *op, void *a, int64_t an, void *b, int64_t bn,
                      fs_dtype t, int arg)
{
    torch_impl *impl = c->impl;
    PyObject *ca = NULL, *cb = NULL, *res = NULL;
    fs_status st = FS_ERR_PYTHON;
    PyGILState_STATE gil = PyGILState_Ensure();
    if (a && !(ca = fs_dlpack_capsule(a, an, t)))
        goto done;
    if (b && !(cb = fs_dlpack_capsule(b, bn, t)))
        goto done;
    res = PyObject_CallFunction(impl->fn, "sOOi", op, ca ? ca : Py_None, cb ? cb : Py_None, arg);
    if (res)
        st = FS_OK;
done:
    Py_XDECREF(res);
    Py_XDECREF(cb);
    Py_XDECREF(ca);
    PyGILState_Release(gil);
    return st;
}

static fs_status t_all_gather(fs_comm *c, const void *send, void *recv, int64_t count, fs_dtype t)
{
    return call(c, "all_gather", (void *)send, count, recv, count * c->world_size, t, 0);
}

static fs_status t_reduce_scatter(fs_comm *c, const void *send, void *recv, int64_t recv_count,
                                  fs_dtype t, fs_redop op)
{
    FS_CHECK(call(c, "reduce_scatter", (void *)send, recv_count * c->world_size, recv, recv_count,
                  t, 0));
    if (op == FS_RED_AVG)
        return fs_scale_accumulate(recv, t, recv, t, recv_count, 1.0 / c->world_size, 0);
    return FS_OK;
}

static fs_status t_all_reduce(fs_comm *c, void *buf, int64_t count, fs_dtype t, fs_redop op)
{
    FS_CHECK(call(c, "all_reduce", buf, count, NULL, 0, t, 0));
    if (op == FS_RED_AVG)
        return fs_scale_accumulate(buf, t, buf, t, count, 1.0 / c->world_size, 0);
    return FS_OK;
}

static fs_status t_broadcast(fs_comm *c, void *buf, int64_t count, fs_dtype t, int root)
{
    return call(c, "broadcast", buf, count, NULL, 0, t, root);
}

static fs_status t_all_to_all(fs_comm *c, const void *send, void *recv, int64_t count,
                              fs_dtype t)
{
    return call(c, "all_to_all", (void *)send, count * c->world_size, recv,
                count * c->world_size, t, 0);
}

static fs_status t_barrier(fs_comm *c) { return call(c, "barrier", NULL, 0, NULL, 0, FS_U8, 0); }

static void t_destroy(fs_comm *c)
{
    torch_impl *impl = c->impl;
    Py_XDECREF(impl->fn);
    free(impl);
    free(c);
}

static const fs_comm_ops torch_ops = {
    "torch", 1, t_all_gather, t_reduce_scatter, t_all_reduce, t_broadcast, t_barrier, t_destroy, NULL,
    t_all_to_all,
};

fs_status fs_comm_torch_create(PyObject *fn, int rank, int world_size, fs_comm **out)
{
    if (world_size < 1 || rank < 0 || rank >= world_size || !PyCallable_Check(fn))
        return FS_ERR_INVALID_ARG;
    fs_comm *c = calloc(1, sizeof *c);
    torch_impl *impl = calloc(1, sizeof *impl);
    if (!c || !impl) {
        free(c);
        free(impl);
        return FS_ERR_NO_MEMORY;
    }
    Py_INCREF(fn);
    impl->fn = fn;
    c->ops = &torch_ops;
    c->rank = rank;
    c->world_size = world_size;
    c->impl = impl;
    *out = c;
    return FS_OK;
}
