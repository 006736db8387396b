/* grads.c - the tensors of a fully_shard group's reduction, found from
 * the fields Python handed ([Note: post-backward in C], grads.h). Reads
 * only these fields and torch's tensor API (grad, dtype, shape,
 * is_contiguous, contiguous, new_empty, requires_grad, DTensor's
 * _local_tensor, _post_accumulate_grad_hooks). */
#include "grads.h"

#include "tensor.h"

#include <stdlib.h>
#include <string.h>

/* Emptied first, released after ([Note: handed fields] in glue/shard_group_object.h). */
void fs_grads_clear(fs_grads *q)
{
    fs_grads old = *q;
    memset(q, 0, sizeof *q);
    Py_XDECREF(old.codes);
    Py_XDECREF(old.tensor);
    Py_XDECREF(old.specs);
    Py_XDECREF(old.make);
    Py_XDECREF(old.cls);
    Py_XDECREF(old.like);
    Py_XDECREF(old.empty);
    Py_XDECREF(old.run_hooks);
    Py_XDECREF(old.fresh);
    Py_XDECREF(old.written);
    free(old.gh);
    free(old.gt);
    free(old.acc);
}

int fs_grads_traverse(const fs_grads *q, visitproc visit, void *arg)
{
    Py_VISIT(q->codes);
    Py_VISIT(q->tensor);
    Py_VISIT(q->specs);
    Py_VISIT(q->make);
    Py_VISIT(q->cls);
    Py_VISIT(q->like);
    Py_VISIT(q->empty);
    Py_VISIT(q->run_hooks);
    Py_VISIT(q->fresh);
    Py_VISIT(q->written);
    return 0;
}

int fs_grads_set(fs_grads *q, int n, PyObject *codes, PyObject *tensor, PyObject *specs,
                 PyObject *make, PyObject *cls, PyObject *like, PyObject *empty,
                 PyObject *run_hooks)
{
    if (!PyDict_Check(codes) || !PyType_Check(tensor) || !PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "set_grads: codes is a dict, tensor and cls are types");
        return -1;
    }
    PyObject *st = PySequence_Tuple(specs);
    if (!st)
        return -1;
    if (PyTuple_GET_SIZE(st) != n) {
        Py_DECREF(st);
        PyErr_Format(PyExc_ValueError, "set_grads: %d specs expected", n);
        return -1;
    }
    const size_t k = n ? (size_t)n : 1;
    void **gh = calloc(2 * k, sizeof *gh);
    fs_dtype *gt = calloc(2 * k, sizeof *gt);
    int *acc = calloc(k, sizeof *acc);
    if (!gh || !gt || !acc) {
        free(gh);
        free(gt);
        free(acc);
        Py_DECREF(st);
        PyErr_NoMemory();
        return -1;
    }
    fs_grads keep = *q; /* the settings and a reduction in flight stay */
    memset(q, 0, sizeof *q);
    q->n = n;
    q->codes = Py_NewRef(codes);
    q->tensor = Py_NewRef(tensor);
    q->specs = st;
    q->make = Py_NewRef(make);
    q->cls = Py_NewRef(cls);
    q->like = Py_NewRef(like);
    q->empty = Py_NewRef(empty);
    q->run_hooks = Py_NewRef(run_hooks);
    q->gh = gh;
    q->oh = gh + k;
    q->gt = gt;
    q->ot = gt + k;
    q->acc = acc;
    q->factor = keep.factor;
    q->force_sum = keep.force_sum;
    q->all_reduce = keep.all_reduce;
    q->hold = keep.hold;
    q->unused = keep.unused;
    q->fresh = keep.fresh;
    q->written = keep.written;
    keep.fresh = keep.written = NULL;
    fs_grads_clear(&keep);
    return 0;
}

/* A tensor's engine dtype code: 0 and *code set, 1 for a dtype the table
 * lacks, -1 with an exception. */
static int code_of(const fs_grads *q, PyObject *t, fs_dtype *code)
{
    static PyObject *s_dtype;
    PyObject *dt = FS_NAME(s_dtype, "dtype") ? PyObject_GetAttr(t, s_dtype) : NULL;
    if (!dt)
        return -1;
    PyObject *c = PyDict_GetItemWithError(q->codes, dt);
    Py_DECREF(dt);
    if (!c)
        return PyErr_Occurred() ? -1 : 1;
    long v = PyLong_AsLong(c);
    if (v < 0 || v >= FS_DTYPE_COUNT)
        return PyErr_Occurred() ? -1 : 1;
    *code = (fs_dtype)v;
    return 0;
}

/* t, or a contiguous copy of it (a new reference either way). */
static PyObject *contiguous(PyObject *t)
{
    static PyObject *s_is, *s_make;
    PyObject *r = FS_NAME(s_is, "is_contiguous") ? PyObject_CallMethodNoArgs(t, s_is) : NULL;
    if (!r)
        return NULL;
    int yes = r == Py_True;
    Py_DECREF(r);
    if (yes)
        return Py_NewRef(t);
    return FS_NAME(s_make, "contiguous") ? PyObject_CallMethodNoArgs(t, s_make) : NULL;
}


/* Whether a and b have the same shape; -1 with an exception. */
static int same_shape(PyObject *a, PyObject *b)
{
    static PyObject *s_shape;
    if (!FS_NAME(s_shape, "shape"))
        return -1;
    PyObject *x = PyObject_GetAttr(a, s_shape), *y = x ? PyObject_GetAttr(b, s_shape) : NULL;
    int r = y ? PyObject_RichCompareBool(x, y, Py_EQ) : -1;
    Py_XDECREF(x);
    Py_XDECREF(y);
    return r;
}

/* A new shard for parameter i's reduction output, like its local tensor. */
static PyObject *new_shard(const fs_grads *q, PyObject *local)
{
    static PyObject *s_shape, *s_new;
    if (Py_TYPE(local) != (PyTypeObject *)q->tensor)
        return PyObject_CallOneArg(q->empty, local);
    PyObject *shape = FS_NAME(s_shape, "shape") ? PyObject_GetAttr(local, s_shape) : NULL;
    PyObject *r = shape && FS_NAME(s_new, "new_empty")
        ? PyObject_CallMethodOneArg(local, s_new, shape) : NULL;
    Py_XDECREF(shape);
    return r;
}

/* Parameter i's gradient and output into q's scratch. The references go
 * into keep; the parameters whose .grad to drop into drop; a new shard's
 * (i, out) into fresh, the sharded parameter written into written. Returns
 * 1 when it takes part, 0 when not, FS_GRADS_ASK + 8 for a gradient Python
 * must hand, -1 with an exception. */
static int collect_one(fs_grads *q, const fs_params *p, int i, PyObject *over, PyObject *keep,
                       PyObject *drop, PyObject *fresh, PyObject *written)
{
    static PyObject *s_grad, *s_local;
    PyObject *sp = PyTuple_GET_ITEM(p->sharded, i);
    PyObject *up = p->unsharded ? PyTuple_GET_ITEM(p->unsharded, i) : Py_None;
    PyObject *g = NULL;
    int r = -1;
    if (up != Py_None) {
        PyObject *own = FS_NAME(s_grad, "grad") ? PyObject_GetAttr(up, s_grad) : NULL;
        if (!own)
            return -1;
        if (own != Py_None && PyList_Append(drop, up) < 0) {
            Py_DECREF(own);
            return -1;
        }
        if (over == Py_None && own != Py_None) {
            if (Py_TYPE(own) != (PyTypeObject *)q->tensor) {
                Py_DECREF(own);
                return FS_GRADS_ASK + 8;
            }
            g = Py_NewRef(own);
        }
        Py_DECREF(own);
    }
    if (over != Py_None)
        g = Py_NewRef(over);
    q->gh[i] = q->oh[i] = NULL;
    q->acc[i] = 0;
    if (g) {
        int c = code_of(q, g, &q->gt[i]);
        if (c) {
            Py_DECREF(g);
            return c < 0 ? -1 : FS_GRADS_ASK + 8;
        }
        PyObject *gc = contiguous(g);
        Py_DECREF(g);
        if (!gc || PyList_Append(keep, gc) < 0) {
            Py_XDECREF(gc);
            return -1;
        }
        Py_DECREF(gc); /* keep holds it */
        g = gc;
        q->gh[i] = g;
    }
    int takes = g != NULL;
    if (!takes && q->unused && (takes = fs_hooks_requires_grad(sp)) < 0)
        return -1;
    if (!takes || !q->all_reduce)
        return takes;
    PyObject *cur = FS_NAME(s_grad, "grad") ? PyObject_GetAttr(sp, s_grad) : NULL;
    PyObject *out = NULL, *local = PyTuple_GET_ITEM(p->locals, i);
    if (!cur)
        return -1;
    int made = 0;
    if (cur != Py_None) {
        out = FS_NAME(s_local, "_local_tensor") ? PyObject_GetAttr(cur, s_local) : NULL;
        q->acc[i] = 1;
    } else {
        fs_dtype lt;
        int c;
        if (q->alone && g && Py_TYPE(g) == (PyTypeObject *)q->tensor &&
            (c = code_of(q, local, &lt)) == 0 && lt == q->gt[i] && lt == q->rcode) {
            int same = same_shape(g, local);
            if (same < 0)
                goto out;
            if (same)
                out = Py_NewRef(g); /* one rank: the new sharded gradient is the gradient */
        }
        if (!out && !PyErr_Occurred())
            out = new_shard(q, local);
        made = 1;
    }
    if (!out)
        goto out;
    int c = code_of(q, out, &q->ot[i]);
    if (c) {
        if (c > 0)
            PyErr_Format(PyExc_TypeError, "reduce_grads: parameter %d's gradient shard has a "
                         "dtype the engine does not reduce into", i);
        goto out;
    }
    if (PyList_Append(keep, out) < 0 || PyList_Append(written, sp) < 0)
        goto out;
    if (made) {
        PyObject *pair = Py_BuildValue("(iO)", i, out);
        if (!pair || PyList_Append(fresh, pair) < 0) {
            Py_XDECREF(pair);
            goto out;
        }
        Py_DECREF(pair);
    }
    q->oh[i] = out;
    r = 1;
out:
    Py_DECREF(cur);
    Py_XDECREF(out);
    return r;
}

int fs_grads_collect(fs_grads *q, const fs_params *p, PyObject *over, PyObject **keep)
{
    static PyObject *s_grad;
    if (!q->codes || !p->sharded) {
        PyErr_SetString(PyExc_RuntimeError, "ShardGroup: set_params and set_grads first");
        return -1;
    }
    PyObject *ov = NULL;
    if (over && over != Py_None) {
        if (!(ov = PySequence_Fast(over, "reduce_grads: grads is a sequence")))
            return -1;
        if (PySequence_Fast_GET_SIZE(ov) != q->n) {
            Py_DECREF(ov);
            PyErr_Format(PyExc_ValueError, "reduce_grads: %d grads expected", q->n);
            return -1;
        }
    }
    PyObject *k = PyList_New(0), *drop = PyList_New(0), *fresh = PyList_New(0),
        *written = PyList_New(0);
    int r = -1, any = 0;
    if (!k || !drop || !fresh || !written || !FS_NAME(s_grad, "grad"))
        goto out;
    for (int i = 0; i < q->n; i++) {
        int t = collect_one(q, p, i, ov ? PySequence_Fast_GET_ITEM(ov, i) : Py_None, k, drop,
                            fresh, written);
        if (t < 0)
            goto out;
        if (t > 1) {
            r = t - 8;
            goto out;
        }
        any |= t;
    }
    if (!any) {
        r = FS_GRADS_NONE;
        goto out;
    }
    /* from here on, the changes: the unsharded gradients handed to the engine */
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(drop); j++) {
        PyObject *up = PyList_GET_ITEM(drop, j);
        if (PyObject_SetAttr(up, s_grad, Py_None) < 0)
            goto out;
    }
    Py_XSETREF(q->fresh, fresh);
    Py_XSETREF(q->written, written);
    fresh = written = NULL;
    *keep = k;
    k = NULL;
    r = FS_GRADS_READY;
out:
    Py_XDECREF(ov);
    Py_XDECREF(k);
    Py_XDECREF(drop);
    Py_XDECREF(fresh);
    Py_XDECREF(written);
    return r;
}

/* A sharded gradient over `out`: a DTensor with param's spec, built as
 * torch's fully_shard builds it (DTensor.__new__: __init__ adds nothing),
 * or through like() where the dtypes differ. */
static PyObject *dtensor(const fs_grads *q, PyObject *out, PyObject *spec, PyObject *param)
{
    static PyObject *kwnames;
    if (spec == Py_None)
        return PyObject_CallFunctionObjArgs(q->like, out, param, NULL);
    if (!kwnames && !(kwnames = Py_BuildValue("(s)", "requires_grad")))
        return NULL;
    PyObject *args[4] = {q->cls, out, spec, Py_False};
    return PyObject_Vectorcall(q->make, args, 3, kwnames);
}

/* Whether any of params has a post-accumulate-grad hook; -1 with an exception. */
/* 1: a parameter of the list has post-accumulate-grad hooks; 0: none; -1 */
static int any_hooks_due(PyObject *params)
{
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(params); j++) {
        int due = fs_hooks_grad_hooks_due(PyList_GET_ITEM(params, j));
        if (due)
            return due;
    }
    return 0;
}

int fs_grads_finish(fs_grads *q, const fs_params *p)
{
    static PyObject *s_grad;
    if (!q->fresh)
        return 0;
    PyObject *fresh = q->fresh, *written = q->written;
    q->fresh = q->written = NULL;
    int r = -1;
    if (!FS_NAME(s_grad, "grad"))
        goto out;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(fresh); j++) {
        PyObject *pair = PyList_GET_ITEM(fresh, j);
        long i = PyLong_AsLong(PyTuple_GET_ITEM(pair, 0));
        if (i < 0 || i >= q->n) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "reduce_grads: parameters changed");
            goto out;
        }
        PyObject *sp = PyTuple_GET_ITEM(p->sharded, i);
        PyObject *dt = dtensor(q, PyTuple_GET_ITEM(pair, 1), PyTuple_GET_ITEM(q->specs, i), sp);
        int s = dt ? PyObject_SetAttr(sp, s_grad, dt) : -1;
        Py_XDECREF(dt);
        if (s < 0)
            goto out;
    }
    int due = any_hooks_due(written);
    if (due < 0)
        goto out;
    if (due) {
        PyObject *v = PyObject_CallOneArg(q->run_hooks, written);
        if (!v)
            goto out;
        Py_DECREF(v);
    }
    r = 0;
out:
    Py_DECREF(fresh);
    Py_DECREF(written);
    return r;
}

void fs_grads_drop(fs_grads *q)
{
    Py_CLEAR(q->fresh);
    Py_CLEAR(q->written);
}
