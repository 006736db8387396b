/* py_helpers.c - what every glue file calls: the module's state from a
 * module or a heap type, a type added to the module, raising a core status
 * as a Python exception, a tensor's data pointer, the arguments several
 * entry points parse alike. Declared in fs_py.h; no entry points. */
#include "fs_py.h"

#include "reduce.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

fs_mod_state *fs_state_from_module(PyObject *m) { return PyModule_GetState(m); }

fs_mod_state *fs_state_from_type(PyTypeObject *tp)
{
    return PyModule_GetState(PyType_GetModuleByDef(tp, &fs_module_def));
}

int fs_add_type(PyObject *module, PyType_Spec *spec, PyObject **slot)
{
    PyObject *tp = PyType_FromModuleAndSpec(module, spec, NULL);
    const char *dot = strrchr(spec->name, '.');
    int rc = tp ? PyModule_AddObjectRef(module, dot ? dot + 1 : spec->name, tp) : -1;
    if (slot)
        *slot = tp;
    else
        Py_XDECREF(tp);
    return rc;
}

PyObject *fs_raise(fs_mod_state *st, fs_status s, const char *fmt, ...)
{
    if (s == FS_ERR_PYTHON && PyErr_Occurred())
        return NULL;
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (!msg)
        return NULL;
    PyObject *exc = s == FS_ERR_BAD_STATE ? st->StateError
                    : s == FS_ERR_NO_MEMORY ? PyExc_MemoryError
                                            : st->CoreError;
    /* A backend's error carries its own words (the ranks, the collective,
     * the cause); the status's name is added only where it has none. */
    Py_ssize_t n = PyUnicode_GET_LENGTH(msg);
    Py_UCS4 last = n ? PyUnicode_READ_CHAR(msg, n - 1) : ':';
    if (s == FS_ERR_BACKEND && last != ':' && last != ' ')
        PyErr_SetObject(exc, msg);
    else
        PyErr_Format(exc, "%U: %s", msg, fs_status_str(s));
    Py_DECREF(msg);
    return NULL;
}

PyObject *fs_result(PyObject *m, fs_status s, const char *what)
{
    if (s != FS_OK)
        return fs_raise(fs_state_from_module(m), s, "%s", what);
    Py_RETURN_NONE;
}

int fs_tensor_ptr(PyObject *tensor, void **out)
{
    static PyObject *name;
    PyObject *p = FS_NAME(name, "data_ptr") ? PyObject_CallMethodNoArgs(tensor, name) : NULL;
    if (!p)
        return -1;
    *out = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    return PyErr_Occurred() ? -1 : 0;
}

/* ---------------------------------------------------------------------------
 * argument conversion shared by the glue */

int fs_simd_arg(const char *name, const char *what)
{
    int level = fs_simd_parse(name);
    const char *sep = what ? ": " : "";
    if (level == -1)
        PyErr_Format(PyExc_ValueError, "%s%ssimd='%s': expected 'auto', 'scalar', 'avx2' or "
                     "'avx512'", what ? what : "", sep, name);
    else if (level == -2)
        PyErr_Format(PyExc_ValueError, "%s%ssimd='%s': this CPU lacks it (best: '%s')",
                     what ? what : "", sep, name, fs_simd_name(fs_simd_best()));
    return level < 0 ? -1 : level;
}

int64_t *fs_int64_list(PyObject *obj, Py_ssize_t *n, const char *what)
{
    PyObject *seq = PySequence_Fast(obj, what);
    if (!seq)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    int64_t *v = malloc(sizeof(int64_t) * (size_t)(*n ? *n : 1)), *res = NULL;
    if (!v) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        v[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v[i] == -1 && PyErr_Occurred())
            goto done;
    }
    res = v;
    v = NULL;
done:
    free(v);
    Py_DECREF(seq);
    return res;
}

Py_ssize_t fs_int64_lists(int k, PyObject *const *objs, int64_t **out, const char *what,
                          const char *const *names)
{
    Py_ssize_t n = -1;
    char msg[160], all[120] = "";
    for (int i = 0; i < k; i++)
        snprintf(all + strlen(all), sizeof all - strlen(all), "%s%s", i ? ", " : "", names[i]);
    int i = 0;
    for (; i < k; i++) {
        Py_ssize_t m = n;
        snprintf(msg, sizeof msg, "%s: %s must be a sequence of ints", what, names[i]);
        out[i] = objs[i] && objs[i] != Py_None ? fs_int64_list(objs[i], &m, msg) : NULL;
        if (objs[i] && objs[i] != Py_None && !out[i])
            break;
        if (n >= 0 && m != n) {
            PyErr_Format(PyExc_ValueError, "%s: %s differ in length", what, all);
            free(out[i++]);
            break;
        }
        n = m;
    }
    if (i == k)
        return n < 0 ? 0 : n;
    while (i-- > 0)
        free(out[i]);
    return -1;
}

PyObject *fs_weak_get(PyObject *ref)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *o = NULL;
    return PyWeakref_GetRef(ref, &o) < 0 ? NULL : o;
#else
    PyObject *o = PyWeakref_GetObject(ref); /* borrowed */
    if (!o || o == Py_None)
        return NULL;
    return Py_NewRef(o);
#endif
}
