/* py_layout.c - flatshard._C.layout_flat / layout_dim0 / layout_dim0_unsharded /
 * layout_dim0_post_chunk: layout.c's results as named records.
 *
 * Each layout and each per-parameter entry reaches Python as a struct
 * sequence (FlatLayout, FlatEntry, Dim0Layout, Dim0Entry) whose fields carry
 * layout.h's names, so Python reads `entry.shard_offset`, never `e[2]`. The
 * arithmetic stays in layout.c; this file only converts. */
#include "fs_py.h"

#include <stdlib.h>

#include "layout.h"

/* ---------------------------------------------------------------------------
 * record types: field order and meaning are layout.h's */

static PyStructSequence_Field flat_entry_fields[] = {
    {"numel", "elements of the parameter"},
    {"flat_offset", "its start in the unsharded flat buffer"},
    {"shard_offset", "start of this rank's piece inside the local shard"},
    {"param_offset", "start of this rank's piece inside the flattened parameter"},
    {"piece_numel", "length of this rank's piece; 0 when the rank holds none"},
    {NULL, NULL},
};
static PyStructSequence_Desc flat_entry_desc = {
    "flatshard._C.FlatEntry", "One parameter of a FLAT (FSDP1) layout, seen from one rank.",
    flat_entry_fields, 5};

static PyStructSequence_Field flat_layout_fields[] = {
    {"unpadded_numel", "end of the last parameter, aligned starts included"},
    {"shard_numel", "elements every rank holds, padding included"},
    {"padded_numel", "shard_numel * world_size"},
    {"shard_begin", "rank * shard_numel: the local shard's start in the flat buffer"},
    {NULL, NULL},
};
static PyStructSequence_Desc flat_layout_desc = {
    "flatshard._C.FlatLayout", "A FLAT (FSDP1) layout's sizes, seen from one rank.",
    flat_layout_fields, 4};

static PyStructSequence_Field dim0_entry_fields[] = {
    {"dim0", "rows (1 for a 0-d tensor)"},
    {"row_numel", "elements per row: the product of the other dims"},
    {"chunk_rows", "ceil(dim0 / world_size): rows of every padded chunk"},
    {"block_offset", "start of the padded chunk inside each rank's block"},
    {"local_row_begin", "first row this rank holds (dim0 when it holds none)"},
    {"local_rows", "rows this rank really holds, 0..chunk_rows"},
    {NULL, NULL},
};
static PyStructSequence_Desc dim0_entry_desc = {
    "flatshard._C.Dim0Entry", "One parameter of a DIM0 (fully_shard) layout, seen from one rank.",
    dim0_entry_fields, 6};

static PyStructSequence_Field dim0_layout_fields[] = {
    {"block_numel", "one rank's all-gather input, padding included"},
    {"gathered_numel", "block_numel * world_size"},
    {NULL, NULL},
};
static PyStructSequence_Desc dim0_layout_desc = {
    "flatshard._C.Dim0Layout", "A DIM0 (fully_shard) layout's sizes.", dim0_layout_fields, 2};

/* A record of `type` holding n int64 values; NULL with an exception set. */
static PyObject *record(PyObject *type, const int64_t *v, int n)
{
    PyObject *r = PyStructSequence_New((PyTypeObject *)type);
    if (!r)
        return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong((long long)v[i]);
        if (!x) {
            Py_DECREF(r);
            return NULL;
        }
        PyStructSequence_SetItem(r, i, x);
    }
    return r;
}

PyObject *fs_dim0_entry_record(fs_mod_state *st, const fs_dim0_entry *e)
{
    int64_t v[6] = {e->dim0, e->row_numel, e->chunk_rows, e->block_offset, e->local_row_begin,
                    e->local_rows};
    return record(st->Dim0EntryType, v, 6);
}

/* ---------------------------------------------------------------------------
 * entry points */

PyDoc_STRVAR(layout_flat_doc,
             "layout_flat(numels, world_size, rank, align_numel) -> (FlatLayout, [FlatEntry])\n"
             "FSDP1 layout (csrc/core/layout.h): one FlatEntry per parameter.");
static PyObject *py_layout_flat(PyObject *m, PyObject *args)
{
    fs_mod_state *st = fs_state_from_module(m);
    PyObject *numels_obj;
    long long world, rank, align;
    if (!PyArg_ParseTuple(args, "OLLL", &numels_obj, &world, &rank, &align))
        return NULL;
    Py_ssize_t n;
    int64_t *numels = fs_int64_list(numels_obj, &n, "layout_flat: numels must be a sequence");
    if (!numels)
        return NULL;
    fs_flat_entry *e = malloc(sizeof *e * (size_t)(n ? n : 1));
    PyObject *res = NULL, *list = NULL, *lay_obj = NULL;
    fs_flat_layout lay;
    if (!e) {
        PyErr_NoMemory();
        goto done;
    }
    fs_status s = fs_layout_flat(numels, n, world, rank, align, e, &lay);
    if (s != FS_OK) {
        fs_raise(st, s, "layout_flat: need world_size >= 1, 0 <= rank < world_size, "
                        "align_numel >= 1, numels >= 0");
        goto done;
    }
    if (!(list = PyList_New(n)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v[5] = {e[i].numel, e[i].flat_offset, e[i].shard_offset, e[i].param_offset,
                        e[i].piece_numel};
        PyObject *r = record(st->FlatEntryType, v, 5);
        if (!r)
            goto done;
        PyList_SET_ITEM(list, i, r);
    }
    int64_t lv[4] = {lay.unpadded_numel, lay.shard_numel, lay.padded_numel, lay.shard_begin};
    if ((lay_obj = record(st->FlatLayoutType, lv, 4)))
        res = PyTuple_Pack(2, lay_obj, list);
done:
    Py_XDECREF(lay_obj);
    Py_XDECREF(list);
    free(e);
    free(numels);
    return res;
}

PyDoc_STRVAR(layout_dim0_doc,
             "layout_dim0(dim0s, row_numels, world_size, rank, align_numel)\n"
             "    -> (Dim0Layout, [Dim0Entry])\n"
             "FSDP2 layout (csrc/core/layout.h): one Dim0Entry per parameter.");
static PyObject *py_layout_dim0(PyObject *m, PyObject *args)
{
    fs_mod_state *st = fs_state_from_module(m);
    PyObject *d_obj, *r_obj;
    long long world, rank, align;
    if (!PyArg_ParseTuple(args, "OOLLL", &d_obj, &r_obj, &world, &rank, &align))
        return NULL;
    Py_ssize_t n, n2;
    int64_t *d = fs_int64_list(d_obj, &n, "layout_dim0: dim0s must be a sequence");
    if (!d)
        return NULL;
    int64_t *r = fs_int64_list(r_obj, &n2, "layout_dim0: row_numels must be a sequence");
    fs_dim0_entry *e = NULL;
    PyObject *res = NULL, *list = NULL, *lay_obj = NULL;
    if (!r)
        goto done;
    if (n2 != n) {
        PyErr_SetString(PyExc_ValueError, "layout_dim0: dim0s and row_numels differ in length");
        goto done;
    }
    if (!(e = malloc(sizeof *e * (size_t)(n ? n : 1)))) {
        PyErr_NoMemory();
        goto done;
    }
    fs_dim0_layout lay;
    fs_status s = fs_layout_dim0(d, r, n, world, rank, align, e, &lay);
    if (s != FS_OK) {
        fs_raise(st, s, "layout_dim0: need world_size >= 1, 0 <= rank < world_size, "
                        "align_numel >= 1, sizes >= 0");
        goto done;
    }
    if (!(list = PyList_New(n)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = fs_dim0_entry_record(st, &e[i]);
        if (!rec)
            goto done;
        PyList_SET_ITEM(list, i, rec);
    }
    int64_t lv[2] = {lay.block_numel, lay.gathered_numel};
    if ((lay_obj = record(st->Dim0LayoutType, lv, 2)))
        res = PyTuple_Pack(2, lay_obj, list);
done:
    Py_XDECREF(lay_obj);
    Py_XDECREF(list);
    free(e);
    free(r);
    free(d);
    return res;
}

PyDoc_STRVAR(layout_dim0_unsharded_doc,
             "layout_dim0_unsharded(numels, world_size, align_numel)\n"
             "    -> {'offsets': [int], 'alloc_numel': int}\n"
             "A shard group's unsharded buffer (csrc/core/layout.h): each parameter's start\n"
             "(numels[i] == 0 for one not gathered into it) and the buffer's padded size.");
static PyObject *py_layout_dim0_unsharded(PyObject *m, PyObject *args)
{
    fs_mod_state *st = fs_state_from_module(m);
    PyObject *n_obj, *res = NULL, *list = NULL;
    long long world, align;
    if (!PyArg_ParseTuple(args, "OLL", &n_obj, &world, &align))
        return NULL;
    Py_ssize_t n;
    int64_t *numels = fs_int64_list(n_obj, &n, "layout_dim0_unsharded: numels must be a "
                                               "sequence");
    if (!numels)
        return NULL;
    int64_t *off = malloc(sizeof *off * (size_t)(n ? n : 1)), alloc;
    if (!off) {
        PyErr_NoMemory();
        goto done;
    }
    fs_status s = fs_layout_dim0_unsharded(numels, n, world, align, off, &alloc);
    if (s != FS_OK) {
        fs_raise(st, s, "layout_dim0_unsharded: need world_size >= 1, align_numel >= 1, "
                        "numels >= 0 (and a total that fits in 64 bits)");
        goto done;
    }
    if (!(list = PyList_New(n)))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLongLong((long long)off[i]);
        if (!x)
            goto done;
        PyList_SET_ITEM(list, i, x);
    }
    res = Py_BuildValue("{sOsL}", "offsets", list, "alloc_numel", (long long)alloc);
done:
    Py_XDECREF(list);
    free(off);
    free(numels);
    return res;
}

PyDoc_STRVAR(layout_dim0_post_chunk_doc,
             "layout_dim0_post_chunk(alloc_numel, group_size, rank) -> slice\n"
             "The range of a shard group's unsharded buffer that rank `rank` of a\n"
             "post-forward group of group_size ranks keeps (int reshard_after_forward;\n"
             "csrc/core/layout.h).");
static PyObject *py_layout_dim0_post_chunk(PyObject *m, PyObject *args)
{
    fs_mod_state *st = fs_state_from_module(m);
    long long alloc, size, rank;
    if (!PyArg_ParseTuple(args, "LLL", &alloc, &size, &rank))
        return NULL;
    int64_t off, numel;
    fs_status s = fs_layout_dim0_post_chunk(alloc, size, rank, &off, &numel);
    if (s != FS_OK)
        return fs_raise(st, s, "layout_dim0_post_chunk: need group_size >= 1 dividing "
                               "alloc_numel >= 0 and 0 <= rank < group_size; got %lld, %lld, "
                               "%lld", alloc, size, rank);
    PyObject *a = PyLong_FromLongLong((long long)off), *b = PyLong_FromLongLong(
                                                           (long long)(off + numel));
    PyObject *r = a && b ? PySlice_New(a, b, NULL) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return r;
}

PyDoc_STRVAR(align_numel_doc,
             "align_numel(elem_bytes) -> elements: where every parameter of a flat buffer\n"
             "starts, for elements of elem_bytes (layout.h, FS_ALIGN_BYTES).");
static PyObject *py_align_numel(PyObject *m, PyObject *arg)
{
    long long b = PyLong_AsLongLong(arg);
    if (b == -1 && PyErr_Occurred())
        return NULL;
    if (b < 1)
        return PyErr_Format(PyExc_ValueError, "align_numel: elem_bytes must be >= 1, got %lld",
                            b);
    return PyLong_FromLongLong(fs_align_numel(b));
}

static PyMethodDef layout_methods[] = {
    {"align_numel", py_align_numel, METH_O, align_numel_doc},
    {"layout_flat", py_layout_flat, METH_VARARGS, layout_flat_doc},
    {"layout_dim0", py_layout_dim0, METH_VARARGS, layout_dim0_doc},
    {"layout_dim0_unsharded", py_layout_dim0_unsharded, METH_VARARGS,
     layout_dim0_unsharded_doc},
    {"layout_dim0_post_chunk", py_layout_dim0_post_chunk, METH_VARARGS,
     layout_dim0_post_chunk_doc},
    {NULL, NULL, 0, NULL},
};

int fs_layout_add(PyObject *module, fs_mod_state *st)
{
    struct {
        PyStructSequence_Desc *desc;
        PyObject **slot;
        const char *name;
    } types[] = {
        {&flat_entry_desc, &st->FlatEntryType, "FlatEntry"},
        {&flat_layout_desc, &st->FlatLayoutType, "FlatLayout"},
        {&dim0_entry_desc, &st->Dim0EntryType, "Dim0Entry"},
        {&dim0_layout_desc, &st->Dim0LayoutType, "Dim0Layout"},
    };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        *types[i].slot = (PyObject *)PyStructSequence_NewType(types[i].desc);
        if (!*types[i].slot || PyModule_AddObjectRef(module, types[i].name, *types[i].slot) < 0)
            return -1;
    }
    if (PyModule_AddIntConstant(module, "ALIGN_BYTES", FS_ALIGN_BYTES) < 0)
        return -1;
    return PyModule_AddFunctions(module, layout_methods);
}
