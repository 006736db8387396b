/* module.c - flatshard._C: module init and the stateless entry points.
 *
 * CPython C API only (no binding generator, no torch headers). Tensors cross as data
 * pointers (ints from Tensor.data_ptr()) with numel and a dtype code; the
 * Python layer guarantees contiguity and sizes. Long copies release the GIL.
 * Multi-phase init, module state, heap types (see fs_py.h). */
#include "fs_py.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "copy.h"
#include "layout.h"
#include "norm.h"
#include "reduce.h"
#include "unit_fsm.h"

/* Below this many bytes a copy is cheaper than releasing the GIL. */
#define FS_GIL_RELEASE_BYTES (256 * 1024)

fs_mod_state *fs_state_from_module(PyObject *m) { return PyModule_GetState(m); }

fs_mod_state *fs_state_from_type(PyTypeObject *tp)
{
    return PyModule_GetState(PyType_GetModuleByDef(tp, &fs_module_def));
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

static PyObject *raise_mod(PyObject *m, fs_status s, const char *what)
{
    return fs_raise(fs_state_from_module(m), s, "%s", what);
}

/* ---------------------------------------------------------------------------
 * argument conversion shared by the glue */

int64_t *fs_int64_list(PyObject *obj, Py_ssize_t *n, const char *what)
{
    PyObject *seq = PySequence_Fast(obj, what);
    if (!seq)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    int64_t *v = malloc(sizeof(int64_t) * (size_t)(*n ? *n : 1));
    if (!v) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        v[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v[i] == -1 && PyErr_Occurred()) {
            free(v);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return v;
}

/* ---------------------------------------------------------------------------
 * copies and casts */

PyDoc_STRVAR(cast_doc, "cast(dst_ptr, dst_dtype, src_ptr, src_dtype, numel)");
static PyObject *py_cast(PyObject *m, PyObject *args)
{
    unsigned long long dp, sp;
    int dt, stype;
    long long n;
    if (!PyArg_ParseTuple(args, "KiKiL", &dp, &dt, &sp, &stype, &n))
        return NULL;
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_cast((void *)dp, dt, (void *)sp, stype, n);
    Py_END_ALLOW_THREADS
    if (s != FS_OK)
        return raise_mod(m, s, "cast");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(scale_accumulate_doc,
             "scale_accumulate(dst_ptr, dst_dtype, src_ptr, src_dtype, numel, scale, accumulate)\n"
             "dst = (accumulate ? dst : 0) + scale * src, in f32 (f64 for f64).");
static PyObject *py_scale_accumulate(PyObject *m, PyObject *args)
{
    unsigned long long dp, sp;
    int dt, stype, acc;
    long long n;
    double scale;
    if (!PyArg_ParseTuple(args, "KiKiLdp", &dp, &dt, &sp, &stype, &n, &scale, &acc))
        return NULL;
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_scale_accumulate((void *)dp, dt, (void *)sp, stype, n, scale, acc);
    Py_END_ALLOW_THREADS
    if (s != FS_OK)
        return raise_mod(m, s, "scale_accumulate");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(gather_pieces_doc,
             "gather_pieces(dst_ptr, dst_dtype, dst_numel, pieces)\n"
             "pieces: (src_ptr, src_dtype, src_offset, dst_offset, numel) in increasing\n"
             "dst_offset; everything not covered is zeroed (padding).");
static PyObject *py_gather_pieces(PyObject *m, PyObject *args)
{
    unsigned long long dp;
    int dt;
    long long dn;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "KiLO", &dp, &dt, &dn, &obj))
        return NULL;
    PyObject *seq = PySequence_Fast(obj, "gather_pieces: pieces must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    fs_piece *p = malloc(sizeof *p * (size_t)(n ? n : 1));
    int64_t bytes = 0;
    if (!p) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long sp;
        int st;
        long long so, doff, num;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KiLLL", &sp, &st, &so, &doff, &num)) {
            free(p);
            Py_DECREF(seq);
            return NULL;
        }
        p[i] = (fs_piece){(void *)sp, st, so, doff, num};
        bytes += num;
    }
    Py_DECREF(seq);
    fs_status s;
    if (bytes * 4 > FS_GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        s = fs_gather_pieces((void *)dp, dt, dn, p, n);
        Py_END_ALLOW_THREADS
    } else {
        s = fs_gather_pieces((void *)dp, dt, dn, p, n);
    }
    free(p);
    if (s != FS_OK)
        return raise_mod(m, s, "gather_pieces: pieces must be in order, in range, castable");
    Py_RETURN_NONE;
}

static int parse_dim0_entry(PyObject *t, fs_dim0_entry *e)
{
    long long v[6];
    if (!PyArg_ParseTuple(t, "LLLLLL;dim0 entry is a 6-tuple from layout_dim0", &v[0], &v[1],
                          &v[2], &v[3], &v[4], &v[5]))
        return -1;
    *e = (fs_dim0_entry){v[0], v[1], v[2], v[3], v[4], v[5]};
    return 0;
}

PyDoc_STRVAR(dim0_copy_out_doc,
             "dim0_copy_out(dst_ptr, dst_dtype, gathered_ptr, dtype, world_size, block_numel, entry)");
static PyObject *py_dim0_copy_out(PyObject *m, PyObject *args)
{
    unsigned long long dp, gp;
    int dt, t;
    long long world, block;
    PyObject *eo;
    fs_dim0_entry e;
    if (!PyArg_ParseTuple(args, "KiKiLLO", &dp, &dt, &gp, &t, &world, &block, &eo) ||
        parse_dim0_entry(eo, &e) < 0)
        return NULL;
    fs_status s = fs_dim0_copy_out((void *)dp, dt, (void *)gp, t, world, block, &e);
    if (s != FS_OK)
        return raise_mod(m, s, "dim0_copy_out");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(dim0_copy_in_doc, "dim0_copy_in(block_ptr, dtype, src_ptr, src_dtype, entry)\n"
                               "src is the full parameter; this rank's rows go to its chunk.");
static PyObject *py_dim0_copy_in(PyObject *m, PyObject *args)
{
    unsigned long long bp, sp;
    int t, st;
    PyObject *eo;
    fs_dim0_entry e;
    if (!PyArg_ParseTuple(args, "KiKiO", &bp, &t, &sp, &st, &eo) || parse_dim0_entry(eo, &e) < 0)
        return NULL;
    fs_status s = fs_dim0_copy_in((void *)bp, t, (void *)sp, st, &e);
    if (s != FS_OK)
        return raise_mod(m, s, "dim0_copy_in");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(reduce_sum_doc,
             "reduce_sum(dst_ptr, dtype, src_ptrs, numel, scale, simd='auto')\n"
             "dst = scale * (src0 + src1 + ...), summed in order in f32 (f64 for f64).\n"
             "simd: 'auto' (best for this CPU), 'avx2' or 'scalar' (the reference); 'avx512'\n"
             "runs the AVX2 loop (a memory-bound sum gains nothing wider).");
static PyObject *py_reduce_sum(PyObject *m, PyObject *args)
{
    unsigned long long dp;
    int t;
    PyObject *srcs_obj;
    long long n;
    double scale;
    const char *simd_name = "auto";
    if (!PyArg_ParseTuple(args, "KiOLd|s", &dp, &t, &srcs_obj, &n, &scale, &simd_name))
        return NULL;
    int level = fs_simd_parse(simd_name);
    if (level < 0)
        return PyErr_Format(PyExc_ValueError, "reduce_sum: simd='%s': %s", simd_name,
                            level == -1 ? "expected 'auto', 'scalar', 'avx2' or 'avx512'"
                                        : "this CPU lacks it");
    fs_simd simd = (fs_simd)level;
    Py_ssize_t k;
    int64_t *ptrs = fs_int64_list(srcs_obj, &k, "reduce_sum: src_ptrs must be a sequence");
    if (!ptrs)
        return NULL;
    const void **srcs = malloc(sizeof(void *) * (size_t)(k ? k : 1));
    if (!srcs) {
        free(ptrs);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < k; i++)
        srcs[i] = (const void *)(intptr_t)ptrs[i];
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_reduce_sum((void *)dp, srcs, (int)k, n, t, scale, simd);
    Py_END_ALLOW_THREADS
    free(srcs);
    free(ptrs);
    if (s != FS_OK)
        return raise_mod(m, s, "reduce_sum: need >= 1 source and a float dtype");
    Py_RETURN_NONE;
}

PyDoc_STRVAR(norm_partial_doc,
             "norm_partial(tensors, inf) -> float\n"
             "Sum of squares (inf=False) or largest |x| (inf=True) over the given\n"
             "(data_ptr, dtype, numel) triples, in f64.");
static PyObject *py_norm_partial(PyObject *m, PyObject *args)
{
    PyObject *obj;
    int inf;
    if (!PyArg_ParseTuple(args, "Op", &obj, &inf))
        return NULL;
    PyObject *seq = PySequence_Fast(obj, "norm_partial: tensors must be a sequence");
    if (!seq)
        return NULL;
    double total = 0.0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        unsigned long long p;
        int t;
        long long n;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KiL", &p, &t, &n)) {
            Py_DECREF(seq);
            return NULL;
        }
        double part;
        fs_status s;
        Py_BEGIN_ALLOW_THREADS
        s = fs_norm_partial((const void *)p, t, n, inf, &part);
        Py_END_ALLOW_THREADS
        if (s != FS_OK) {
            Py_DECREF(seq);
            return raise_mod(m, s, "norm_partial: float dtypes only");
        }
        total = inf ? (part > total || part != part ? part : total) : total + part;
    }
    Py_DECREF(seq);
    return PyFloat_FromDouble(total);
}

static PyObject *py_simd_level(PyObject *m, PyObject *Py_UNUSED(a))
{
    return PyUnicode_FromString(fs_simd_name(fs_simd_best()));
}

static PyObject *py_shm_unlink(PyObject *m, PyObject *args)
{
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    if (fs_shm_unlink(name) != FS_OK)
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------
 * the state machine without buffers, for tests and for the diagnostics */

PyDoc_STRVAR(fsm_step_doc,
             "fsm_step((strategy, is_root, grad_mask), (state, resume, reduced_mask,\n"
             "summon_was_sharded), event, flags, group, is_unsharded) -> (fsm, actions)\n"
             "Pure transition function of csrc/engine/unit_fsm.c; raises StateError when refused.");
static PyObject *py_fsm_step(PyObject *m, PyObject *args)
{
    int strategy, is_root, state, resume, was, ev, group, uns;
    unsigned long long mask, reduced;
    unsigned int flags;
    if (!PyArg_ParseTuple(args, "(iiK)(iiKi)iIip", &strategy, &is_root, &mask, &state, &resume,
                          &reduced, &was, &ev, &flags, &group, &uns))
        return NULL;
    fs_unit_cfg cfg = {strategy, is_root, mask};
    fs_unit_fsm f = {state, resume, reduced, was};
    unsigned act;
    fs_status s = fs_unit_step(&cfg, &f, ev, flags, group, uns, &act);
    if (s != FS_OK)
        return fs_raise(fs_state_from_module(m), s, "event %s in state %s", fs_event_name(ev),
                        fs_unit_state_name(state));
    return Py_BuildValue("((iiKi)I)", (int)f.state, (int)f.resume, (unsigned long long)f.reduced_mask,
                         f.summon_was_sharded, act);
}

static PyMethodDef module_methods[] = {
    {"cast", py_cast, METH_VARARGS, cast_doc},
    {"scale_accumulate", py_scale_accumulate, METH_VARARGS, scale_accumulate_doc},
    {"gather_pieces", py_gather_pieces, METH_VARARGS, gather_pieces_doc},
    {"dim0_copy_out", py_dim0_copy_out, METH_VARARGS, dim0_copy_out_doc},
    {"dim0_copy_in", py_dim0_copy_in, METH_VARARGS, dim0_copy_in_doc},
    {"fsm_step", py_fsm_step, METH_VARARGS, fsm_step_doc},
    {"reduce_sum", py_reduce_sum, METH_VARARGS, reduce_sum_doc},
    {"norm_partial", py_norm_partial, METH_VARARGS, norm_partial_doc},
    {"simd_level", py_simd_level, METH_NOARGS, "simd_level() -> the SIMD level reductions use"},
    {"shm_unlink", py_shm_unlink, METH_VARARGS,
     "shm_unlink(name): remove a shared-memory name (missing is fine)"},
    {NULL},
};

/* ---------------------------------------------------------------------------
 * module init */

static int add_constants(PyObject *m)
{
#define C(name, v) if (PyModule_AddIntConstant(m, name, v) < 0) return -1
    C("F32", FS_F32); C("F16", FS_F16); C("BF16", FS_BF16); C("F64", FS_F64);
    C("U8", FS_U8); C("I32", FS_I32); C("I64", FS_I64);
    C("EV_PRE_FORWARD", FS_EV_PRE_FORWARD); C("EV_POST_FORWARD", FS_EV_POST_FORWARD);
    C("EV_PRE_BACKWARD", FS_EV_PRE_BACKWARD); C("EV_POST_BACKWARD", FS_EV_POST_BACKWARD);
    C("EV_FINALIZE", FS_EV_FINALIZE); C("EV_SUMMON_ENTER", FS_EV_SUMMON_ENTER);
    C("EV_SUMMON_EXIT", FS_EV_SUMMON_EXIT);
    C("ACT_UNSHARD", FS_ACT_UNSHARD); C("ACT_RESHARD", FS_ACT_RESHARD);
    C("ACT_REDUCE_GRAD", FS_ACT_REDUCE_GRAD); C("ACT_HOOK_BACKWARD", FS_ACT_HOOK_BACKWARD);
    C("FLAG_GRAD_ENABLED", FS_FLAG_GRAD_ENABLED); C("FLAG_NO_SYNC", FS_FLAG_NO_SYNC);
    C("STATE_IDLE", FS_STATE_IDLE); C("STATE_FORWARD", FS_STATE_FORWARD);
    C("STATE_BACKWARD_PRE", FS_STATE_BACKWARD_PRE); C("STATE_BACKWARD_POST", FS_STATE_BACKWARD_POST);
    C("STATE_SUMMON", FS_STATE_SUMMON);
    C("FULL_SHARD", FS_FULL_SHARD); C("SHARD_GRAD_OP", FS_SHARD_GRAD_OP); C("NO_SHARD", FS_NO_SHARD);
    C("SHARD_OPTIM", FS_SHARD_OPTIM);
#undef C
    return 0;
}

int fs_disk_add(PyObject *module); /* py_disk.c */
int fs_glue_pool_add(PyObject *module); /* py_unit_pool.c */

static int module_exec(PyObject *m)
{
    fs_mod_state *st = fs_state_from_module(m);
    st->CoreError = PyErr_NewExceptionWithDoc(
        "flatshard._C.CoreError", "An error reported by flatshard's C core.", PyExc_RuntimeError, NULL);
    if (!st->CoreError || PyModule_AddObjectRef(m, "CoreError", st->CoreError) < 0)
        return -1;
    st->StateError = PyErr_NewExceptionWithDoc(
        "flatshard._C.StateError", "An event the unit state machine does not allow now.",
        st->CoreError, NULL);
    if (!st->StateError || PyModule_AddObjectRef(m, "StateError", st->StateError) < 0)
        return -1;
    if (fs_comm_type_add(m, st) < 0 || fs_unit_type_add(m, st) < 0 || fs_optim_add(m) < 0 ||
        fs_layout_add(m, st) < 0 || fs_divide_add(m) < 0 || fs_dim0_type_add(m, st) < 0 ||
        fs_bucket_type_add(m, st) < 0 || fs_disk_add(m) < 0 || fs_glue_pool_add(m) < 0 ||
        add_constants(m) < 0)
        return -1;
    PyObject *api = PyCapsule_New((void *)&fs_host_device_api, FS_DEVICE_API_CAPSULE, NULL);
    int rc = api ? PyModule_AddObjectRef(m, "host_device_api", api) : -1;
    Py_XDECREF(api);
    return rc;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    fs_mod_state *st = fs_state_from_module(m);
    Py_VISIT(st->CoreError);
    Py_VISIT(st->StateError);
    Py_VISIT(st->CommType);
    Py_VISIT(st->UnitType);
    Py_VISIT(st->FlatEntryType);
    Py_VISIT(st->FlatLayoutType);
    Py_VISIT(st->Dim0EntryType);
    Py_VISIT(st->Dim0LayoutType);
    Py_VISIT(st->Dim0GroupType);
    Py_VISIT(st->BucketType);
    return 0;
}

static int module_clear(PyObject *m)
{
    fs_mod_state *st = fs_state_from_module(m);
    Py_CLEAR(st->CoreError);
    Py_CLEAR(st->StateError);
    Py_CLEAR(st->CommType);
    Py_CLEAR(st->UnitType);
    Py_CLEAR(st->FlatEntryType);
    Py_CLEAR(st->FlatLayoutType);
    Py_CLEAR(st->Dim0EntryType);
    Py_CLEAR(st->Dim0LayoutType);
    Py_CLEAR(st->Dim0GroupType);
    Py_CLEAR(st->BucketType);
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyModuleDef fs_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "flatshard._C",
    .m_doc = "flatshard's C core: flat layouts, copies, the unit state machine, collectives.",
    .m_size = sizeof(fs_mod_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&fs_module_def); }
