/* py_bucket.c - flatshard._C.ReduceBucket: the engine's fs_reduce_bucket
 * ([Note: reduction buckets] in engine/engine.h) as a Python object, owned
 * by one model's root (runtime/bucket.py). A bucket of its own per model,
 * not per Comm: Comms are shared between models, and a bucket's parts point
 * at engine objects that only their model keeps alive. Its owners fill and
 * flush it (Unit.event(bucket=...), ShardGroup.reduce_grads(..., bucket),
 * flush_bucket, cancel_bucket). */
#include "py_bucket.h"

typedef struct {
    PyObject_HEAD
    fs_reduce_bucket b;
} BucketObject;

static PyObject *Bucket_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    if (!PyArg_ParseTuple(args, ":ReduceBucket") || (kw && PyDict_Size(kw)))
        return PyErr_Format(PyExc_TypeError, "ReduceBucket() takes no arguments");
    BucketObject *self = (BucketObject *)tp->tp_alloc(tp, 0); /* zeroed: empty */
    return (PyObject *)self;
}

static void Bucket_dealloc(BucketObject *self)
{
    /* Parts left (a backward given up, its model gone): their owners let
     * their handles go when they are destroyed; nothing here points back. */
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyType_Slot Bucket_slots[] = {
    {Py_tp_new, Bucket_new},
    {Py_tp_dealloc, Bucket_dealloc},
    {Py_tp_doc, "ReduceBucket(): reduce-scatters recorded by host engine objects, issued as "
                "one at their flush_bucket() (engine.h, [Note: reduction buckets])."},
    {0, NULL},
};

static PyType_Spec Bucket_spec = {
    "flatshard._C.ReduceBucket", sizeof(BucketObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, Bucket_slots,
};

fs_reduce_bucket *fs_glue_bucket(PyTypeObject *any, PyObject *o)
{
    fs_mod_state *st = fs_state_from_type(any);
    if (!PyObject_TypeCheck(o, (PyTypeObject *)st->BucketType)) {
        PyErr_Format(PyExc_TypeError, "bucket must be a flatshard._C.ReduceBucket, not %s",
                     Py_TYPE(o)->tp_name);
        return NULL;
    }
    return &((BucketObject *)o)->b;
}

fs_reduce_bucket *fs_glue_bucket_args(GroupObject *self, PyObject *args, const char *op,
                                      PyObject **owners)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject *bo;
    fs_reduce_bucket *b;
    if (!PyArg_ParseTuple(args, "OO", &bo, owners) || !(b = fs_glue_bucket(tp, bo)))
        return NULL;
    if (!PyTuple_Check(*owners) || PyTuple_GET_SIZE(*owners) != b->nparts) {
        PyErr_Format(PyExc_ValueError, "expected (bucket, a tuple of the owner of each of its "
                     "%d reductions, in order)", b->nparts);
        return NULL;
    }
    for (int i = 0; i < b->nparts; i++) {
        PyObject *o = PyTuple_GET_ITEM(*owners, i);
        if (Py_TYPE(o) != tp) {
            PyErr_Format(PyExc_TypeError, "%s: owners[%d] is not a %s", op, i, tp->tp_name);
            return NULL;
        }
        if (!fs_group_owns_part(FS_GROUP(o)->core, b, i)) {
            PyErr_Format(PyExc_ValueError, "%s: the bucket's part %d is not owners[%d]'s", op, i,
                         i);
            return NULL;
        }
    }
    return b;
}

int fs_bucket_type_add(PyObject *module, fs_mod_state *st)
{
    return fs_add_type(module, &Bucket_spec, &st->BucketType);
}
