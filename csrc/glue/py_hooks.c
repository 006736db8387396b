/* py_hooks.c - flatshard._C.Hook: a torch hook whose common case runs in C
 * and whose every other case is the Python hook it was made with.
 *
 * Both wrappers register Hook objects where they registered Python hooks:
 * fully_shard (fsdp2/state.py) its modules' forward pre-hook and forward
 * hook, the pre-backward hook on their outputs' grad_fn and each unsharded
 * parameter's post-accumulate-grad hook; the FSDP1 wrapper (fsdp/unit.py)
 * its forward's pre- and post-steps, the pre-backward hook and each flat
 * buffer's post-accumulate-grad hook. torch calls a Hook as any callable
 * (vectorcall: no Python frame). What an event does in the common case is
 * engine work and dictionary stores, which its lane (py_hooks_shard.c,
 * py_hooks_unit.c) does here; anything else goes to the Python hook with
 * the same arguments. Nothing here shards, gathers, frees or reduces by
 * itself: the lanes call the engine objects' methods, as Python does.
 *
 * This file: the type, its dispatch to the lanes, the torch functions they
 * call (set_hook_tools) and their shared helpers. */
#include <stddef.h>

#include "py_hooks.h"
#include "structmember.h"

fs_hook_tools fs_hooks;

static PyObject *s_grad_fn, *s_register_prehook, *s_pahooks;

int fs_hook_truth(PyObject *fn)
{
    if (fn == Py_None)
        return 0;
    PyObject *r = PyObject_CallNoArgs(fn);
    if (!r)
        return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

int fs_hook_watched(void)
{
    int t = fs_hook_truth(fs_hooks.profiling);
    return t != 0 ? t : fs_hook_truth(fs_hooks.stack_len);
}

int fs_hook_attr_true(PyObject *o, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v)
        return -1;
    int t = v == Py_True;
    Py_DECREF(v);
    return t;
}

PyObject *fs_hook_method(PyObject *o, PyObject *name, PyObject *arg)
{
    PyObject *args[2] = {o, arg};
    return PyObject_VectorcallMethod(name, args, (arg ? 2 : 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                     NULL);
}

int fs_hook_call(PyObject *o, PyObject *name, PyObject *arg)
{
    PyObject *r = fs_hook_method(o, name, arg);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

int fs_hook_append_new(PyObject *list, PyObject *o)
{
    if (!o)
        return -1;
    int rc = PyList_Append(list, o);
    Py_DECREF(o);
    return rc;
}

int fs_hook_set_int(PyObject *d, PyObject *name, long long value)
{
    PyObject *v = PyLong_FromLongLong(value);
    if (!v)
        return -1;
    int rc = PyDict_SetItem(d, name, v);
    Py_DECREF(v);
    return rc;
}

int fs_hook_register(PyObject *slots, PyObject *params)
{
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(slots); k++) {
        PyObject *s = PyList_GET_ITEM(slots, k);
        if (!PyTuple_CheckExact(s) || PyTuple_GET_SIZE(s) != 3) {
            PyErr_SetString(PyExc_TypeError, "Hook: a parameter slot must be (dict, name, index)");
            return -1;
        }
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(s, 2));
        if (i < 0 || i >= PySequence_Fast_GET_SIZE(params)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "Hook: a parameter slot's index is out of range");
            return -1;
        }
        if (PyObject_SetItem(PyTuple_GET_ITEM(s, 0), PyTuple_GET_ITEM(s, 1),
                             PySequence_Fast_GET_ITEM(params, i)) < 0)
            return -1;
    }
    return 0;
}

int fs_hook_outputs(PyObject *output, PyObject *pre_backward)
{
    PyObject *r;
    if (Py_TYPE(output) == (PyTypeObject *)fs_hooks.tensor_type) {
        PyObject *fn = PyObject_GetAttr(output, s_grad_fn);
        if (!fn)
            return -1;
        if (fn == Py_None) {
            Py_DECREF(fn);
            r = PyObject_CallFunctionObjArgs(fs_hooks.hook_outputs, output, pre_backward, NULL);
        } else {
            r = fs_hook_method(fn, s_register_prehook, pre_backward);
            Py_DECREF(fn);
        }
    } else {
        r = PyObject_CallFunctionObjArgs(fs_hooks.hook_outputs, output, pre_backward, NULL);
    }
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

int fs_hook_run_param_hooks(PyObject *params)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
        PyObject *d = PyObject_GetAttr(PyList_GET_ITEM(params, i), s_pahooks);
        if (!d) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear();
            continue;
        }
        int has = d != Py_None ? PyObject_IsTrue(d) : 0;
        Py_DECREF(d);
        if (has < 0)
            return -1;
        if (has) { /* one has: run_hooks runs each parameter's, in order */
            PyObject *r = PyObject_CallOneArg(fs_hooks.run_hooks, params);
            if (!r)
                return -1;
            Py_DECREF(r);
            return 0;
        }
    }
    return 0;
}

static PyObject *Hook_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames)
{
    HookObject *h = (HookObject *)self;
    if (kwnames && PyTuple_GET_SIZE(kwnames)) {
        h->passed++;
        return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
    }
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    return h->kind < HOOK_UNIT_PRE_FORWARD ? fs_hook_shard_call(h, args, nargs)
                                           : fs_hook_unit_call(h, args, nargs);
}

static PyObject *Hook_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"kind", "state", "group", "fallback", "then", "owner", NULL};
    int kind;
    PyObject *state, *group, *fallback, *then = Py_None, *owner = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO!OO|OO:Hook", kwlist, &kind, &PyDict_Type,
                                     &state, &group, &fallback, &then, &owner))
        return NULL;
    if (kind < 0 || kind >= HOOK_NKIND)
        return PyErr_Format(PyExc_ValueError, "Hook: kind must be one of flatshard._C's HOOK_* "
                            "constants (0 to %d), not %d", HOOK_NKIND - 1, kind);
    if (group != Py_None && !PyDict_Check(group))
        return PyErr_Format(PyExc_TypeError, "Hook: group must be the group's __dict__ or None");
    if (!PyCallable_Check(fallback))
        return PyErr_Format(PyExc_TypeError, "Hook: fallback must be callable");
    if ((kind == HOOK_POST_FORWARD || kind == HOOK_UNIT_POST_FORWARD) && !PyCallable_Check(then))
        return PyErr_Format(PyExc_TypeError, "Hook: a post-forward hook's `then` must be the "
                            "pre-backward hook it registers");
    if (kind == HOOK_ARRIVE && (!PyLong_CheckExact(then) || group == Py_None))
        return PyErr_Format(PyExc_TypeError, "Hook: an arrival hook needs the group and its "
                            "parameter's index as `then`");
    if (kind == HOOK_UNIT_POST_BACKWARD && !PyLong_CheckExact(then))
        return PyErr_Format(PyExc_TypeError, "Hook: a unit's post-backward hook needs its "
                            "group's index as `then`");
    if (kind >= HOOK_UNIT_PRE_FORWARD && owner == Py_None)
        return PyErr_Format(PyExc_TypeError, "Hook: a unit's hook needs the unit as `owner`");
    if (!fs_hooks.tensor_type)
        return PyErr_Format(PyExc_RuntimeError, "Hook: set_hook_tools() was not called");
    if ((!s_grad_fn && !FS_NAME(s_grad_fn, "grad_fn")) ||
        (!s_register_prehook && !FS_NAME(s_register_prehook, "register_prehook")) ||
        (!s_pahooks && !FS_NAME(s_pahooks, "_post_accumulate_grad_hooks")) ||
        fs_hook_shard_names() < 0 || fs_hook_unit_names() < 0)
        return NULL;
    HookObject *h = PyObject_GC_New(HookObject, tp);
    if (!h)
        return NULL;
    h->vectorcall = Hook_vectorcall;
    h->kind = kind;
    h->state = Py_NewRef(state);
    h->owner = Py_NewRef(owner);
    h->group = Py_NewRef(group);
    h->fallback = Py_NewRef(fallback);
    h->then = Py_NewRef(then);
    h->taken = h->passed = 0;
    PyObject_GC_Track(h);
    return (PyObject *)h;
}

static int Hook_traverse(HookObject *h, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(h));
    Py_VISIT(h->state);
    Py_VISIT(h->owner);
    Py_VISIT(h->group);
    Py_VISIT(h->fallback);
    Py_VISIT(h->then);
    return 0;
}

static int Hook_clear(HookObject *h)
{
    Py_CLEAR(h->state);
    Py_CLEAR(h->owner);
    Py_CLEAR(h->group);
    Py_CLEAR(h->fallback);
    Py_CLEAR(h->then);
    return 0;
}

static void Hook_dealloc(HookObject *h)
{
    PyTypeObject *tp = Py_TYPE(h);
    PyObject_GC_UnTrack(h);
    Hook_clear(h);
    tp->tp_free(h);
    Py_DECREF(tp);
}

static PyObject *Hook_get_fallback(HookObject *h, void *c)
{
    return Py_NewRef(h->fallback ? h->fallback : Py_None);
}

static PyGetSetDef Hook_getset[] = {
    {"fallback", (getter)Hook_get_fallback, NULL, "the Python hook of every other case", NULL},
    {NULL},
};

static PyMemberDef Hook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(HookObject, vectorcall), READONLY},
    {"kind", T_INT, offsetof(HookObject, kind), READONLY, "HOOK_PRE_FORWARD, ..."},
    {"taken", T_ULONGLONG, offsetof(HookObject, taken), READONLY, "calls run in C (the lane)"},
    {"passed", T_ULONGLONG, offsetof(HookObject, passed), READONLY,
     "calls given to the Python hook"},
    {NULL},
};

static PyType_Slot Hook_slots[] = {
    {Py_tp_new, Hook_new},
    {Py_tp_dealloc, Hook_dealloc},
    {Py_tp_traverse, Hook_traverse},
    {Py_tp_clear, Hook_clear},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_getset, Hook_getset},
    {Py_tp_members, Hook_members},
    {Py_tp_doc, "Hook(kind, state, group, fallback, then=None, owner=None): one torch hook of a "
                "wrapper, its common case in C (csrc/glue/py_hooks.c), every other case "
                "fallback(...).\nstate: the __dict__ of the object owning the hook (FSDPState, "
                "UnitRuntime); owner: that object (a unit's hooks); group: fully_shard's "
                "ParamGroup's __dict__ (None: no parameters). then: a post-forward hook's "
                "pre-backward Hook, an arrival's parameter index, a unit post-backward's group "
                "index."},
    {0, NULL},
};

static PyType_Spec Hook_spec = {
    "flatshard._C.Hook", sizeof(HookObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
        Py_TPFLAGS_IMMUTABLETYPE,
    Hook_slots,
};

/* set_hook_tools' keywords and where each is kept. */
static const struct {
    const char *name;
    PyObject **slot;
    int none_ok;
} tool_names[] = {
    {"profiling", &fs_hooks.profiling, 0},     {"stack_len", &fs_hooks.stack_len, 1},
    {"grad_enabled", &fs_hooks.grad_enabled, 0}, {"set_grad", &fs_hooks.set_grad, 0},
    {"tensor_type", &fs_hooks.tensor_type, 0}, {"hook_outputs", &fs_hooks.hook_outputs, 0},
    {"dtype_codes", &fs_hooks.dtype_codes, 0}, {"empty", &fs_hooks.empty, 0},
    {"empty_like", &fs_hooks.empty_like, 0},   {"contiguous", &fs_hooks.contiguous, 0},
    {"split", &fs_hooks.split, 0},             {"like", &fs_hooks.like, 1},
    {"run_hooks", &fs_hooks.run_hooks, 0},     {"heap_freed", &fs_hooks.heap_freed, 0},
    {"backward_pre", &fs_hooks.backward_pre, 0},
};
#define NTOOLS ((int)(sizeof(tool_names) / sizeof(tool_names[0])))

PyDoc_STRVAR(set_hook_tools_doc,
             "set_hook_tools(**tools)\n"
             "What Hook's lanes call, given once by fsdp2/state.py, every keyword required: "
             "profiling, stack_len (None where torch has no dispatch-stack probe), grad_enabled, "
             "like (None until fully_shard gives it), "
             "set_grad, tensor_type, hook_outputs, dtype_codes (a dict), empty, empty_like, "
             "contiguous, split, like, run_hooks, heap_freed, backward_pre (csrc/glue/py_hooks.h "
             "names each).");

static PyObject *set_hook_tools(PyObject *m, PyObject *args, PyObject *kw)
{
    if (PyTuple_GET_SIZE(args) || !kw || PyDict_GET_SIZE(kw) != NTOOLS)
        return PyErr_Format(PyExc_TypeError, "set_hook_tools takes its %d tools as keywords "
                            "only, every one of them", NTOOLS);
    PyObject *got[NTOOLS];
    for (int i = 0; i < NTOOLS; i++) {
        got[i] = PyDict_GetItemString(kw, tool_names[i].name);
        if (!got[i])
            return PyErr_Format(PyExc_TypeError, "set_hook_tools: missing %s", tool_names[i].name);
        if (got[i] == Py_None && !tool_names[i].none_ok)
            return PyErr_Format(PyExc_TypeError, "set_hook_tools: %s is None",
                                tool_names[i].name);
    }
    if (!PyType_Check(got[4]) || !PyDict_Check(got[6]))
        return PyErr_Format(PyExc_TypeError, "set_hook_tools: tensor_type must be a type and "
                            "dtype_codes a dict");
    for (int i = 0; i < NTOOLS; i++)
        Py_XSETREF(*tool_names[i].slot, Py_NewRef(got[i]));
    Py_RETURN_NONE;
}

static PyMethodDef hooks_methods[] = {
    {"set_hook_tools", (PyCFunction)(void (*)(void))set_hook_tools, METH_VARARGS | METH_KEYWORDS,
     set_hook_tools_doc},
    {NULL},
};

int fs_hook_type_add(PyObject *module)
{
    PyObject *tp = PyType_FromModuleAndSpec(module, &Hook_spec, NULL);
    int rc = tp ? PyModule_AddObjectRef(module, "Hook", tp) : -1;
    Py_XDECREF(tp);
    if (rc < 0 || PyModule_AddFunctions(module, hooks_methods) < 0)
        return -1;
    static const struct {
        const char *name;
        int value;
    } kinds[] = {
        {"HOOK_PRE_FORWARD", HOOK_PRE_FORWARD},
        {"HOOK_POST_FORWARD", HOOK_POST_FORWARD},
        {"HOOK_PRE_BACKWARD", HOOK_PRE_BACKWARD},
        {"HOOK_ARRIVE", HOOK_ARRIVE},
        {"HOOK_UNIT_PRE_FORWARD", HOOK_UNIT_PRE_FORWARD},
        {"HOOK_UNIT_POST_FORWARD", HOOK_UNIT_POST_FORWARD},
        {"HOOK_UNIT_PRE_BACKWARD", HOOK_UNIT_PRE_BACKWARD},
        {"HOOK_UNIT_POST_BACKWARD", HOOK_UNIT_POST_BACKWARD},
    };
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
        if (PyModule_AddIntConstant(module, kinds[i].name, kinds[i].value) < 0)
            return -1;
    return 0;
}
