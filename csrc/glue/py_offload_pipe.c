/* py_offload_pipe.c - flatshard._C.OffloadPipe: the engine's fs_offload_pipe
 * (engine/offload_pipe.h) as a Python object, owned by one model's
 * pipelined offload (python/flatshard/offload_pipeline.py). It parses what
 * the host hands in (a slot's Adam jobs as pointers, the engine groups to
 * attach to slots) and calls the engine; the queue, the worker, the bound
 * and the waits are the engine's. The groups attached are kept alive here
 * and detached (their core's gate cleared) at close() or dealloc. */
#include "group_object.h"

#include "offload_pipe.h"

typedef struct {
    PyObject_HEAD
    fs_offload_pipe *p;
    int nslots;
    PyObject **attached; /* (nslots) the group attached to each slot, or NULL */
} PipeObject;

static void *pipe_unlock(void) { return PyEval_SaveThread(); }
static void pipe_lock(void *saved) { PyEval_RestoreThread(saved); }

static PyObject *Pipe_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"max_units", "nslots", NULL};
    int max_units, nslots;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ii:OffloadPipe", kwlist, &max_units, &nslots))
        return NULL;
    if (max_units < 1 || nslots < 1)
        return PyErr_Format(PyExc_ValueError, "OffloadPipe(max_units=%d, nslots=%d): both must "
                            "be >= 1", max_units, nslots);
    PipeObject *self = (PipeObject *)tp->tp_alloc(tp, 0);
    if (!self)
        return NULL;
    self->nslots = nslots;
    self->attached = PyMem_Calloc((size_t)nslots, sizeof *self->attached);
    if (!self->attached) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    fs_status s = fs_offload_pipe_new(max_units, nslots, &self->p);
    if (s != FS_OK) {
        Py_DECREF(self);
        return fs_raise(fs_state_from_type(tp), s, "OffloadPipe: could not start its thread");
    }
    return (PyObject *)self;
}

/* Every group detached (its gathers no longer wait), every step run. */
static void pipe_close(PipeObject *self)
{
    if (self->p) {
        Py_BEGIN_ALLOW_THREADS
        fs_offload_pipe_free(self->p);
        Py_END_ALLOW_THREADS
        self->p = NULL;
    }
    for (int i = 0; self->attached && i < self->nslots; i++) {
        PyObject *g = self->attached[i];
        if (g) {
            fs_group_attach_gate(FS_GROUP(g)->core, NULL, 0);
            self->attached[i] = NULL;
            Py_DECREF(g);
        }
    }
}

static void Pipe_dealloc(PipeObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    pipe_close(self);
    PyMem_Free(self->attached);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static int check_open(PipeObject *self, const char *op)
{
    if (self->p)
        return 0;
    PyErr_Format(PyExc_ValueError, "OffloadPipe.%s: the pipe is closed", op);
    return -1;
}

static int check_slot(PipeObject *self, int slot, int any, const char *op)
{
    if (slot >= (any ? -1 : 0) && slot < self->nslots)
        return 0;
    PyErr_Format(PyExc_ValueError, "OffloadPipe.%s: slot=%d, expected 0..%d%s", op, slot,
                 self->nslots - 1, any ? " or -1 (every slot)" : "");
    return -1;
}

static PyObject *failed(PipeObject *self, fs_status s, const char *op)
{
    return fs_raise(fs_state_from_type(Py_TYPE(self)), s, "OffloadPipe.%s: %s", op,
                    fs_offload_pipe_error(self->p)[0] ? fs_offload_pipe_error(self->p)
                                                      : "refused");
}

PyDoc_STRVAR(attach_doc, "attach(slot, group)\n"
             "group (a flatshard._C.Unit or ShardGroup) waits for slot's steps before each\n"
             "gather from now on ([Note: step before gather]); a group attached before to the\n"
             "slot is detached. The group is kept alive until close().");
static PyObject *Pipe_attach(PipeObject *self, PyObject *args)
{
    int slot;
    PyObject *g;
    if (!PyArg_ParseTuple(args, "iO:attach", &slot, &g) || check_open(self, "attach") < 0 ||
        check_slot(self, slot, 0, "attach") < 0)
        return NULL;
    fs_mod_state *st = fs_state_from_type(Py_TYPE(self));
    if (!PyObject_TypeCheck(g, (PyTypeObject *)st->UnitType) &&
        !PyObject_TypeCheck(g, (PyTypeObject *)st->ShardGroupType))
        return PyErr_Format(PyExc_TypeError, "OffloadPipe.attach: group must be a "
                            "flatshard._C.Unit or ShardGroup, not %s", Py_TYPE(g)->tp_name);
    fs_group_core *core = FS_GROUP(g)->core;
    if (fs_group_attach_gate(core, fs_offload_pipe_gate(self->p), slot) != FS_OK)
        return PyErr_Format(PyExc_ValueError, "OffloadPipe.attach: group '%s' is attached to "
                            "another pipe", core->name);
    PyObject *old = self->attached[slot];
    if (old && old != g)
        fs_group_attach_gate(FS_GROUP(old)->core, NULL, 0);
    self->attached[slot] = Py_NewRef(g);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(submit_doc,
             "submit(slot, jobs, *, lr, beta1, beta2, eps, weight_decay, decoupled, maximize,\n"
             "       threads=1, simd='auto', bounded=True)\n"
             "Queue slot's Adam/AdamW steps: jobs as adam_steps takes them, (param, grad,\n"
             "exp_avg, exp_avg_sq, max_exp_avg_sq, step, n); the step counts are incremented\n"
             "now, the updates run on the pipe's thread. bounded: block (without the GIL)\n"
             "while max_units other slots are in flight. Every buffer must stay alive until\n"
             "the slot's steps have run.");
static PyObject *Pipe_submit(PipeObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"slot", "jobs", "lr", "beta1", "beta2", "eps", "weight_decay",
                             "decoupled", "maximize", "threads", "simd", "bounded", NULL};
    int slot, decoupled = 1, maximize = 0, threads = 1, bounded = 1;
    float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.0f;
    const char *simd = "auto";
    PyObject *jobs;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO|$fffffppisp:submit", kwlist, &slot, &jobs, &lr,
                                     &b1, &b2, &eps, &wd, &decoupled, &maximize, &threads, &simd,
                                     &bounded)
        || check_open(self, "submit") < 0 || check_slot(self, slot, 0, "submit") < 0)
        return NULL;
    int level = fs_simd_arg(simd, "OffloadPipe.submit");
    if (level < 0)
        return NULL;
    if (threads < 1)
        return PyErr_Format(PyExc_ValueError, "OffloadPipe.submit: threads=%d, expected >= 1",
                            threads);
    const fs_optim_job proto = {FS_OPTIM_ADAM, {0}, {lr, b1, b2, eps, wd, 1, decoupled, maximize}};
    fs_optim_job *js;
    float **steps;
    Py_ssize_t k = fs_glue_optim_jobs(jobs, "OffloadPipe.submit", &proto, &js, &steps);
    if (k < 0)
        return NULL;
    fs_status s = fs_offload_pipe_submit(self->p, slot, js, steps, (int)k, (fs_simd)level,
                                         threads, bounded, pipe_unlock, pipe_lock);
    PyMem_Free(js);
    PyMem_Free(steps);
    return s == FS_OK ? Py_NewRef(Py_None) : failed(self, s, "submit");
}

PyDoc_STRVAR(wait_doc, "wait(slot=-1)\n"
             "Until every step of slot (-1: of every slot) has run (without the GIL); a failed\n"
             "step raises CoreError, here and at every later call.");
static PyObject *Pipe_wait(PipeObject *self, PyObject *args)
{
    int slot = -1;
    if (!PyArg_ParseTuple(args, "|i:wait", &slot) || check_open(self, "wait") < 0 ||
        check_slot(self, slot, 1, "wait") < 0)
        return NULL;
    fs_status s = fs_offload_pipe_wait(self->p, slot, pipe_unlock, pipe_lock);
    return s == FS_OK ? Py_NewRef(Py_None) : failed(self, s, "wait");
}

PyDoc_STRVAR(busy_doc, "busy(slot=-1) -> bool: slot (-1: any) has a step not run yet.");
static PyObject *Pipe_busy(PipeObject *self, PyObject *args)
{
    int slot = -1;
    if (!PyArg_ParseTuple(args, "|i:busy", &slot) || check_open(self, "busy") < 0 ||
        check_slot(self, slot, 1, "busy") < 0)
        return NULL;
    return PyBool_FromLong(fs_offload_pipe_busy(self->p, slot));
}

PyDoc_STRVAR(stats_doc, "stats() -> dict: the pipe's counts (engine/offload_pipe.h).");
static PyObject *Pipe_stats(PipeObject *self, PyObject *noargs)
{
    if (check_open(self, "stats") < 0)
        return NULL;
    fs_offload_pipe_stats t;
    fs_offload_pipe_get_stats(self->p, &t);
    return Py_BuildValue("{si,si,si,sL,sL,sL,sL,sL,sd,sd}", "max_units", t.max_units,
                         "units_in_flight", t.units_in_flight, "peak_units_in_flight",
                         t.peak_units_in_flight, "grad_bytes_in_flight",
                         (long long)t.grad_bytes_in_flight, "peak_grad_bytes_in_flight",
                         (long long)t.peak_grad_bytes_in_flight, "steps_run",
                         (long long)t.steps_run, "submits_blocked", (long long)t.submits_blocked,
                         "gathers_waited", (long long)t.gathers_waited, "step_s", t.step_s,
                         "wait_s", t.wait_s);
}

PyDoc_STRVAR(close_doc, "close()\n"
             "Every step run, the thread stopped, every group detached. Idempotent.");
static PyObject *Pipe_close(PipeObject *self, PyObject *noargs)
{
    pipe_close(self);
    Py_RETURN_NONE;
}

static PyMethodDef Pipe_methods[] = {
    {"attach", (PyCFunction)Pipe_attach, METH_VARARGS, attach_doc},
    {"submit", (PyCFunction)(void (*)(void))Pipe_submit, METH_VARARGS | METH_KEYWORDS,
     submit_doc},
    {"wait", (PyCFunction)Pipe_wait, METH_VARARGS, wait_doc},
    {"busy", (PyCFunction)Pipe_busy, METH_VARARGS, busy_doc},
    {"stats", (PyCFunction)Pipe_stats, METH_NOARGS, stats_doc},
    {"close", (PyCFunction)Pipe_close, METH_NOARGS, close_doc},
    {NULL},
};

static PyType_Slot Pipe_slots[] = {
    {Py_tp_new, Pipe_new},
    {Py_tp_dealloc, Pipe_dealloc},
    {Py_tp_methods, Pipe_methods},
    {Py_tp_doc, "OffloadPipe(max_units, nslots): the pipelined offload step's queue and host "
                "thread (engine/offload_pipe.h)."},
    {0, NULL},
};

static PyType_Spec Pipe_spec = {
    "flatshard._C.OffloadPipe", sizeof(PipeObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, Pipe_slots,
};

int fs_offload_pipe_type_add(PyObject *module, fs_mod_state *st)
{
    return fs_add_type(module, &Pipe_spec, NULL);
}
