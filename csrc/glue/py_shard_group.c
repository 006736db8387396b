/* py_shard_group.c - flatshard._C.ShardGroup: the Python face of one fully_shard
 * group on the engine (engine/shard_group.h). Argument parsing and the Python
 * objects behind the handles; the engine does the work. As for units
 * (py_unit.c), engine calls are made with the GIL held and the engine hands
 * it back around collectives and long host loops (the links' unlock). */
#include "shard_events.h"
#include "env.h"

#include "py_group.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <structmember.h>

static PyObject *done(ShardGroupObject *self, fs_status s)
{
    if (s == FS_OK)
        Py_RETURN_NONE;
    const fs_group_core *g = &self->g.core;
    fs_comm *c = self->comm->comm;
    PyObject *n = PyUnicode_FromFormat(
        "flatshard: during %s of fully_shard group '%U' (rank %d of %d)",
        g->err_what ? g->err_what : "an operation", self->name, c->rank, c->world_size);
    return fs_glue_group_failed(FS_GROUP(self), s, g->err_collective, n);
}

static PyObject *group_done(GroupObject *self, fs_status s)
{
    return done((ShardGroupObject *)self, s);
}

static int dtype_arg(PyObject *o, fs_dtype *t)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v >= FS_DTYPE_COUNT) {
        PyErr_Format(PyExc_ValueError, "ShardGroup: invalid dtype code %ld", v);
        return -1;
    }
    *t = (fs_dtype)v;
    return 0;
}

static PyObject *ShardGroup_new(PyTypeObject *tp, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"name", "comm", "dim0", "row_numel", "gathered", "align",
                             "compute_dtype", "reduce_dtype", "empty", "replicate", "outer",
                             NULL};
    PyObject *name, *comm, *dims, *rows, *gathered, *empty = Py_None, *replicate = Py_None,
        *outers = Py_None;
    long long align;
    int cdt, rdt;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "UOOOOLii|$OOO", kwlist, &name, &comm, &dims,
                                     &rows, &gathered, &align, &cdt, &rdt, &empty, &replicate,
                                     &outers))
        return NULL;
    if (fs_glue_group_check(tp, "ShardGroup", comm, replicate, empty) < 0)
        return NULL;
    if (cdt < 0 || cdt >= FS_DTYPE_COUNT || rdt < 0 || rdt >= FS_DTYPE_COUNT || align < 1)
        return PyErr_Format(PyExc_ValueError, "ShardGroup: invalid dtype code or alignment");
    static const char *const names[] = {"dim0", "row_numel", "gathered", "outer"};
    PyObject *lists[4] = {dims, rows, gathered, outers};
    int64_t *v[4];
    Py_ssize_t n = fs_int64_lists(4, lists, v, "ShardGroup", names);
    ShardGroupObject *self = NULL;
    if (n < 0 || !(self = (ShardGroupObject *)tp->tp_alloc(tp, 0)))
        goto out;
    fs_glue_group_init(FS_GROUP(self), &self->g.core, group_done, name, comm, replicate,
                       empty);
    fs_status s = fs_shard_init(&self->g, PyUnicode_AsUTF8(name), fs_hooks_env(&self->empty),
                               fs_glue_link(self->comm), fs_glue_link(self->replicate), (int)n,
                               v[3], v[0], v[1], v[2], align, cdt, rdt);
    self->ready = 1;
    self->grads.all_reduce = 1;
    if (s != FS_OK) {
        fs_raise(fs_state_from_type(tp), s, "ShardGroup %U: %s", name, self->g.core.err);
        Py_CLEAR(self);
    }
out:
    for (int i = 0; n >= 0 && i < 4; i++)
        free(v[i]);
    return (PyObject *)self;
}

static int ShardGroup_traverse(ShardGroupObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->shards);
    Py_VISIT(self->full);
    Py_VISIT(self->storage);
    Py_VISIT(self->owner);
    Py_VISIT(self->steps);
    Py_VISIT(self->watch);
    int r = fs_params_traverse(&self->params, visit, arg);
    if (!r)
        r = fs_grads_traverse(&self->grads, visit, arg);
    return r ? r : fs_glue_group_traverse(FS_GROUP(self), visit, arg);
}

/* What can lead back to the group: the parameters and the callables of the
 * reduction (the engine's handles point into shards and full, kept). */
static int ShardGroup_clear(ShardGroupObject *self)
{
    fs_params_clear(&self->params);
    fs_grads_clear(&self->grads);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->steps);
    Py_CLEAR(self->watch);
    return 0;
}

static void ShardGroup_dealloc(ShardGroupObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    if (self->ready)
        fs_shard_destroy(&self->g);
    Py_XDECREF(self->shards);
    Py_XDECREF(self->full);
    Py_XDECREF(self->storage);
    ShardGroup_clear(self);
    PyMem_Free(self->arrived);
    fs_glue_group_clear(FS_GROUP(self));
    tp->tp_free(self);
    Py_DECREF(tp);
}

PyDoc_STRVAR(set_shards_doc,
             "set_shards(tensors, dtype_codes): each parameter's local rows (contiguous),\n"
             "read at every gather; set again when the module moved them.");
static PyObject *ShardGroup_set_shards(ShardGroupObject *self, PyObject *args)
{
    PyObject *ts, *codes;
    if (!PyArg_ParseTuple(args, "OO", &ts, &codes))
        return NULL;
    const int n = self->g.nparams;
    PyObject *tup = PySequence_Tuple(ts), *ct = tup ? PySequence_Tuple(codes) : NULL, *r = NULL;
    void **h = NULL;
    fs_dtype *t = NULL;
    if (!ct)
        goto done;
    if (PyTuple_GET_SIZE(tup) != n || PyTuple_GET_SIZE(ct) != n) {
        PyErr_Format(PyExc_ValueError, "set_shards: %d tensors and codes expected", n);
        goto done;
    }
    h = calloc(n ? (size_t)n : 1, sizeof *h);
    t = calloc(n ? (size_t)n : 1, sizeof *t);
    if (!h || !t) {
        PyErr_NoMemory();
        goto done;
    }
    for (int i = 0; i < n; i++) {
        h[i] = PyTuple_GET_ITEM(tup, i);
        if (dtype_arg(PyTuple_GET_ITEM(ct, i), &t[i]) < 0)
            goto done;
    }
    fs_shard_set_shards(&self->g, h, t);
    Py_XSETREF(self->shards, tup); /* the handles point into it */
    tup = NULL;
    r = Py_NewRef(Py_None);
done:
    free(h);
    free(t);
    Py_XDECREF(tup);
    Py_XDECREF(ct);
    return r;
}

PyDoc_STRVAR(set_full_doc, "set_full(tensor): the unsharded buffer (full_alloc elements of the\n"
                           "compute dtype); its storage's bytes come and go.");
static PyObject *ShardGroup_set_full(ShardGroupObject *self, PyObject *full)
{
    PyObject *st = PyObject_CallMethod(full, "untyped_storage", NULL);
    if (!st)
        return NULL;
    /* the engine's handles and both fields new before the old buffer dies
     * ([Note: handed fields] in shard_group_object.h) */
    PyObject *old_full = self->full, *old_storage = self->storage;
    self->full = Py_NewRef(full);
    self->storage = st;
    fs_shard_set_full(&self->g, self->full, self->storage);
    Py_XDECREF(old_full);
    Py_XDECREF(old_storage);
    Py_RETURN_NONE;
}

static int settled(ShardGroupObject *self)
{
    if (self->full && self->shards)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "ShardGroup %U: set_shards and set_full first", self->name);
    return -1;
}

/* unshard with along: this group and the groups of `along` gathered in one
 * all-gather (the engine picks which join). */
static PyObject *unshard_along(ShardGroupObject *self, PyObject *along)
{
    Py_ssize_t n = fs_glue_group_along(FS_GROUP(self), along, "unshard");
    if (n < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (settled((ShardGroupObject *)PyTuple_GET_ITEM(along, i)) < 0)
            return NULL;
    fs_shard_group **groups = n ? PyMem_New(fs_shard_group *, n) : NULL;
    if (n && !groups)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++)
        groups[i] = &((ShardGroupObject *)PyTuple_GET_ITEM(along, i))->g;
    int failed;
    fs_status s = fs_shard_unshard_along(&self->g, 1, groups, (int)n, &failed);
    PyMem_Free(groups);
    return done(failed < 0 ? self : (ShardGroupObject *)PyTuple_GET_ITEM(along, failed), s);
}

static PyObject *ShardGroup_unshard(ShardGroupObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"defer", "along", NULL};
    int defer = 0;
    PyObject *along = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|pO", kwlist, &defer, &along))
        return NULL;
    if (settled(self) < 0 || fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    if (along != Py_None && defer)
        return PyErr_Format(PyExc_ValueError, "unshard: along gathers now (host): not with "
                            "defer");
    if (along != Py_None)
        return unshard_along(self, along);
    return done(self, fs_shard_unshard(&self->g, defer));
}

static PyObject *ShardGroup_unshard_from(ShardGroupObject *self, PyObject *args)
{
    PyObject *comm, *chunk;
    if (!PyArg_ParseTuple(args, "OO", &comm, &chunk))
        return NULL;
    fs_mod_state *st = fs_state_from_type(Py_TYPE(self));
    if (!PyObject_TypeCheck(comm, (PyTypeObject *)st->CommType) ||
        ((CommObject *)comm)->dev != self->comm->dev)
        return PyErr_Format(PyExc_TypeError, "unshard_from: comm must be a flatshard._C.Comm "
                            "on this group's device");
    CommObject *pc = (CommObject *)comm; /* the engine checks that its size divides ours */
    if (fs_glue_group_bind(FS_GROUP(self)) < 0 || fs_comm_bind_stream(pc) < 0)
        return NULL;
    fs_link post = fs_glue_link(pc);
    post.stream = pc->stream;
    return done(self, fs_shard_unshard_from(&self->g, &post, chunk));
}

static PyObject *ShardGroup_wait(ShardGroupObject *self, PyObject *Py_UNUSED(a))
{
    if (!self->g.core.gather_pending)
        Py_RETURN_NONE;
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    return done(self, fs_shard_wait(&self->g));
}

static PyObject *ShardGroup_reshard(ShardGroupObject *self, PyObject *Py_UNUSED(a))
{
    if (!self->g.core.unsharded && !self->g.core.gather_pending)
        Py_RETURN_NONE;
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    return done(self, fs_shard_reshard(&self->g));
}

static PyObject *ShardGroup_set_keep_storage(ShardGroupObject *self, PyObject *arg)
{
    int keep = PyObject_IsTrue(arg);
    if (keep < 0)
        return NULL;
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    return done(self, fs_shard_set_keep_storage(&self->g, keep));
}


PyDoc_STRVAR(finish_reduce_doc,
             "finish_reduce(write=True): what is left of a reduction (the wait, collect and\n"
             "write of a deferred or held one); then, for reduce_grads', the new sharded\n"
             "gradients set on their parameters and the parameters' post-accumulate-grad\n"
             "hooks run ([Note: post-backward in C]). write=False: none set (a hook on the\n"
             "reduce output failed, or a bucket was given up).");
static PyObject *ShardGroup_finish_reduce(ShardGroupObject *self, PyObject *args)
{
    int write = 1;
    if (!PyArg_ParseTuple(args, "|p", &write))
        return NULL;
    if (self->g.core.reduce_pending) {
        PyObject *r = fs_glue_group_bind(FS_GROUP(self)) < 0
            ? NULL : done(self, fs_shard_finish_reduce(&self->g));
        if (!r) {
            fs_grads_drop(&self->grads);
            return NULL;
        }
        Py_DECREF(r);
    }
    if (!write) {
        fs_grads_drop(&self->grads);
        Py_RETURN_NONE;
    }
    if (fs_grads_finish(&self->grads, &self->params) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_grads_doc,
             "set_grads(codes, tensor, specs, make, cls, like, empty, run_hooks): what\n"
             "reduce_grads reads (hooks/grads.h): the dtype-code table, torch.Tensor, each sharded\n"
             "parameter's DTensor spec (None: like(local, param) builds its gradient),\n"
             "DTensor.__new__ and DTensor, empty(local) for a shard of a local that is not\n"
             "plain, run_hooks(params).");
static PyObject *ShardGroup_set_grads(ShardGroupObject *self, PyObject *args)
{
    PyObject *codes, *tensor, *specs, *make, *cls, *like, *empty, *hooks;
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &codes, &tensor, &specs, &make, &cls, &like, &empty,
                          &hooks))
        return NULL;
    if (fs_grads_set(&self->grads, self->g.nparams, codes, tensor, specs, make, cls, like, empty,
                     hooks) < 0)
        return NULL;
    self->grads.alone = self->comm->comm->world_size == 1;
    self->grads.rcode = self->g.reduce;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_reduce_options_doc,
             "set_reduce_options(factor, force_sum, all_reduce, hold, unused): the settings\n"
             "of reduce_grads from now on: the divide factor (0: the engine's rule),\n"
             "force_sum, HSDP's all-reduce (False: into the partial sum, no gradient\n"
             "written), hold (a hook runs on the reduce output before the write), unused\n"
             "(trainable parameters without a gradient take zeros).");
static PyObject *ShardGroup_set_reduce_options(ShardGroupObject *self, PyObject *args)
{
    fs_grads *q = &self->grads;
    double factor;
    int force_sum, all_reduce, hold, unused;
    if (!PyArg_ParseTuple(args, "dpppp", &factor, &force_sum, &all_reduce, &hold, &unused))
        return NULL;
    q->factor = factor;
    q->force_sum = force_sum;
    q->all_reduce = all_reduce;
    q->hold = hold;
    q->unused = unused;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(reduce_grads_doc,
             "reduce_grads(grads, defer, reshard, bucket) -> 0, 1, 2 or None\n"
             "One reduce-scatter of the unsharded parameters' gradients into the sharded\n"
             "parameters' .grad, added where one is there ([Note: post-backward in C],\n"
             "hooks/grads.h): the mean over the ranks (and replicas), or the sum divided by\n"
             "set_reduce_options' factor, divided before and after the collective as torch's\n"
             "fully_shard divides (force_sum: as under its set_force_sum_reduction_for_comms;\n"
             "core/reduce_rule.h). grads: None, or one gradient per parameter in place of\n"
             "its .grad (None entries: the .grad). defer (a device): the steps after the\n"
             "collective wait for finish_reduce(). reshard: then free the unsharded buffer\n"
             "(the post-backward event in one call). With all_reduce off (HSDP) the\n"
             "reduce-scatter output goes into the group's partial sum and nothing is\n"
             "written; with hold the engine stops before the write, the reduce output\n"
             "divided by grad_divide()'s hold (reduce_output, after wait_reduce() when\n"
             "deferred; [Note: reduce output] in engine/shard_group.h). bucket (a\n"
             "ReduceBucket; a host Comm): the reduce-scatter joins it and runs at\n"
             "flush_bucket() ([Note: reduction buckets] in engine/engine.h).\n"
             "Returns 0: no gradient, nothing done; 1: done, gradients set and hooks run;\n"
             "2: left to finish (deferred, held or in the bucket: finish_reduce()); None: a\n"
             "gradient is not a plain tensor, nothing done (hand its values in grads).");
static PyObject *ShardGroup_reduce_grads(ShardGroupObject *self, PyObject *const *args,
                                         Py_ssize_t nargs)
{
    if (nargs != 4)
        return PyErr_Format(PyExc_TypeError, "reduce_grads takes 4 arguments (%zd given)", nargs);
    const int defer = PyObject_IsTrue(args[1]), reshard = PyObject_IsTrue(args[2]);
    if (defer < 0 || reshard < 0)
        return NULL;
    fs_reduce_bucket *bucket;
    if (fs_glue_group_bucket_arg(FS_GROUP(self), args[3], defer, "reduce_grads", &bucket) < 0)
        return NULL;
    return fs_hooks_shard_reduce(self, args[0], defer, reshard, bucket);
}

static PyObject *ShardGroup_wait_reduce(ShardGroupObject *self, PyObject *Py_UNUSED(a))
{
    if (!self->g.reduce_deferred)
        Py_RETURN_NONE;
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    return done(self, fs_shard_wait_reduce(&self->g));
}

/* The reduce output of a reduction left to finish, once collected: a host
 * group exports it through the buffer protocol, each export holding the
 * memory's handle, so that a tensor over it outlives finish_reduce(). */
static int ShardGroup_getbuffer(ShardGroupObject *self, Py_buffer *view, int flags)
{
    int64_t nbytes;
    void *owner, *data = self->empty ? NULL : fs_shard_reduce_output(&self->g, &nbytes, &owner);
    if (!data) {
        PyErr_Format(PyExc_BufferError, "ShardGroup %U: no reduce output is held (a host "
                     "group, between reduce_grads() with set_reduce_options' hold and "
                     "finish_reduce())", self->name);
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)self, data, (Py_ssize_t)nbytes, 0, flags) < 0)
        return -1;
    view->internal = Py_NewRef((PyObject *)owner);
    return 0;
}

static void ShardGroup_releasebuffer(ShardGroupObject *self, Py_buffer *view)
{
    Py_XDECREF((PyObject *)view->internal);
}

static PyObject *ShardGroup_get_reduce_output(ShardGroupObject *self, void *c)
{
    int64_t nbytes;
    void *owner;
    if (!fs_shard_reduce_output(&self->g, &nbytes, &owner))
        Py_RETURN_NONE;
    if (self->empty) /* a device group: the uint8 tensor `empty` made */
        return Py_NewRef((PyObject *)owner);
    return PyMemoryView_FromObject((PyObject *)self);
}

PyDoc_STRVAR(accumulate_doc,
             "accumulate(src, src_code, dst, dst_code, n, add)\n"
             "dst = (dst if add else 0) + src over n elements, cast to dst's dtype: an\n"
             "unsharded gradient summed across backwards without sync.");
static PyObject *ShardGroup_accumulate(ShardGroupObject *self, PyObject *args)
{
    PyObject *src, *dst, *scode, *dcode;
    long long n;
    int add;
    fs_dtype st, dt;
    if (!PyArg_ParseTuple(args, "OOOOLp", &src, &scode, &dst, &dcode, &n, &add) ||
        dtype_arg(scode, &st) < 0 || dtype_arg(dcode, &dt) < 0)
        return NULL;
    if (n < 0)
        return PyErr_Format(PyExc_ValueError, "ShardGroup.accumulate: n must be >= 0");
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        return NULL;
    return done(self, fs_shard_accumulate(&self->g, src, st, dst, dt, (int64_t)n, add));
}

static PyObject *ShardGroup_drop_partial(ShardGroupObject *self, PyObject *Py_UNUSED(a))
{
    fs_shard_drop_partial(&self->g);
    Py_RETURN_NONE;
}

static PyObject *ShardGroup_get_entries(ShardGroupObject *self, void *c)
{
    fs_mod_state *st = fs_state_from_type(Py_TYPE(self));
    int n = self->g.nparams, rank = self->g.core.link.comm->rank;
    PyObject *l = PyList_New(n);
    for (int i = 0; l && i < n; i++) {
        PyObject *rec = fs_dim0_entry_record(st, &self->g.entries[(size_t)rank * n + i]);
        if (!rec) {
            Py_CLEAR(l);
            break;
        }
        PyList_SET_ITEM(l, i, rec);
    }
    return l;
}

static PyObject *ShardGroup_get_offsets(ShardGroupObject *self, void *c)
{
    PyObject *t = PyTuple_New(self->g.nparams);
    for (int i = 0; t && i < self->g.nparams; i++) {
        PyObject *x = PyLong_FromLongLong(self->g.params[i].full_offset);
        if (!x) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    return t;
}

static PyObject *ShardGroup_get_aliased(ShardGroupObject *self, void *c)
{
    return PyBool_FromLong(self->g.aliased);
}

static PyObject *ShardGroup_get_has_partial(ShardGroupObject *self, void *c)
{
    return PyBool_FromLong(fs_shard_has_partial(&self->g));
}

static PyObject *ShardGroup_get_copied(ShardGroupObject *self, void *c)
{
    const unsigned long long *b = self->g.copied_bytes;
    return Py_BuildValue("{sKsKsKsKsK}", "copy_in", b[FS_SHARD_COPY_IN], "copy_out",
                         b[FS_SHARD_COPY_OUT], "reduce_in", b[FS_SHARD_REDUCE_IN], "reduce_out",
                         b[FS_SHARD_REDUCE_OUT], "cast", b[FS_SHARD_CAST]);
}

// ----------------------------------------------------------------------
// the registration on the modules ([Note: registration in C], hooks/params.h)

PyDoc_STRVAR(set_params_doc,
             "set_params(slots, sharded, locals, quick): what the registration reads: slots\n"
             "(module _parameters dict, name, parameter index) for every alias, first alias\n"
             "first; the sharded parameters and their local tensors as set_shards has them;\n"
             "quick[i]: the identity tests decide whether parameter i was reassigned (a\n"
             "plain local tensor, gathered by the group). The modules' registration is\n"
             "then unknown: the next register_sharded() stores.");
static PyObject *ShardGroup_set_params(ShardGroupObject *self, PyObject *args)
{
    PyObject *slots, *sharded, *locals, *quick;
    if (!PyArg_ParseTuple(args, "OOOO", &slots, &sharded, &locals, &quick))
        return NULL;
    if (fs_params_set(&self->params, self->g.nparams, slots, sharded, locals, quick) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ShardGroup_set_unsharded(ShardGroupObject *self, PyObject *unsharded)
{
    if (fs_params_set_unsharded(&self->params, unsharded) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ShardGroup_register_sharded(ShardGroupObject *self, PyObject *Py_UNUSED(a))
{
    if (fs_params_register_sharded(&self->params) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ShardGroup_register_unsharded(ShardGroupObject *self, PyObject *Py_UNUSED(a))
{
    if (fs_params_register_unsharded(&self->params) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ShardGroup_registration_changed(ShardGroupObject *self, PyObject *Py_UNUSED(a))
{
    int r = fs_params_changed(&self->params);
    return r < 0 ? NULL : PyLong_FromLong(r);
}

static PyObject *ShardGroup_take_unhooked(ShardGroupObject *self, PyObject *Py_UNUSED(a))
{
    return fs_params_take_unhooked(&self->params);
}

PyDoc_STRVAR(set_post_backward_doc,
             "set_post_backward(owner, steps, watch): owner, a weak reference to the state\n"
             "whose post-backward's Python steps, each step(owner), steps are (accumulate,\n"
             "reduce, reshard, unsynced, span); watch, a tuple of callables, any of them true\n"
             "while a profiler or a dispatch mode watches ([Note: post-backward sequence] in\n"
             "hooks/shard_events.c).");

static PyObject *ShardGroup_set_post_backward(ShardGroupObject *self, PyObject *args)
{
    PyObject *owner, *steps, *watch;
    if (!PyArg_ParseTuple(args, "OO!O!:set_post_backward", &owner, &PyTuple_Type, &steps,
                          &PyTuple_Type, &watch))
        return NULL;
    int ok = PyWeakref_CheckRef(owner) && PyTuple_GET_SIZE(steps) == FS_NSTEPS;
    for (Py_ssize_t i = 0; ok && i < FS_NSTEPS; i++)
        ok = PyCallable_Check(PyTuple_GET_ITEM(steps, i));
    if (!ok)
        return PyErr_Format(PyExc_TypeError, "set_post_backward: owner must be a weak "
                            "reference and steps a tuple of %d callables", FS_NSTEPS);
    Py_XSETREF(self->owner, Py_NewRef(owner));
    Py_XSETREF(self->steps, Py_NewRef(steps));
    Py_XSETREF(self->watch, Py_NewRef(watch));
    Py_RETURN_NONE;
}

static PyObject *ShardGroup_post_backward(ShardGroupObject *self, PyObject *Py_UNUSED(a))
{
    return fs_hooks_shard_post_backward(self) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *ShardGroup_clear_arrived(ShardGroupObject *self, PyObject *Py_UNUSED(a))
{
    fs_hooks_shard_clear_arrived(self);
    Py_RETURN_NONE;
}

static PyObject *ShardGroup_set_comm_quant(ShardGroupObject *self, PyObject *args)
{
    fs_comm_quant q;
    if (fs_glue_parse_quant(args, &q) < 0)
        return NULL;
    return group_done(FS_GROUP(self), fs_group_set_quant(&self->g.core, q));
}

static PyMethodDef ShardGroup_methods[] = {
    FS_GROUP_METHODS,
    {"set_post_backward", (PyCFunction)ShardGroup_set_post_backward, METH_VARARGS,
     set_post_backward_doc},
    {"post_backward", (PyCFunction)ShardGroup_post_backward, METH_NOARGS,
     "post_backward(): this backward's arrivals forgotten, then the post-backward's\n"
     "sequence (the reduction, the unsharded buffer freed, the sharded parameters\n"
     "registered; [Note: post-backward sequence] in hooks/shard_events.c)."},
    {"clear_arrived", (PyCFunction)ShardGroup_clear_arrived, METH_NOARGS,
     "clear_arrived(): no gradient of this backward counted as arrived."},
    {"set_comm_quant", (PyCFunction)ShardGroup_set_comm_quant, METH_VARARGS,
     FS_SET_COMM_QUANT_DOC},
    {"set_params", (PyCFunction)ShardGroup_set_params, METH_VARARGS, set_params_doc},
    {"set_unsharded", (PyCFunction)ShardGroup_set_unsharded, METH_O,
     "set_unsharded(params): the unsharded parameters (None where not made yet); one that\n"
     "is a new object carries no gradient hook yet."},
    {"register_sharded", (PyCFunction)ShardGroup_register_sharded, METH_NOARGS,
     "register_sharded(): the modules hold the sharded parameters."},
    {"register_unsharded", (PyCFunction)ShardGroup_register_unsharded, METH_NOARGS,
     "register_unsharded(): each unsharded parameter's requires_grad set to its sharded\n"
     "one's, `trainable` counted, and the modules hold the unsharded parameters."},
    {"registration_changed", (PyCFunction)ShardGroup_registration_changed, METH_NOARGS,
     "registration_changed() -> 0, 1 or 2: 0 when the modules still hold the sharded\n"
     "parameters set_params gave, over the same local tensors, none given attributes\n"
     "(or when they hold the unsharded ones); 1 when one was assigned (a module holds\n"
     "another parameter, or a parameter another local tensor); 2 when those hold but a\n"
     "local tensor has attributes or does not gather here: the caller decides whether\n"
     "its path changed (sync_registered)."},
    {"take_unhooked", (PyCFunction)ShardGroup_take_unhooked, METH_NOARGS,
     "take_unhooked(): the indices of trainable unsharded parameters without the gradient\n"
     "hook, marked as hooked now (the caller hooks them)."},
    {"set_shards", (PyCFunction)ShardGroup_set_shards, METH_VARARGS, set_shards_doc},
    {"set_full", (PyCFunction)ShardGroup_set_full, METH_O, set_full_doc},
    {"unshard", (PyCFunction)(void (*)(void))ShardGroup_unshard, METH_VARARGS | METH_KEYWORDS,
     "unshard(defer=False, along=None): gather into the unsharded buffer (defer: a device\n"
     "prefetch). along: a tuple of ShardGroups on this Comm (host) gathered now too, in the\n"
     "same all-gather (the engine skips those already gathered, and stops where the batch\n"
     "is full)."},
    {"unshard_from", (PyCFunction)ShardGroup_unshard_from, METH_VARARGS,
     "unshard_from(comm, chunk): gather the unsharded buffer over `comm` from the chunk\n"
     "this rank kept after forward (int reshard_after_forward)."},
    {"wait", (PyCFunction)ShardGroup_wait, METH_NOARGS,
     "wait(): a deferred gather: the stream waits, then the copy-out is enqueued."},
    {"reshard", (PyCFunction)ShardGroup_reshard, METH_NOARGS, "reshard(): free the unsharded buffer."},
    {"set_keep_storage", (PyCFunction)ShardGroup_set_keep_storage, METH_O,
     "set_keep_storage(keep): reshards keep the unsharded storage, its data pointer the\n"
     "same at the next gather (False: free it, also now when resharded)\n"
     "(engine/shard_group.h, [Note: kept storage])."},
    {"wait_reduce", (PyCFunction)ShardGroup_wait_reduce, METH_NOARGS,
     "wait_reduce(): a deferred reduction: the stream waits for its reduce-scatter, then\n"
     "the replicas' all-reduce and a held output's divide are enqueued."},
    {"set_grads", (PyCFunction)ShardGroup_set_grads, METH_VARARGS, set_grads_doc},
    {"set_reduce_options", (PyCFunction)ShardGroup_set_reduce_options, METH_VARARGS,
     set_reduce_options_doc},
    {"reduce_grads", (PyCFunction)(void (*)(void))ShardGroup_reduce_grads, METH_FASTCALL,
     reduce_grads_doc},
    {"finish_reduce", (PyCFunction)ShardGroup_finish_reduce, METH_VARARGS, finish_reduce_doc},
    {"accumulate", (PyCFunction)ShardGroup_accumulate, METH_VARARGS, accumulate_doc},
    {"drop_partial", (PyCFunction)ShardGroup_drop_partial, METH_NOARGS,
     "drop_partial(): forget the HSDP partial sum (reset_iter_state)."},
    {NULL},
};

/* The ledger's and the errors' name for the group: its module's path, known
 * only once the root's tree is (fully_shard names groups at lazy init). */
static int ShardGroup_set_name(ShardGroupObject *self, PyObject *value, void *closure)
{
    (void)closure;
    if (!value || !PyUnicode_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "ShardGroup.name: a str");
        return -1;
    }
    const char *utf8 = PyUnicode_AsUTF8(value);
    if (!utf8)
        return -1;
    fs_group_rename(&self->g.core, utf8);
    Py_SETREF(self->name, Py_NewRef(value));
    return 0;
}

static PyObject *ShardGroup_get_needs_hooks(ShardGroupObject *self, void *c)
{
    return PyBool_FromLong(fs_params_needs_hooks(&self->params));
}

/* Nothing of a backward is left for the end of backward to do ([Note:
 * post-backward sequence] in hooks/shard_events.c): no arrival counted, no sums kept, the
 * buffer free and the sharded parameters registered, no gradient on an
 * unsharded parameter. */
static PyObject *ShardGroup_get_idle(ShardGroupObject *self, void *c)
{
    if (self->narrived || self->sums || self->g.core.unsharded || self->g.core.gather_pending ||
        self->params.registered == FS_REG_UNSHARDED)
        Py_RETURN_FALSE;
    int grads = fs_params_unsharded_grads(&self->params);
    return grads < 0 ? NULL : PyBool_FromLong(!grads);
}

static PyGetSetDef ShardGroup_getset[] = {
    FS_GROUP_GETSET,
    {"idle", (getter)ShardGroup_get_idle, NULL,
     "nothing of a backward is left for its end: no arrival, no sums, the buffer free,\n"
     "the sharded parameters registered, no unsharded gradient", NULL},
    {"needs_hooks", (getter)ShardGroup_get_needs_hooks, NULL,
     "a trainable unsharded parameter has no gradient hook yet (take_unhooked)", NULL},
    {"name", (getter)fs_glue_group_get_name, (setter)ShardGroup_set_name,
     "the group's name in the ledger and in errors", NULL},
    {"entries", (getter)ShardGroup_get_entries, NULL, "this rank's Dim0Entry per parameter", NULL},
    {"offsets", (getter)ShardGroup_get_offsets, NULL, "each parameter's start in the unsharded buffer",
     NULL},
    {"reduce_output", (getter)ShardGroup_get_reduce_output, NULL,
     "a held reduction's reduce output (block_numel elements of the reduce dtype): a\n"
     "memoryview (host) or a uint8 tensor (device); None when none is ready", NULL},
    {"aliased", (getter)ShardGroup_get_aliased, NULL,
     "the unsharded parameters must be the shards themselves (one rank, the compute\n"
     "dtype: engine/shard_group.h, [Note: direct layout]); set with the shards", NULL},
    {"has_partial", (getter)ShardGroup_get_has_partial, NULL,
     "an HSDP partial sum is kept (reductions without the all-reduce)", NULL},
    {"copied", (getter)ShardGroup_get_copied, NULL,
     "bytes written by copies so far, by kind (engine/shard_group.h, [Note: copy counts])", NULL},
    {NULL},
};

static PyMemberDef ShardGroup_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(ShardGroupObject, weakrefs), READONLY},
    {"arrived", T_INT, offsetof(ShardGroupObject, narrived), READONLY,
     "trainable parameters whose gradient arrived in this backward"},
    {"plain", T_INT, offsetof(ShardGroupObject, plain), 0,
     "PLAIN_* flags: which events of the state may take the plain path ([Note: plain\n"
     "events] in hooks/shard_events.c)"},
    {"sums", T_INT, offsetof(ShardGroupObject, sums), 0,
     "1 where reduce-dtype sums of backwards without sync are kept (Python's)"},
    {"registered", T_INT, offsetof(ShardGroupObject, params.registered), READONLY,
     "which parameters the modules hold: 0 unknown (none stored since set_params),\n"
     "1 the sharded, 2 the unsharded"},
    {"trainable", T_INT, offsetof(ShardGroupObject, params.trainable), READONLY,
     "parameters that require grad at the last register_unsharded()"},
    {"full_alloc", T_LONGLONG, offsetof(ShardGroupObject, g.full_alloc), READONLY,
     "elements of the unsharded buffer"},
    {NULL},
};

static PyType_Slot ShardGroup_slots[] = {
    {Py_tp_new, ShardGroup_new},
    {Py_tp_members, ShardGroup_members},
    {Py_tp_dealloc, ShardGroup_dealloc},
    {Py_tp_traverse, ShardGroup_traverse},
    {Py_tp_clear, ShardGroup_clear},
    {Py_tp_methods, ShardGroup_methods},
    {Py_tp_getset, ShardGroup_getset},
    {Py_bf_getbuffer, ShardGroup_getbuffer},
    {Py_bf_releasebuffer, ShardGroup_releasebuffer},
    {Py_tp_doc, "ShardGroup(name, comm, dim0, row_numel, gathered, align, compute_dtype,\n"
                "reduce_dtype, *, empty=None, replicate=None, outer=None): one fully_shard\n"
                "group on the engine (engine/shard_group.h); parameter i is viewed as (outer[i],\n"
                "dim0[i], row_numel[i]) and sharded on its middle dim."},
    {0, NULL},
};

static PyType_Spec ShardGroup_spec = {
    "flatshard._C.ShardGroup", sizeof(ShardGroupObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC, ShardGroup_slots,
};

int fs_shard_group_type_add(PyObject *module, fs_mod_state *st)
{
    return fs_add_type(module, &ShardGroup_spec, &st->ShardGroupType);
}
