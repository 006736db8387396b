/* py_optim.c - flatshard._C entry points of the fused CPU optimizer steps
 * (optim_cpu.c, chosen per size class by optim_tune.c). Buffers cross as
 * data pointers of contiguous fp32 tensors, which
 * python/flatshard/optim/checks.py checks. The GIL is released for the
 * step. */
#include "fs_py.h"

#include "optim.h"

/* A job of `what` that is not a tuple of `shape`: TypeError. -1. */
static int job_shape(const char *what, const char *shape)
{
    if (PyErr_ExceptionMatches(PyExc_TypeError))
        PyErr_Format(PyExc_TypeError, "%s: each job is %s", what, shape);
    return -1;
}

/* Runs `job`: with the named variant when `variant` is not NULL (after
 * checking the name), else with the tuned one under the simd/threads caps. */
static PyObject *run_job(PyObject *m, const fs_optim_job *job, const char *simd, int threads,
                         const char *variant, const char *what)
{
    int level = fs_simd_arg(simd, NULL);
    if (level < 0)
        return NULL;
    fs_optim_variant v;
    if (variant && fs_optim_variant_parse(variant, &v) != FS_OK) {
        PyErr_Format(PyExc_ValueError, "variant='%s': expected simd.u<1|2|4>.pf<bytes>.<st|nt>."
                     "t<threads>.c<chunk, a multiple of 16> with a simd level this CPU has "
                     "(best: '%s'), e.g. 'avx2.u2.pf0.nt.t2.c0'", variant,
                     fs_simd_name(fs_simd_best()));
        return NULL;
    }
    fs_status s = fs_optim_check(job);
    if (s == FS_OK) {
        Py_BEGIN_ALLOW_THREADS
        if (variant)
            s = fs_optim_run(job, 0, job->kind == FS_OPTIM_ADAM ? job->adam.n : job->sgd.n, &v);
        else
            s = fs_optim_step(job, (fs_simd)level, threads);
        Py_END_ALLOW_THREADS
    }
    return fs_result(m, s, what);
}

PyDoc_STRVAR(adam_step_doc,
             "adam_step(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, copy, copy_dtype, n, *,\n"
             "          lr, beta1, beta2, eps, weight_decay, step, decoupled, maximize,\n"
             "          threads=1, simd='auto', variant=None)\n"
             "One fused Adam (decoupled=False) or AdamW (decoupled=True) step; pointers are\n"
             "ints (0 for max_exp_avg_sq without amsgrad, and for no low-precision copy).\n"
             "The loop variant is the one timed fastest for this size class (on scratch\n"
             "buffers before the class's first step, or read from the cache file:\n"
             "optim_tune_cache); simd caps its instruction set\n"
             "('auto': the best this CPU has, 'avx512', 'avx2', or 'scalar': the reference)\n"
             "and threads its thread count. variant: a name (optim_tune_records) that forces\n"
             "one variant instead. Every variant computes one formula, with FMA.");
static PyObject *py_adam_step(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "copy",
                             "copy_dtype", "n", "lr", "beta1", "beta2", "eps", "weight_decay",
                             "step", "decoupled", "maximize", "threads", "simd", "variant", NULL};
    unsigned long long p, g, ea, eas, mx, cp;
    int cdt, decoupled = 1, maximize = 0, threads = 1;
    long long n, step = 1;
    float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.0f;
    const char *simd = "auto", *variant = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKKKKKiL|$fffffLppisz", kwlist, &p, &g, &ea,
                                     &eas, &mx, &cp, &cdt, &n, &lr, &b1, &b2, &eps, &wd, &step,
                                     &decoupled, &maximize, &threads, &simd, &variant))
        return NULL;
    fs_optim_job j = {FS_OPTIM_ADAM,
                      {(float *)p, (const float *)g, (float *)ea, (float *)eas, (float *)mx,
                       (void *)cp, (fs_dtype)cdt, n},
                      {lr, b1, b2, eps, wd, step, decoupled, maximize}};
    return run_job(m, &j, simd, threads, variant, "adam_step: need n >= 0, step >= 1, copy "
                   "dtype bfloat16 or float16");
}

/* One job of a group call: `item` (a tuple) over `proto` (kind and
 * hyperparameters) into *job, and for Adam the address of its float32 step
 * count into *step; -1 with an exception set (naming `what` and job i) when
 * it is refused. */
static int adam_item(PyObject *item, const char *what, Py_ssize_t i, const fs_optim_job *proto,
                     fs_optim_job *job, float **step)
{
    unsigned long long p, g, ea, eas, mx, st;
    long long n;
    if (!PyArg_ParseTuple(item, "KKKKKKL", &p, &g, &ea, &eas, &mx, &st, &n))
        return job_shape(what, "(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, n)");
    *job = *proto;
    job->adam = (fs_adam_buffers){(float *)p, (const float *)g, (float *)ea, (float *)eas,
                                  (float *)mx, NULL, FS_BF16, n};
    *step = (float *)st;
    if (!fs_optim_step_count_ok(*step) || fs_optim_check(job) != FS_OK) {
        PyErr_Format(PyExc_ValueError, "%s: job %zd: need a step count >= 0 and n >= 0", what, i);
        return -1;
    }
    return 0;
}

static int sgd_item(PyObject *item, const char *what, Py_ssize_t i, const fs_optim_job *proto,
                    fs_optim_job *job, float **step)
{
    unsigned long long p, g, buf;
    int first;
    long long n;
    if (!PyArg_ParseTuple(item, "KKKpL", &p, &g, &buf, &first, &n))
        return job_shape(what, "(param, grad, momentum_buf, first_step, n)");
    *job = *proto;
    job->sgd = (fs_sgd_buffers){(float *)p, (const float *)g, (float *)buf, NULL, FS_BF16, n};
    job->sgd_h.first_step = first;
    if ((job->sgd_h.momentum != 0.0f && !buf && n > 0) || fs_optim_check(job) != FS_OK) {
        PyErr_Format(PyExc_ValueError, "%s: job %zd: need n >= 0 and a momentum buffer when "
                     "momentum != 0", what, i);
        return -1;
    }
    return 0;
}

Py_ssize_t fs_glue_optim_jobs(PyObject *jobs, const char *what, const fs_optim_job *proto,
                              fs_optim_job **js, float ***steps)
{
    const int adam = proto->kind == FS_OPTIM_ADAM;
    char msg[96];
    snprintf(msg, sizeof msg, "%s: jobs must be a sequence", what);
    PyObject *seq = PySequence_Fast(jobs, msg);
    if (!seq)
        return -1;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    *js = PyMem_Calloc(k ? (size_t)k : 1, sizeof **js);
    *steps = PyMem_Calloc(k ? (size_t)k : 1, sizeof **steps);
    if (!*js || !*steps) {
        PyErr_NoMemory();
        k = -1;
    }
    for (Py_ssize_t i = 0; k >= 0 && i < k; i++)
        if ((adam ? adam_item : sgd_item)(PySequence_Fast_GET_ITEM(seq, i), what, i, proto,
                                          &(*js)[i], &(*steps)[i]) < 0)
            k = -1;
    Py_DECREF(seq);
    if (k < 0) {
        PyMem_Free(*js);
        PyMem_Free(*steps);
    }
    return k;
}

/* adam_steps and sgd_steps: every job of `jobs` made and checked, then all
 * run in order under one release of the GIL (fs_optim_steps: Adam's counts
 * taken as each runs). */
static PyObject *group_call(PyObject *m, PyObject *jobs, const char *name, const char *simd,
                            int threads, const fs_optim_job *proto)
{
    int level = fs_simd_arg(simd, NULL);
    fs_optim_job *js;
    float **steps;
    Py_ssize_t k = level < 0 ? -1 : fs_glue_optim_jobs(jobs, name, proto, &js, &steps);
    if (k < 0)
        return NULL;
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_optim_steps(js, steps, (int)k, (fs_simd)level, threads);
    Py_END_ALLOW_THREADS
    PyMem_Free(js);
    PyMem_Free(steps);
    return fs_result(m, s, name);
}

PyDoc_STRVAR(adam_steps_doc,
             "adam_steps(jobs, *, lr, beta1, beta2, eps, weight_decay, decoupled, maximize,\n"
             "           threads=1, simd='auto')\n"
             "adam_step for each (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, n)\n"
             "of `jobs` (a param group's), under one release of the GIL: the per-parameter\n"
             "cost of a many-tensor model is then a tuple of pointers. step points at the\n"
             "parameter's float32 step count (torch's state['step']), which is incremented\n"
             "and then used, as torch's AdamW does. Every job is checked before any runs.");
static PyObject *py_adam_steps(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"jobs", "lr", "beta1", "beta2", "eps", "weight_decay", "decoupled",
                             "maximize", "threads", "simd", NULL};
    PyObject *jobs;
    int decoupled = 1, maximize = 0, threads = 1;
    float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.0f;
    const char *simd = "auto";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$fffffppis", kwlist, &jobs, &lr, &b1, &b2,
                                     &eps, &wd, &decoupled, &maximize, &threads, &simd))
        return NULL;
    fs_optim_job proto = {FS_OPTIM_ADAM, {0}, {lr, b1, b2, eps, wd, 1, decoupled, maximize}};
    return group_call(m, jobs, "adam_steps", simd, threads, &proto);
}

PyDoc_STRVAR(sgd_step_doc,
             "sgd_step(param, grad, momentum_buf, copy, copy_dtype, n, *, lr, momentum,\n"
             "         dampening, weight_decay, nesterov, maximize, first_step, threads=1,\n"
             "         simd='auto', variant=None)\n"
             "One fused SGD step (torch's rule; momentum_buf 0 when momentum == 0); the\n"
             "variant is chosen as adam_step's.");
static PyObject *py_sgd_step(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"param", "grad", "momentum_buf", "copy", "copy_dtype", "n", "lr",
                             "momentum", "dampening", "weight_decay", "nesterov", "maximize",
                             "first_step", "threads", "simd", "variant", NULL};
    unsigned long long p, g, buf, cp;
    int cdt, nesterov = 0, maximize = 0, first = 0, threads = 1;
    long long n;
    float lr = 1e-3f, mom = 0.0f, damp = 0.0f, wd = 0.0f;
    const char *simd = "auto", *variant = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKKKiL|$ffffpppisz", kwlist, &p, &g, &buf, &cp,
                                     &cdt, &n, &lr, &mom, &damp, &wd, &nesterov, &maximize,
                                     &first, &threads, &simd, &variant))
        return NULL;
    fs_optim_job j = {FS_OPTIM_SGD, {0}, {0},
                      {(float *)p, (const float *)g, (float *)buf, (void *)cp, (fs_dtype)cdt, n},
                      {lr, mom, damp, wd, nesterov, maximize, first}};
    return run_job(m, &j, simd, threads, variant, "sgd_step: need n >= 0, copy dtype bfloat16 "
                   "or float16");
}

PyDoc_STRVAR(sgd_steps_doc,
             "sgd_steps(jobs, *, lr, momentum, dampening, weight_decay, nesterov, maximize,\n"
             "          threads=1, simd='auto')\n"
             "sgd_step for each (param, grad, momentum_buf, first_step, n) of `jobs` (a param\n"
             "group's; pointers as ints, momentum_buf 0 when momentum == 0), under one\n"
             "release of the GIL. Every job is checked before any runs.");
static PyObject *py_sgd_steps(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"jobs", "lr", "momentum", "dampening", "weight_decay", "nesterov",
                             "maximize", "threads", "simd", NULL};
    PyObject *jobs;
    int nesterov = 0, maximize = 0, threads = 1;
    float lr = 1e-3f, mom = 0.0f, damp = 0.0f, wd = 0.0f;
    const char *simd = "auto";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$ffffppis", kwlist, &jobs, &lr, &mom, &damp,
                                     &wd, &nesterov, &maximize, &threads, &simd))
        return NULL;
    fs_optim_job proto = {FS_OPTIM_SGD, {0}, {0}, {0}, {lr, mom, damp, wd, nesterov, maximize, 0}};
    return group_call(m, jobs, "sgd_steps", simd, threads, &proto);
}

static PyObject *variant_str(const fs_optim_variant *v)
{
    char name[FS_OPTIM_VARIANT_NAME_MAX];
    fs_optim_variant_name(v, name);
    return PyUnicode_FromString(name);
}

static PyObject *record_dict(const fs_tune_record *r)
{
    static const char *stages[] = {"simd/unroll", "prefetch", "copy stores", "threads"};
    PyObject *cands = PyList_New(0);
    for (int k = 0; cands && k < r->ncandidates; k++) {
        PyObject *name = variant_str(&r->candidates[k].variant);
        PyObject *c = name ? Py_BuildValue("{s:s,s:O,s:d,s:i}", "stage",
                                           stages[r->candidates[k].stage], "variant", name,
                                           "ns_per_elem", r->candidates[k].ns_per_elem,
                                           "rounds", r->candidates[k].rounds)
                           : NULL;
        Py_XDECREF(name);
        if (!c || PyList_Append(cands, c) < 0)
            Py_CLEAR(cands);
        Py_XDECREF(c);
    }
    PyObject *chosen = cands ? variant_str(&r->chosen) : NULL;
    PyObject *d = chosen ? Py_BuildValue(
        "{s:s,s:i,s:s,s:O,s:i,s:s,s:L,s:s,s:i,s:O,s:O,s:O,s:O,s:d,s:O,s:O}", "kind",
        r->kind == FS_OPTIM_ADAM ? "adam" : "sgd", "size_log2", r->size_log2, "copy",
        r->copy_dtype < 0 ? "none" : r->copy_dtype == FS_BF16 ? "bfloat16" : "float16",
        "amsgrad", r->amsgrad ? Py_True : Py_False, "threads_max", r->threads_max, "simd_max",
        fs_simd_name(r->simd_max), "tuned_numel", (long long)r->tuned_numel, "source",
        r->source == FS_TUNE_FROM_CACHE ? "cache" : r->source == FS_TUNE_ON_STEPS ? "steps"
                                                                               : "measured",
        "live_steps", r->live_steps, "tuned",
        r->tuned ? Py_True : Py_False, "stored", r->stored ? Py_True : Py_False, "busy",
        r->busy ? Py_True : Py_False, "cut_short", r->cut_short ? Py_True : Py_False, "tune_s",
        r->tune_s, "chosen", chosen, "candidates", cands) : NULL;
    Py_XDECREF(chosen);
    Py_XDECREF(cands);
    return d;
}

PyDoc_STRVAR(optim_tune_records_doc,
             "optim_tune_records() -> [dict]: per size class chosen in this process, the\n"
             "class (kind, size_log2, copy, amsgrad, threads_max, simd_max), its first\n"
             "step's tuned_numel, source ('measured' on scratch buffers, 'steps': on the\n"
             "class's own first steps, live_steps of them, or 'cache': read from the cache\n"
             "file), tuned (False: no memory to measure, the default runs),\n"
             "stored (written to the cache file), busy (measured, or stored, while the load\n"
             "average exceeded the CPU count: provisional), cut_short (the measurement hit\n"
             "its hard stop: candidates or stages left out), tune_s (seconds spent choosing; on\n"
             "the steps, what the timed runs took beyond the stage's fastest), the\n"
             "chosen variant, and every measured candidate's score (ns per element) and\n"
             "rounds.");
static PyObject *py_optim_tune_records(PyObject *m, PyObject *Py_UNUSED(a))
{
    fs_tune_record *recs = NULL;
    int count = fs_tune_records(NULL, 0);
    PyObject *out = PyList_New(0);
    if (out && count > 0 && !(recs = PyMem_Malloc(sizeof(fs_tune_record) * (size_t)count))) {
        Py_CLEAR(out);
        PyErr_NoMemory();
    }
    if (recs) {
        count = fs_tune_records(recs, count); /* may have grown: take what fits */
        for (int k = 0; k < count && out; k++) {
            PyObject *d = record_dict(&recs[k]);
            if (!d || PyList_Append(out, d) < 0)
                Py_CLEAR(out);
            Py_XDECREF(d);
        }
    }
    PyMem_Free(recs);
    return out;
}

static PyObject *py_optim_tune_reset(PyObject *m, PyObject *Py_UNUSED(a))
{
    fs_tune_reset();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(optim_tune_cache_doc,
             "optim_tune_cache(path, version): the file where chosen loop variants are kept\n"
             "and looked up (None or '': none), keyed by version (flatshard's) among others.\n"
             "optim_tune_cache() -> the path set, or None.");
static PyObject *py_optim_tune_cache(PyObject *m, PyObject *args)
{
    const char *path = NULL, *version = NULL;
    if (PyTuple_GET_SIZE(args) == 0) {
        char buf[4096];
        if (!fs_tune_cache_path(buf, sizeof buf))
            Py_RETURN_NONE;
        return PyUnicode_DecodeFSDefault(buf);
    }
    if (!PyArg_ParseTuple(args, "zs:optim_tune_cache", &path, &version))
        return NULL;
    if (path && strlen(path) >= 4000) {
        PyErr_Format(PyExc_ValueError, "optim_tune_cache: path of %zu bytes; at most 3999",
                     strlen(path));
        return NULL;
    }
    return fs_result(m, fs_tune_cache_set(path, version), "optim_tune_cache: out of memory");
}

static PyMethodDef optim_methods[] = {
    {"adam_step", (PyCFunction)(void (*)(void))py_adam_step, METH_VARARGS | METH_KEYWORDS,
     adam_step_doc},
    {"adam_steps", (PyCFunction)(void (*)(void))py_adam_steps, METH_VARARGS | METH_KEYWORDS,
     adam_steps_doc},
    {"sgd_step", (PyCFunction)(void (*)(void))py_sgd_step, METH_VARARGS | METH_KEYWORDS,
     sgd_step_doc},
    {"sgd_steps", (PyCFunction)(void (*)(void))py_sgd_steps, METH_VARARGS | METH_KEYWORDS,
     sgd_steps_doc},
    {"optim_tune_records", py_optim_tune_records, METH_NOARGS, optim_tune_records_doc},
    {"optim_tune_reset", py_optim_tune_reset, METH_NOARGS,
     "optim_tune_reset(): forget every size class's variant in memory (the next step of\n"
     "each chooses again: from the cache file where it has the class)"},
    {"optim_tune_cache", py_optim_tune_cache, METH_VARARGS, optim_tune_cache_doc},
    {NULL},
};

int fs_optim_add(PyObject *module, fs_mod_state *st)
{
    return PyModule_AddFunctions(module, optim_methods);
}
