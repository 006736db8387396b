/* py_optim.c - flatshard._C entry points of the fused CPU optimizer steps
 * (optim_cpu.c). Buffers cross as data pointers of contiguous fp32 tensors;
 * python/flatshard/optim.py checks them. The GIL is released for the step. */
#include "fs_py.h"

#include "optim.h"

/* The level `name` asks for, or -1 with ValueError set. */
static int parse_simd(const char *name)
{
    int level = fs_simd_parse(name);
    if (level == -1)
        PyErr_Format(PyExc_ValueError, "simd='%s': expected 'auto', 'scalar', 'avx2' or "
                     "'avx512'", name);
    else if (level == -2)
        PyErr_Format(PyExc_ValueError, "simd='%s': this CPU lacks it (best: '%s')", name,
                     fs_simd_name(fs_simd_best()));
    return level < 0 ? -1 : level;
}

PyDoc_STRVAR(adam_step_doc,
             "adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, copy, copy_dtype, n, *,\n"
             "          lr, beta1, beta2, eps, weight_decay, step, decoupled, maximize,\n"
             "          threads=1, simd='auto')\n"
             "One fused Adam (decoupled=False) or AdamW (decoupled=True) step; pointers are\n"
             "ints (0 for max_exp_avg_sq without amsgrad, and for no low-precision copy).\n"
             "simd: 'auto' (the best this CPU has), 'avx512', 'avx2' or 'scalar' (the\n"
             "reference); every level gives the same bits.");
static PyObject *py_adam_step(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "copy",
                             "copy_dtype", "n", "lr", "beta1", "beta2", "eps", "weight_decay",
                             "step", "decoupled", "maximize", "threads", "simd", NULL};
    unsigned long long p, g, ea, eas, mx, cp;
    int cdt, decoupled = 1, maximize = 0, threads = 1;
    long long n, step = 1;
    float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.0f;
    const char *simd = "auto";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKKKKKiL|$fffffLppis", kwlist, &p, &g, &ea, &eas,
                                     &mx, &cp, &cdt, &n, &lr, &b1, &b2, &eps, &wd, &step,
                                     &decoupled, &maximize, &threads, &simd))
        return NULL;
    int level = parse_simd(simd);
    if (level < 0)
        return NULL;
    fs_adam_buffers b = {(float *)p, (const float *)g, (float *)ea, (float *)eas,
                         (float *)mx, (void *)cp, (fs_dtype)cdt, n};
    fs_adam_hparams h = {lr, b1, b2, eps, wd, step, decoupled, maximize};
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_adam_step(&b, &h, (fs_simd)level, threads);
    Py_END_ALLOW_THREADS
    if (s != FS_OK)
        return fs_raise(fs_state_from_module(m), s, "adam_step: need n >= 0, step >= 1, "
                        "copy dtype bfloat16 or float16");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sgd_step_doc,
             "sgd_step(param, grad, momentum_buf, copy, copy_dtype, n, *, lr, momentum,\n"
             "         dampening, weight_decay, nesterov, maximize, first_step, threads=1)\n"
             "One fused SGD step (torch's rule; momentum_buf 0 when momentum == 0).");
static PyObject *py_sgd_step(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"param", "grad", "momentum_buf", "copy", "copy_dtype", "n", "lr",
                             "momentum", "dampening", "weight_decay", "nesterov", "maximize",
                             "first_step", "threads", NULL};
    unsigned long long p, g, buf, cp;
    int cdt, nesterov = 0, maximize = 0, first = 0, threads = 1;
    long long n;
    float lr = 1e-3f, mom = 0.0f, damp = 0.0f, wd = 0.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKKKiL|$ffffpppi", kwlist, &p, &g, &buf, &cp,
                                     &cdt, &n, &lr, &mom, &damp, &wd, &nesterov, &maximize,
                                     &first, &threads))
        return NULL;
    fs_sgd_buffers b = {(float *)p, (const float *)g, (float *)buf, (void *)cp, (fs_dtype)cdt, n};
    fs_sgd_hparams h = {lr, mom, damp, wd, nesterov, maximize, first};
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_sgd_step(&b, &h, FS_SIMD_SCALAR, threads);
    Py_END_ALLOW_THREADS
    if (s != FS_OK)
        return fs_raise(fs_state_from_module(m), s, "sgd_step: need n >= 0, copy dtype "
                        "bfloat16 or float16");
    Py_RETURN_NONE;
}

static PyMethodDef optim_methods[] = {
    {"adam_step", (PyCFunction)(void (*)(void))py_adam_step, METH_VARARGS | METH_KEYWORDS,
     adam_step_doc},
    {"sgd_step", (PyCFunction)(void (*)(void))py_sgd_step, METH_VARARGS | METH_KEYWORDS,
     sgd_step_doc},
    {NULL},
};

int fs_optim_add(PyObject *module) { return PyModule_AddFunctions(module, optim_methods); }
