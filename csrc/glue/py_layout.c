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

/* A record of `type` holding n int64 values; NULL with an exception set.
 * layout.h's structs are int64_t fields only, in the records' order: each
 * is read as such an array. */
static PyObject *record(PyObject *type, const void *fields, int n)
{
    const int64_t *v = fields;
    PyObject *r = PyStructSequence_New((PyTypeObject *)type);
    for (int i = 0; r && i < n; i++) {
        PyObject *x = PyLong_FromLongLong((long long)v[i]);
        if (!x)
            Py_CLEAR(r);
        else
            PyStructSequence_SetItem(r, i, x);
    }
    return r;
}
#define NFIELDS(T) ((int)(sizeof(T) / sizeof(int64_t)))

PyObject *fs_dim0_entry_record(fs_mod_state *st, const fs_dim0_entry *e)
{
    return record(st->Dim0EntryType, e, NFIELDS(fs_dim0_entry));
}

/* (layout, [entry]): the layout's record and one of each of the n entries
 * (`fields` int64 values each, of entry_type); NULL with an exception set. */
static PyObject *layout_pair(PyObject *lay_type, const void *lay, int lay_fields,
                             PyObject *entry_type, const int64_t *entries, Py_ssize_t n,
                             int fields)
{
    PyObject *list = PyList_New(n), *lay_obj = list ? record(lay_type, lay, lay_fields) : NULL;
    PyObject *res = NULL;
    for (Py_ssize_t i = 0; lay_obj && i < n; i++) {
        PyObject *r = record(entry_type, entries + i * fields, fields);
        if (!r)
            goto done;
        PyList_SET_ITEM(list, i, r);
    }
    if (lay_obj)
        res = PyTuple_Pack(2, lay_obj, list);
done:
    Py_XDECREF(lay_obj);
    Py_XDECREF(list);
    return res;
}

/* ---------------------------------------------------------------------------
 * entry points */

PyDoc_STRVAR(layout_flat_doc,
             "layout_flat(numels, world_size, rank, align_numel) -> (FlatLayout, [FlatEntry])\n"
             "FSDP1 layout (csrc/core/layout.h): one FlatEntry per parameter.");
static PyObject *py_layout_flat(PyObject *m, PyObject *args)
{
    fs_mod_state *st = fs_state_from_module(m);
    PyObject *numels_obj, *res = NULL;
    long long world, rank, align;
    Py_ssize_t n;
    int64_t *numels;
    if (!PyArg_ParseTuple(args, "OLLL", &numels_obj, &world, &rank, &align) ||
        !(numels = fs_int64_list(numels_obj, &n, "layout_flat: numels must be a sequence")))
        return NULL;
    fs_flat_entry *e = malloc(sizeof *e * (size_t)(n ? n : 1));
    fs_flat_layout lay;
    fs_status s = e ? fs_layout_flat(numels, n, world, rank, align, e, &lay) : FS_ERR_NO_MEMORY;
    if (s != FS_OK)
        fs_raise(st, s, "layout_flat: need world_size >= 1, 0 <= rank < world_size, "
                        "align_numel >= 1, numels >= 0");
    else
        res = layout_pair(st->FlatLayoutType, &lay, NFIELDS(lay), st->FlatEntryType,
                          (const int64_t *)e, n, NFIELDS(*e));
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
    static const char *const names[] = {"dim0s", "row_numels"};
    fs_mod_state *st = fs_state_from_module(m);
    PyObject *lists[2], *res = NULL;
    long long world, rank, align;
    int64_t *v[2];
    if (!PyArg_ParseTuple(args, "OOLLL", &lists[0], &lists[1], &world, &rank, &align))
        return NULL;
    Py_ssize_t n = fs_int64_lists(2, lists, v, "layout_dim0", names);
    if (n < 0)
        return NULL;
    fs_dim0_entry *e = malloc(sizeof *e * (size_t)(n ? n : 1));
    fs_dim0_layout lay;
    fs_status s = e ? fs_layout_dim0(v[0], v[1], n, world, rank, align, e, &lay)
                    : FS_ERR_NO_MEMORY;
    if (s != FS_OK)
        fs_raise(st, s, "layout_dim0: need world_size >= 1, 0 <= rank < world_size, "
                        "align_numel >= 1, sizes >= 0");
    else
        res = layout_pair(st->Dim0LayoutType, &lay, NFIELDS(lay), st->Dim0EntryType,
                          (const int64_t *)e, n, NFIELDS(*e));
    free(e);
    free(v[0]);
    free(v[1]);
    return res;
}

PyDoc_STRVAR(layout_dim0_unsharded_doc,
             "layout_dim0_unsharded(numels, world_size, align_numel)\n"
             "    -> {'offsets': [int], 'alloc_numel': int}\n"
             "A shard group's unsharded buffer (csrc/core/layout.h): each parameter's start\n"
             "(numels[i] == 0 for one not gathered into it) and the buffer's padded size.");
static PyObject *py_layout_dim0_unsharded(PyObject *m, PyObject *args)
{
    PyObject *n_obj, *res = NULL, *list = NULL;
    long long world, align;
    Py_ssize_t n;
    int64_t *numels, alloc;
    if (!PyArg_ParseTuple(args, "OLL", &n_obj, &world, &align) ||
        !(numels = fs_int64_list(n_obj, &n, "layout_dim0_unsharded: numels must be a sequence")))
        return NULL;
    int64_t *off = malloc(sizeof *off * (size_t)(n ? n : 1));
    fs_status s = off ? fs_layout_dim0_unsharded(numels, n, world, align, off, &alloc)
                      : FS_ERR_NO_MEMORY;
    if (s != FS_OK)
        fs_raise(fs_state_from_module(m), s, "layout_dim0_unsharded: need world_size >= 1, "
                 "align_numel >= 1, numels >= 0 (and a total that fits in 64 bits)");
    else
        list = PyList_New(n);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        PyObject *x = PyLong_FromLongLong((long long)off[i]);
        if (!x)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, x);
    }
    if (list)
        res = Py_BuildValue("{sOsL}", "offsets", list, "alloc_numel", (long long)alloc);
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
