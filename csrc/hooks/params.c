/* params.c - a fully_shard group's registration of its parameters on its
 * modules, run from the fields Python handed ([Note: registration in C],
 * params.h). Reads only these fields and torch's tensor API
 * (requires_grad; DTensor's _local_tensor, which torch's fully_shard reads
 * the same way). */
#include "params.h"

#include "tensor.h"

#include <stdlib.h>
#include <string.h>

/* Emptied first, released after ([Note: handed fields] in glue/shard_group_object.h). */
void fs_params_clear(fs_params *p)
{
    fs_params old = *p;
    memset(p, 0, sizeof *p);
    for (Py_ssize_t s = 0; s < old.nslots; s++) {
        Py_XDECREF(old.dicts[s]);
        Py_XDECREF(old.keys[s]);
    }
    free(old.dicts);
    free(old.keys);
    free(old.index);
    free(old.head);
    free(old.quick);
    free(old.train);
    free(old.hooked);
    Py_XDECREF(old.sharded);
    Py_XDECREF(old.locals);
    Py_XDECREF(old.unsharded);
}

int fs_params_traverse(const fs_params *p, visitproc visit, void *arg)
{
    for (Py_ssize_t s = 0; s < p->nslots; s++) {
        Py_VISIT(p->dicts[s]);
        Py_VISIT(p->keys[s]);
    }
    Py_VISIT(p->sharded);
    Py_VISIT(p->locals);
    Py_VISIT(p->unsharded);
    return 0;
}

static PyObject *tuple_of(PyObject *seq, int n, const char *what)
{
    PyObject *t = PySequence_Tuple(seq);
    if (t && PyTuple_GET_SIZE(t) != n) {
        PyErr_Format(PyExc_ValueError, "ShardGroup.set_params: %s: %d expected, not %zd", what,
                     n, PyTuple_GET_SIZE(t));
        Py_CLEAR(t);
    }
    return t;
}

int fs_params_set(fs_params *p, int n, PyObject *slots, PyObject *sharded, PyObject *locals,
                  PyObject *quick)
{
    fs_params q = {0};
    q.n = n;
    PyObject *st = PySequence_Tuple(slots), *qt = NULL;
    if (!st)
        return -1;
    if (!(q.sharded = tuple_of(sharded, n, "sharded")) ||
        !(q.locals = tuple_of(locals, n, "locals")) || !(qt = tuple_of(quick, n, "quick")))
        goto fail;
    const size_t m = (size_t)PyTuple_GET_SIZE(st), k = n ? (size_t)n : 1;
    q.dicts = calloc(m ? m : 1, sizeof *q.dicts);
    q.keys = calloc(m ? m : 1, sizeof *q.keys);
    q.index = calloc(m ? m : 1, sizeof *q.index);
    q.head = malloc(k * sizeof *q.head);
    q.quick = calloc(k, 1);
    q.train = calloc(k, 1);
    q.hooked = calloc(k, 1);
    if (!q.dicts || !q.keys || !q.index || !q.head || !q.quick || !q.train || !q.hooked) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int i = 0; i < n; i++) {
        q.head[i] = -1;
        int v = PyObject_IsTrue(PyTuple_GET_ITEM(qt, i));
        if (v < 0)
            goto fail;
        q.quick[i] = (unsigned char)v;
    }
    for (size_t s = 0; s < m; s++) {
        PyObject *d, *key;
        int i;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(st, s), "O!Ui;ShardGroup.set_params: slots are "
                              "(dict, name, index)", &PyDict_Type, &d, &key, &i))
            goto fail;
        if (i < 0 || i >= n) {
            PyErr_Format(PyExc_ValueError, "ShardGroup.set_params: slot index %d of %d", i, n);
            goto fail;
        }
        q.dicts[s] = Py_NewRef(d);
        q.keys[s] = Py_NewRef(key);
        q.index[s] = i;
        q.nslots = (Py_ssize_t)s + 1;
        if (q.head[i] < 0)
            q.head[i] = (Py_ssize_t)s;
    }
    for (int i = 0; i < n; i++)
        if (q.head[i] < 0) {
            PyErr_Format(PyExc_ValueError, "ShardGroup.set_params: parameter %d has no slot", i);
            goto fail;
        }
    Py_DECREF(st);
    Py_DECREF(qt);
    /* the new registration in place whole, then the old one released: its
     * local tensors die here ([Note: handed fields] in glue/shard_group_object.h) */
    fs_params old = *p;
    *p = q;
    fs_params_clear(&old);
    return 0;
fail:
    Py_DECREF(st);
    Py_XDECREF(qt);
    fs_params_clear(&q);
    return -1;
}

int fs_params_set_unsharded(fs_params *p, PyObject *unsharded)
{
    PyObject *t = tuple_of(unsharded, p->n, "unsharded");
    if (!t)
        return -1;
    for (int i = 0; i < p->n; i++)
        if (!p->unsharded || PyTuple_GET_ITEM(p->unsharded, i) != PyTuple_GET_ITEM(t, i))
            p->hooked[i] = 0;
    Py_XSETREF(p->unsharded, t);
    return 0;
}

static int store(fs_params *p, PyObject *params)
{
    for (Py_ssize_t s = 0; s < p->nslots; s++)
        if (PyDict_SetItem(p->dicts[s], p->keys[s], PyTuple_GET_ITEM(params, p->index[s])) < 0)
            return -1;
    return 0;
}

int fs_params_register_sharded(fs_params *p)
{
    if (p->registered == FS_REG_SHARDED)
        return 0;
    if (!p->sharded) {
        PyErr_SetString(PyExc_RuntimeError, "ShardGroup: set_params first");
        return -1;
    }
    if (store(p, p->sharded) < 0)
        return -1;
    p->registered = FS_REG_SHARDED;
    return 0;
}

/* A tensor's requires_grad as 0 or 1, -1 with an exception. */
int fs_params_register_unsharded(fs_params *p)
{
    static PyObject *name;
    if (!p->unsharded || !p->sharded) {
        PyErr_SetString(PyExc_RuntimeError, "ShardGroup: set_params and set_unsharded first");
        return -1;
    }
    int trainable = 0;
    for (int i = 0; i < p->n; i++) {
        PyObject *up = PyTuple_GET_ITEM(p->unsharded, i);
        int rg = fs_hooks_requires_grad(PyTuple_GET_ITEM(p->sharded, i));
        if (rg < 0)
            return -1;
        p->train[i] = (unsigned char)(rg && up != Py_None);
        if (up == Py_None)
            continue;
        int urg = fs_hooks_requires_grad(up);
        if (urg < 0)
            return -1;
        if (urg != rg && (!FS_NAME(name, "requires_grad") ||
                          PyObject_SetAttr(up, name, rg ? Py_True : Py_False) < 0))
            return -1;
        trainable += rg;
    }
    p->trainable = trainable; /* the gradient hooks that fire in this backward */
    if (store(p, p->unsharded) < 0)
        return -1;
    p->registered = FS_REG_UNSHARDED;
    return 0;
}

/* Whether a tensor has instance attributes (a plain tensor's __dict__ is
 * empty unless it was given some); -1 with an exception. */
static int has_attributes(PyObject *t)
{
    PyObject *d = PyObject_GenericGetDict(t, NULL);
    if (!d)
        return -1;
    int r = PyDict_Check(d) && PyDict_GET_SIZE(d) > 0;
    Py_DECREF(d);
    return r;
}

int fs_params_changed(fs_params *p)
{
    static PyObject *local_name;
    if (p->registered == FS_REG_UNSHARDED)
        return FS_PARAMS_SAME;
    if (!p->sharded)
        return FS_PARAMS_ASSIGNED;
    int open = 0;
    for (int i = 0; i < p->n; i++) {
        const Py_ssize_t s = p->head[i];
        PyObject *sp = PyTuple_GET_ITEM(p->sharded, i);
        PyObject *now = PyDict_GetItemWithError(p->dicts[s], p->keys[s]);
        if (now != sp)
            return PyErr_Occurred() ? -1 : FS_PARAMS_ASSIGNED;
        PyObject *local = FS_NAME(local_name, "_local_tensor")
            ? PyObject_GetAttr(sp, local_name) : NULL;
        if (!local)
            return -1;
        int attrs = local != PyTuple_GET_ITEM(p->locals, i) ? -2 : has_attributes(local);
        Py_DECREF(local);
        if (attrs == -2)
            return FS_PARAMS_ASSIGNED;
        if (attrs < 0)
            return -1;
        open |= attrs || !p->quick[i];
    }
    return open ? FS_PARAMS_OPEN : FS_PARAMS_SAME;
}

int fs_params_needs_hooks(const fs_params *p)
{
    for (int i = 0; i < p->n; i++)
        if (p->train[i] && !p->hooked[i])
            return 1;
    return 0;
}

PyObject *fs_params_take_unhooked(fs_params *p)
{
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < p->n; i++) {
        if (!p->train[i] || p->hooked[i])
            continue;
        PyObject *v = PyLong_FromLong(i);
        if (!v || PyList_Append(out, v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(v);
        if (out)
            p->hooked[i] = 1;
    }
    return out;
}

int fs_params_unsharded_grads(const fs_params *p)
{
    static PyObject *name;
    for (int i = 0; p->unsharded && i < p->n; i++) {
        PyObject *u = PyTuple_GET_ITEM(p->unsharded, i);
        if (u == Py_None)
            continue;
        PyObject *g = FS_NAME(name, "grad") ? PyObject_GetAttr(u, name) : NULL;
        if (!g)
            return -1;
        Py_DECREF(g);
        if (g != Py_None)
            return 1;
    }
    return 0;
}
