/* tensor.c - the two reads of a torch tensor that the hooks make per
 * parameter: whether it requires grad, and whether gradient hooks wait on
 * it. Attribute names interned once (FS_NAME). */
#include "tensor.h"

int fs_hooks_requires_grad(PyObject *t)
{
    static PyObject *name;
    PyObject *v = FS_NAME(name, "requires_grad") ? PyObject_GetAttr(t, name) : NULL;
    if (!v)
        return -1;
    int r = v == Py_True ? 1 : v == Py_False ? 0 : PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

int fs_hooks_grad_hooks_due(PyObject *t)
{
    static PyObject *name;
    PyObject *h = FS_NAME(name, "_post_accumulate_grad_hooks") ? PyObject_GetAttr(t, name) : NULL;
    if (!h) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int due = h != Py_None ? PyObject_IsTrue(h) : 0;
    Py_DECREF(h);
    return due;
}
