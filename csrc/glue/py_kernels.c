/* py_kernels.c - flatshard._C's stateless entry points: casts and copies,
 * reductions and norms over raw pointers, the state machine's step function,
 * shared-memory names. Tensors cross as data pointers (ints from
 * Tensor.data_ptr()) with numel and a dtype code; the Python layer
 * guarantees contiguity and sizes. Long copies release the GIL. */
#include "fs_py.h"

#include <stdlib.h>
#include <string.h>

#include "checksum.h"
#include "copy.h"
#include "layout.h"
#include "norm.h"
#include "reduce.h"
#include "stream_copy.h"
#include "unit_fsm.h"

/* Below this many bytes a copy is cheaper than releasing the GIL. */
#define FS_GIL_RELEASE_BYTES (256 * 1024)

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
    return fs_result(m, s, "cast");
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
    return fs_result(m, s, "scale_accumulate");
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
    PyObject *res = NULL;
    int64_t bytes = 0;
    if (!p) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long sp;
        int st;
        long long so, doff, num;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KiLLL", &sp, &st, &so, &doff, &num))
            goto done;
        p[i] = (fs_piece){(void *)sp, st, so, doff, num};
        bytes += num;
    }
    fs_status s;
    if (bytes * 4 > FS_GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        s = fs_gather_pieces((void *)dp, dt, dn, p, n);
        Py_END_ALLOW_THREADS
    } else {
        s = fs_gather_pieces((void *)dp, dt, dn, p, n);
    }
    res = fs_result(m, s, "gather_pieces: pieces must be in order, in range, castable");
done:
    free(p);
    Py_DECREF(seq);
    return res;
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
    return fs_result(m, s, "dim0_copy_out");
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
    return fs_result(m, s, "dim0_copy_in");
}

PyDoc_STRVAR(reduce_sum_doc,
             "reduce_sum(dst_ptr, dtype, src_ptrs, numel, scale, simd='auto', stream=False)\n"
             "dst = scale * (src0 + src1 + ...), summed in order in f32 (f64 for f64).\n"
             "simd: 'auto' (best for this CPU), 'avx2' or 'scalar' (the reference); 'avx512'\n"
             "runs the AVX2 loop (a memory-bound sum gains nothing wider). stream: write dst\n"
             "with non-temporal stores (same bits).");
static PyObject *py_reduce_sum(PyObject *m, PyObject *args)
{
    unsigned long long dp;
    int t;
    PyObject *srcs_obj;
    long long n;
    double scale;
    const char *simd_name = "auto";
    int stream = 0;
    if (!PyArg_ParseTuple(args, "KiOLd|sp", &dp, &t, &srcs_obj, &n, &scale, &simd_name, &stream))
        return NULL;
    int level = fs_simd_arg(simd_name, "reduce_sum");
    if (level < 0)
        return NULL;
    Py_ssize_t k;
    int64_t *ptrs = fs_int64_list(srcs_obj, &k, "reduce_sum: src_ptrs must be a sequence");
    if (!ptrs)
        return NULL;
    const void **srcs = malloc(sizeof(void *) * (size_t)(k ? k : 1));
    PyObject *res = NULL;
    if (!srcs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < k; i++)
        srcs[i] = (const void *)(intptr_t)ptrs[i];
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_reduce_sum((void *)dp, srcs, (int)k, n, t, scale, (fs_simd)level, stream);
    Py_END_ALLOW_THREADS
    res = fs_result(m, s, "reduce_sum: need >= 1 source and a float dtype");
done:
    free(srcs);
    free(ptrs);
    return res;
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
    PyObject *res = NULL;
    double total = 0.0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        unsigned long long p;
        int t;
        long long n;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KiL", &p, &t, &n))
            goto done;
        double part;
        fs_status s;
        Py_BEGIN_ALLOW_THREADS
        s = fs_norm_partial((const void *)p, t, n, inf, &part);
        Py_END_ALLOW_THREADS
        if (s != FS_OK) {
            fs_raise(fs_state_from_module(m), s, "norm_partial: float dtypes only");
            goto done;
        }
        total = inf ? (part > total || part != part ? part : total) : total + part;
    }
    res = PyFloat_FromDouble(total);
done:
    Py_DECREF(seq);
    return res;
}

PyDoc_STRVAR(copy_stream_doc,
             "copy_stream(dst_ptr, src_ptr, nbytes, simd='auto')\n"
             "Copy nbytes with non-temporal stores (csrc/core/stream_copy.h); simd='scalar'\n"
             "is memcpy, the reference. The buffers must not overlap.");
static PyObject *py_copy_stream(PyObject *m, PyObject *args)
{
    unsigned long long dp, sp;
    long long n;
    const char *simd_name = "auto";
    if (!PyArg_ParseTuple(args, "KKL|s", &dp, &sp, &n, &simd_name))
        return NULL;
    int level = fs_simd_arg(simd_name, "copy_stream");
    if (level < 0)
        return NULL;
    if (n < 0 || (n > 0 && (!dp || !sp)))
        return PyErr_Format(PyExc_ValueError, "copy_stream: nbytes must be >= 0 and the "
                            "pointers non-null");
    Py_BEGIN_ALLOW_THREADS
    fs_copy_stream((void *)(uintptr_t)dp, (const void *)(uintptr_t)sp, (size_t)n, (fs_simd)level);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
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

PyDoc_STRVAR(crc32c_doc,
             "crc32c(data, crc=0, reference=False) -> int\n"
             "The CRC-32C of a bytes-like object (a tensor's bytes through a memoryview),\n"
             "continued from crc. reference=True uses the table path only.");
static PyObject *py_crc32c(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *names[] = {"data", "crc", "reference", NULL};
    Py_buffer b;
    unsigned int crc = 0;
    int ref = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|Ip", names, &b, &crc, &ref))
        return NULL;
    uint32_t out;
    if (b.len >= FS_GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        out = ref ? fs_crc32c_table(crc, b.buf, (size_t)b.len) : fs_crc32c(crc, b.buf, (size_t)b.len);
        Py_END_ALLOW_THREADS
    } else {
        out = ref ? fs_crc32c_table(crc, b.buf, (size_t)b.len) : fs_crc32c(crc, b.buf, (size_t)b.len);
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(out);
}

static PyMethodDef kernel_methods[] = {
    {"cast", py_cast, METH_VARARGS, cast_doc},
    {"scale_accumulate", py_scale_accumulate, METH_VARARGS, scale_accumulate_doc},
    {"gather_pieces", py_gather_pieces, METH_VARARGS, gather_pieces_doc},
    {"dim0_copy_out", py_dim0_copy_out, METH_VARARGS, dim0_copy_out_doc},
    {"dim0_copy_in", py_dim0_copy_in, METH_VARARGS, dim0_copy_in_doc},
    {"fsm_step", py_fsm_step, METH_VARARGS, fsm_step_doc},
    {"reduce_sum", py_reduce_sum, METH_VARARGS, reduce_sum_doc},
    {"copy_stream", py_copy_stream, METH_VARARGS, copy_stream_doc},
    {"norm_partial", py_norm_partial, METH_VARARGS, norm_partial_doc},
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS, crc32c_doc},
    {"simd_level", py_simd_level, METH_NOARGS, "simd_level() -> the SIMD level reductions use"},
    {"shm_unlink", py_shm_unlink, METH_VARARGS,
     "shm_unlink(name): remove a shared-memory name (missing is fine)"},
    {NULL},
};

int fs_kernels_add(PyObject *m, fs_mod_state *st)
{
    return PyModule_AddFunctions(m, kernel_methods);
}
