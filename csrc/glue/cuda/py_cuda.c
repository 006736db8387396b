/* py_cuda.c - flatshard._C_cuda's functions: the CUDA kernels and the NCCL
 * loader of csrc/cuda/ for Python (module_cuda.c adds them, the NcclComm
 * type and the device table's capsule for flatshard._C).
 *
 * Same conventions as flatshard._C: buffers cross as data pointers (ints
 * from Tensor.data_ptr()) with element counts and dtype codes, checked by
 * python/flatshard/runtime/cuda.py; streams cross as ints (torch's
 * Stream.cuda_stream). Kernels are only enqueued: errors surface here as
 * CudaError naming the op; a failed NCCL call raises NcclError naming the
 * collective and what it was for. Importing this module touches no GPU (the
 * CUDA runtime is linked statically and starts at the first call). */
#include "py_cuda.h"

static cuda_state *state_of_module(PyObject *m) { return PyModule_GetState(m); }
cuda_state *fs_cuda_state_of_type(PyTypeObject *tp)
{
    return PyModule_GetState(PyType_GetModuleByDef(tp, &fs_cuda_module_def));
}

static PyObject *cuda_raise(PyObject *m, const char *op, cudaError_t e)
{
    PyErr_Format(state_of_module(m)->CudaError, "flatshard CUDA %s: %s (%s)", op,
                 cudaGetErrorName(e), cudaGetErrorString(e));
    return NULL;
}

#define LAUNCH(m, op, call)                      \
    do {                                         \
        cudaError_t e_ = (call);                 \
        if (e_ != cudaSuccess)                   \
            return cuda_raise(m, op, e_);        \
        Py_RETURN_NONE;                          \
    } while (0)

static int dtype_ok(int t) { return t >= 0 && t < FS_DTYPE_COUNT; }

/* ---------------------------------------------------------------------------
 * runtime and NCCL loading */

PyDoc_STRVAR(runtime_info_doc,
             "runtime_info() -> dict(runtime_version, driver_version, device_count, error):\n"
             "what this build's CUDA runtime sees (no exception without a GPU or driver).");
static PyObject *py_runtime_info(PyObject *m, PyObject *Py_UNUSED(a))
{
    int rt = 0, drv = 0, n = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
        n = 0;
    return Py_BuildValue("{sisisiss}", "runtime_version", rt, "driver_version", drv,
                         "device_count", n, "error",
                         e == cudaSuccess ? "" : cudaGetErrorString(e));
}

PyDoc_STRVAR(nccl_load_doc, "nccl_load(path=None) -> NCCL version code (e.g. 22703).\n"
                            "Opens libnccl (path, or libnccl.so.2 from the search path).");
static PyObject *py_nccl_load(PyObject *m, PyObject *args)
{
    const char *path = NULL;
    if (!PyArg_ParseTuple(args, "|z", &path))
        return NULL;
    char err[512] = "";
    int v = 0;
    if (fs_nccl_load(path, &v, err, sizeof err) != FS_OK)
        return PyErr_Format(state_of_module(m)->NcclError, "flatshard NCCL load: %s", err);
    return PyLong_FromLong(v);
}

static PyObject *py_nccl_version(PyObject *m, PyObject *Py_UNUSED(a))
{
    return PyLong_FromLong(fs_nccl_version());
}

static PyObject *py_nccl_unique_id(PyObject *m, PyObject *Py_UNUSED(a))
{
    unsigned char id[128];
    char err[256] = "";
    if (fs_nccl_unique_id(id, err, sizeof err) != FS_OK)
        return PyErr_Format(state_of_module(m)->NcclError, "flatshard NCCL unique id: %s", err);
    return PyBytes_FromStringAndSize((const char *)id, sizeof id);
}

/* ---------------------------------------------------------------------------
 * kernels */

PyDoc_STRVAR(cast_doc, "cast(dst, dst_dtype, src, src_dtype, n, stream)");
static PyObject *py_cast(PyObject *m, PyObject *args)
{
    unsigned long long d, s, stream;
    int dt, st;
    long long n;
    if (!PyArg_ParseTuple(args, "KiKiLK", &d, &dt, &s, &st, &n, &stream))
        return NULL;
    if (!dtype_ok(dt) || !dtype_ok(st))
        return PyErr_Format(PyExc_ValueError, "cast: invalid dtype code");
    LAUNCH(m, "cast", fs_cuda_cast((void *)d, dt, (const void *)s, st, n, (cudaStream_t)stream));
}

PyDoc_STRVAR(scale_accumulate_doc,
             "scale_accumulate(dst, dst_dtype, src, src_dtype, n, scale, accumulate, stream)");
static PyObject *py_scale_accumulate(PyObject *m, PyObject *args)
{
    unsigned long long d, s, stream;
    int dt, st, acc;
    long long n;
    double scale;
    if (!PyArg_ParseTuple(args, "KiKiLdpK", &d, &dt, &s, &st, &n, &scale, &acc, &stream))
        return NULL;
    if (!dtype_ok(dt) || !dtype_ok(st))
        return PyErr_Format(PyExc_ValueError, "scale_accumulate: invalid dtype code");
    LAUNCH(m, "scale_accumulate", fs_cuda_scale_accumulate((void *)d, dt, (const void *)s, st, n,
                                                           scale, acc, (cudaStream_t)stream));
}

/* Segments from a sequence of (ptr, ptr_offset, flat_offset, numel, dtype),
 * launched FS_CUDA_SEGMENTS at a time from a stack table. */
static PyObject *segments(PyObject *m, PyObject *args, int unpack)
{
    unsigned long long flat, stream;
    int ft;
    PyObject *seq_obj;
    if (!PyArg_ParseTuple(args, "KiOK", &flat, &ft, &seq_obj, &stream))
        return NULL;
    if (!dtype_ok(ft))
        return PyErr_Format(PyExc_ValueError, "pack/unpack: invalid dtype code");
    PyObject *seq = PySequence_Fast(seq_obj, "segments must be a sequence of tuples");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    fs_cuda_segment tab[FS_CUDA_SEGMENTS];
    PyObject *res = NULL;
    int k = 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        if (i < n) {
            unsigned long long p;
            long long po, fo, numel;
            int dt;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KLLLi;segment must be "
                                  "(ptr, ptr_offset, flat_offset, numel, dtype)", &p, &po, &fo,
                                  &numel, &dt))
                goto done;
            tab[k++] = (fs_cuda_segment){(void *)p, po, fo, numel, dt};
        }
        if (k == FS_CUDA_SEGMENTS || (i == n && k > 0)) {
            cudaError_t e = unpack ? fs_cuda_unpack((const void *)flat, ft, tab, k,
                                                    (cudaStream_t)stream)
                                   : fs_cuda_pack((void *)flat, ft, tab, k, (cudaStream_t)stream);
            k = 0;
            if (e != cudaSuccess) {
                cuda_raise(m, unpack ? "unpack" : "pack", e);
                goto done;
            }
        }
    }
    res = Py_NewRef(Py_None);
done:
    Py_DECREF(seq);
    return res;
}

PyDoc_STRVAR(pack_doc,
             "pack(flat, flat_dtype, segments, stream): flat[fo + j] = ptr[po + j] for each\n"
             "segment (ptr, po, fo, numel, dtype), cast to flat_dtype; ptr 0 writes zeros.");
static PyObject *py_pack(PyObject *m, PyObject *args) { return segments(m, args, 0); }

PyDoc_STRVAR(unpack_doc, "unpack(flat, flat_dtype, segments, stream): ptr[po + j] = flat[fo + j].");
static PyObject *py_unpack(PyObject *m, PyObject *args) { return segments(m, args, 1); }

PyDoc_STRVAR(adam_step_doc,
             "adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, copy, copy_dtype, n, *,\n"
             "          lr, beta1, beta2, eps, weight_decay, step, decoupled, maximize,\n"
             "          step_ptr=0, found_inf=0, grad_scale=0, stream=0)\n"
             "One fused Adam/AdamW step over a device shard (pointers as ints, 0 for none).\n"
             "step_ptr: float32 device step (bias corrections read on the device).");
static PyObject *py_adam_step(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "copy",
                             "copy_dtype", "n", "lr", "beta1", "beta2", "eps", "weight_decay",
                             "step", "decoupled", "maximize", "step_ptr", "found_inf",
                             "grad_scale", "stream", NULL};
    unsigned long long p, g, ea, eas, mx, cp, sp = 0, fi = 0, gs = 0, stream = 0;
    int cdt, decoupled = 1, maximize = 0;
    long long n, step = 1;
    float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKKKKKiL|$fffffLppKKKK", kwlist, &p, &g, &ea,
                                     &eas, &mx, &cp, &cdt, &n, &lr, &b1, &b2, &eps, &wd, &step,
                                     &decoupled, &maximize, &sp, &fi, &gs, &stream))
        return NULL;
    fs_cuda_adam_args a = {(float *)p, (const float *)g, (float *)ea, (float *)eas, (float *)mx,
                           (void *)cp, (fs_dtype)cdt, n, lr, b1, b2, eps, wd, step,
                           (const float *)sp, decoupled, maximize, (const float *)fi,
                           (const float *)gs};
    LAUNCH(m, "adam_step (need n >= 0, step >= 1, copy dtype bfloat16 or float16)",
           fs_cuda_adam_step(&a, (cudaStream_t)stream));
}

PyDoc_STRVAR(sgd_step_doc,
             "sgd_step(param, grad, momentum_buf, copy, copy_dtype, n, *, lr, momentum,\n"
             "         dampening, weight_decay, nesterov, maximize, first_step, found_inf=0,\n"
             "         grad_scale=0, stream=0)");
static PyObject *py_sgd_step(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"param", "grad", "momentum_buf", "copy", "copy_dtype", "n", "lr",
                             "momentum", "dampening", "weight_decay", "nesterov", "maximize",
                             "first_step", "found_inf", "grad_scale", "stream", NULL};
    unsigned long long p, g, buf, cp, fi = 0, gs = 0, stream = 0;
    int cdt, nesterov = 0, maximize = 0, first = 0;
    long long n;
    float lr = 1e-3f, mom = 0.0f, damp = 0.0f, wd = 0.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKKKiL|$ffffpppKKK", kwlist, &p, &g, &buf, &cp,
                                     &cdt, &n, &lr, &mom, &damp, &wd, &nesterov, &maximize,
                                     &first, &fi, &gs, &stream))
        return NULL;
    fs_cuda_sgd_args a = {(float *)p, (const float *)g, (float *)buf, (void *)cp, (fs_dtype)cdt,
                          n, lr, mom, damp, wd, nesterov, maximize, first, (const float *)fi,
                          (const float *)gs};
    LAUNCH(m, "sgd_step (need n >= 0, copy dtype bfloat16 or float16)",
           fs_cuda_sgd_step(&a, (cudaStream_t)stream));
}

PyDoc_STRVAR(norm_partial_doc,
             "norm_partial(x, dtype, n, inf, out, stream): *out (device float64) = sum of\n"
             "squares, or max |x| when inf.");
static PyObject *py_norm_partial(PyObject *m, PyObject *args)
{
    unsigned long long x, out, stream;
    int t, inf;
    long long n;
    if (!PyArg_ParseTuple(args, "KiLpKK", &x, &t, &n, &inf, &out, &stream))
        return NULL;
    if (!dtype_ok(t))
        return PyErr_Format(PyExc_ValueError, "norm_partial: invalid dtype code");
    LAUNCH(m, "norm_partial", fs_cuda_norm_partial((const void *)x, t, n, inf, (double *)out,
                                                   (cudaStream_t)stream));
}

/* ---------------------------------------------------------------------------
 * the module's functions */

#define KW (METH_VARARGS | METH_KEYWORDS)
static PyMethodDef kernel_methods[] = {
    {"runtime_info", py_runtime_info, METH_NOARGS, runtime_info_doc},
    {"nccl_load", py_nccl_load, METH_VARARGS, nccl_load_doc},
    {"nccl_version", py_nccl_version, METH_NOARGS, "nccl_version() -> loaded NCCL's code, or 0"},
    {"nccl_unique_id", py_nccl_unique_id, METH_NOARGS, "nccl_unique_id() -> 128 bytes"},
    {"cast", py_cast, METH_VARARGS, cast_doc},
    {"scale_accumulate", py_scale_accumulate, METH_VARARGS, scale_accumulate_doc},
    {"pack", py_pack, METH_VARARGS, pack_doc},
    {"unpack", py_unpack, METH_VARARGS, unpack_doc},
    {"adam_step", (PyCFunction)(void (*)(void))py_adam_step, KW, adam_step_doc},
    {"sgd_step", (PyCFunction)(void (*)(void))py_sgd_step, KW, sgd_step_doc},
    {"norm_partial", py_norm_partial, METH_VARARGS, norm_partial_doc},
    {NULL},
};

int fs_cuda_kernels_add(PyObject *module)
{
    return PyModule_AddFunctions(module, kernel_methods);
}
