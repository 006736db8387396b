/* shard_events.c - a fully_shard group's events: each one's sequence, which
 * the objects torch calls run (glue/py_event.c, glue/py_arrival.c).
 *
 *   flatshard._C.Event(kind, group, ...)  a module's forward pre-hook
 *       (PRE_FORWARD), forward hook (POST_FORWARD), or the hook where
 *       backward reaches the module's outputs (PRE_BACKWARD)
 *   flatshard._C.Arrival(group, i)   parameter i's post-accumulate-grad hook
 *
 * [Note: event sequences] The pre-forward, post-forward and pre-backward
 * are one sequence each, here, for every case (pre_forward, post_forward,
 * pre_backward below). What differs between cases is an option of the
 * sequence (fs_shard_event.opts, FS_OPT_*: handed by FSDPState.hand_options
 * where what it follows changes) or a field read at each call (frozen
 * parameters, a profiler or dispatch mode watching, the group gathered
 * already). A step that needs Python is a callable the sequence calls only
 * where it applies: lazy init and the root's start and end of forward, the
 * forward order's record, the casts, a gather with other states joined
 * (gather-ahead, a prefetch list), as async_op, on a device, or the first
 * one (it makes the buffer), the prefetches, the watch on a frozen
 * parameter's inputs, torch's ranges. An ordinary step of training runs no
 * Python frame: gather and register the unsharded parameters, register the
 * sharded ones and free.
 *
 * [Note: post-backward sequence] The post-backward runs once every
 * trainable parameter's gradient has arrived (the arrivals), or from the end
 * of backward: one sequence here too (fs_hooks_shard_post_backward), its
 * options ShardGroupObject.plain (FS_PB_*, handed by hand_options), its
 * Python steps the state's (set_post_backward): the sums of backwards
 * without sync added; with gradient sync the reduction, in C (reduce-scatter
 * into the sharded gradients, freeing in the same engine call) where
 * nothing read at the call stands in its way, else Python's step (torch's
 * ranges, a device's deferred reduction, the bucket, a hook on the reduce
 * output, frozen parameters, a subclass gradient), through the same
 * reduction in C (fs_hooks_shard_reduce); in the reshard's range the
 * reshard, in C, or Python's (held while a frozen parameter may still be
 * read, an extension's free); without sync the gradients kept.
 *
 * CPython C API only; torch is reached through the callables handed in and
 * its public tensor API (grad_fn, register_prehook, register_hook,
 * requires_grad). */
#include "shard_events.h"

#include "py_group.h"
#include "py_latch.h"

#include <stddef.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * The steps in C, on the group's fields */

/* 1: a profiler or dispatch mode watches; 0: none; -1 with an exception set */
static int watched(ShardGroupObject *g)
{
    /* held: a callable may hand the group another tuple (set_post_backward) */
    PyObject *watch = Py_XNewRef(g->watch);
    Py_ssize_t n = watch ? PyTuple_GET_SIZE(watch) : 0;
    int t = 0;
    for (Py_ssize_t i = 0; i < n && !t; i++) {
        PyObject *r = PyObject_CallNoArgs(PyTuple_GET_ITEM(watch, i));
        t = r ? PyObject_IsTrue(r) : -1;
        Py_XDECREF(r);
    }
    Py_XDECREF(watch);
    return t;
}

/* The gather in C (pre-forward, pre-backward): 0 the modules hold the
 * unsharded parameters (gathered now or before), with *hooks set where a
 * trainable one has no gradient hook yet; 1 Python's step must gather
 * (nothing done); -1 with an exception set. */
static int gather(ShardGroupObject *g, int *hooks)
{
    *hooks = 0;
    if (g->comm->dev)
        return 1;
    if (g->g.core.unsharded)  /* a prefetch gathered it (and registered it) */
        return g->g.core.gather_pending ? 1 : 0;
    int r = fs_params_changed(&g->params);
    if (r)
        return r < 0 ? -1 : 1;
    if (!g->full || !g->shards)  /* the first gather makes the buffer (Python) */
        return 1;
    if (fs_glue_group_bind(FS_GROUP(g)) < 0)
        return -1;
    PyObject *d = FS_GROUP(g)->done(FS_GROUP(g), fs_shard_unshard(&g->g, 0));
    if (!d)
        return -1;
    Py_DECREF(d);
    if (fs_params_register_unsharded(&g->params) < 0)
        return -1;
    *hooks = fs_params_needs_hooks(&g->params);
    return 0;
}

/* The sharded parameters registered, the unsharded buffer freed. */
static int release(ShardGroupObject *g)
{
    if (fs_params_register_sharded(&g->params) < 0)
        return -1;
    if (!g->g.core.unsharded && !g->g.core.gather_pending)
        return 0;
    if (fs_glue_group_bind(FS_GROUP(g)) < 0)
        return -1;
    PyObject *d = FS_GROUP(g)->done(FS_GROUP(g), fs_shard_reshard(&g->g));
    if (!d)
        return -1;
    Py_DECREF(d);
    return 0;
}

void fs_hooks_shard_clear_arrived(ShardGroupObject *g)
{
    if (g->narrived)
        memset(g->arrived, 0, (size_t)g->arrived_cap);
    g->narrived = 0;
}

static int context_enter(PyObject *ctx);
static int leave_span(PyObject *ctx, int rc);

static int call_step(ShardGroupObject *g, int i, PyObject *owner)
{
    PyObject *r = PyObject_CallOneArg(PyTuple_GET_ITEM(g->steps, i), owner);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The reduction in C: 1 done, 0 Python's step must make it (a gradient of a
 * subclass: it hands the values), -1. */
static int reduce_in_c(ShardGroupObject *g)
{
    PyObject *r = fs_hooks_shard_reduce(g, Py_None, 0, (g->plain & FS_PB_RESHARD) != 0, NULL);
    if (!r)
        return -1;
    const int asked = r == Py_None;
    Py_DECREF(r);
    return !asked;
}

int fs_hooks_shard_post_backward(ShardGroupObject *g)
{
    fs_hooks_shard_clear_arrived(g);
    PyObject *owner = g->owner && g->steps ? fs_weak_get(g->owner) : NULL;
    if (!owner)  /* the state is gone: nobody to run it for */
        return PyErr_Occurred() ? -1 : 0;
    const int o = g->plain, frozen = g->params.trainable != g->params.n;
    int rc = watched(g), w = rc > 0;
    rc = rc < 0 ? -1 : 0;
    if (rc == 0 && (g->sums || (w && (o & FS_PB_RANGE))))
        rc = call_step(g, FS_STEP_ACCUMULATE, owner);
    if (rc == 0 && (o & FS_PB_SYNC)) {
        if ((o & FS_PB_REDUCE_C) && !w && !g->sums && !frozen && !g->grads.hold && !g->comm->dev)
            rc = reduce_in_c(g);
        rc = rc < 0 ? -1 : rc ? 0 : call_step(g, FS_STEP_REDUCE, owner);
    }
    PyObject *span = NULL;
    if (rc == 0 && w) {
        span = PyObject_CallOneArg(PyTuple_GET_ITEM(g->steps, FS_STEP_SPAN), owner);
        if (!span || context_enter(span) < 0) {
            Py_CLEAR(span);
            rc = -1;
        }
    }
    if (rc == 0 && (o & FS_PB_RESHARD))
        rc = frozen || !(o & FS_PB_RESHARD_C) ? call_step(g, FS_STEP_RESHARD, owner) : release(g);
    if (rc == 0 && !(o & FS_PB_SYNC))
        rc = call_step(g, FS_STEP_UNSYNCED, owner);
    rc = leave_span(span, rc);
    Py_DECREF(owner);
    return rc;
}

PyObject *fs_hooks_shard_arrive(ShardGroupObject *g, int i)
{
    if (i >= g->params.n)  /* a hook of parameters set before: none of ours */
        Py_RETURN_NONE;
    if (i >= g->arrived_cap) {
        unsigned char *a = PyMem_Realloc(g->arrived, (size_t)g->params.n);
        if (!a)
            return PyErr_NoMemory();
        memset(a + g->arrived_cap, 0, (size_t)(g->params.n - g->arrived_cap));
        g->arrived = a;
        g->arrived_cap = g->params.n;
    }
    if (!g->arrived[i]) {
        g->arrived[i] = 1;
        g->narrived++;
    }
    if (g->narrived != g->params.trainable)
        Py_RETURN_NONE;
    return fs_hooks_shard_post_backward(g) < 0 ? NULL : Py_NewRef(Py_None);
}

/* ------------------------------------------------------------------------
 * Reduce-scatter the gradients into the sharded ones (the post-backward's
 * reduction, plain or not) */

PyObject *fs_hooks_shard_reduce(ShardGroupObject *self, PyObject *over, int defer, int reshard,
                                fs_reduce_bucket *bucket)
{
    fs_grads *q = &self->grads;
    PyObject *keep = NULL;
    int c = fs_grads_collect(q, &self->params, over, &keep);
    if (c < 0)
        return NULL;
    if (c == FS_GRADS_ASK)
        Py_RETURN_NONE;
    if (c == FS_GRADS_NONE)
        return PyLong_FromLong(0);
    PyObject *r = NULL;
    if (fs_glue_group_bind(FS_GROUP(self)) < 0)
        goto out;
    const unsigned fl = (defer ? FS_SHARD_DEFER : 0) | (q->all_reduce ? 0 : FS_SHARD_NO_ALL_REDUCE) |
                        (q->hold && q->all_reduce ? FS_SHARD_HOLD : 0) |
                        (q->force_sum ? FS_SHARD_FORCE_SUM : 0) |
                        (reshard ? FS_SHARD_RESHARD : 0);
    r = FS_GROUP(self)->done(FS_GROUP(self), fs_shard_reduce(&self->g, q->gh, q->gt, q->oh,
                                                             q->ot, q->acc, q->factor, fl,
                                                             bucket));
    if (!r) {
        fs_grads_drop(q);
        goto out;
    }
    Py_DECREF(r);
    if (bucket || self->g.core.reduce_pending) {
        r = PyLong_FromLong(2);
        goto out;
    }
    r = fs_grads_finish(q, &self->params) < 0 ? NULL : PyLong_FromLong(1);
out:
    Py_XDECREF(keep);
    return r;
}

/* ------------------------------------------------------------------------
 * The event hooks' sequences */

static int call0(PyObject *fn)
{
    PyObject *r = PyObject_CallNoArgs(fn);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int run_hooks(const fs_shard_event *self, int hooks)
{
    return hooks ? call0(self->hook_grads) : 0;
}

static int context_enter(PyObject *ctx)
{
    PyObject *r = PyObject_CallMethod(ctx, "__enter__", NULL);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The gather: in C where it can (not `python`: while one watches, Python's
 * counts), else the event's Python step. */
static int gather_step(const fs_shard_event *ev, ShardGroupObject *g, int python)
{
    int hooks = 0, rc = python ? 1 : gather(g, &hooks);
    return rc == 0 ? run_hooks(ev, hooks) : rc > 0 ? call0(ev->step) : -1;
}

/* The event's range while a profiler or mode watches g: span() entered, or
 * NULL (none: *err 0; an exception: *err 1). */
static PyObject *enter_span(const fs_shard_event *ev, ShardGroupObject *g, int *err)
{
    int w = g ? watched(g) : 0;
    *err = w < 0;
    if (w <= 0)
        return NULL;
    PyObject *ctx = PyObject_CallNoArgs(ev->span);
    if (!ctx || context_enter(ctx) < 0) {
        Py_XDECREF(ctx);
        *err = 1;
        return NULL;
    }
    return ctx;
}

/* The range left (as `with` leaves it: an exception of the steps inside is
 * kept); rc: theirs, returned unless leaving fails. */
static int leave_span(PyObject *ctx, int rc)
{
    if (!ctx)
        return rc;
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyObject *r = PyObject_CallMethod(ctx, "__exit__", "OOO", Py_None, Py_None, Py_None);
    Py_DECREF(ctx);
    if (!r) {
        Py_XDECREF(t);
        Py_XDECREF(v);
        Py_XDECREF(tb);
        return -1;
    }
    Py_DECREF(r);
    PyErr_Restore(t, v, tb);
    return rc;
}

/* hook(grad) where backward reaches `out`, one plain tensor: a pre-hook on
 * its grad_fn, or a tensor hook on a leaf that requires grad (any other
 * output: runtime/trees.hook_before_backward). */
static int hook_tensor(PyObject *out, PyObject *hook)
{
    PyObject *node = PyObject_GetAttrString(out, "grad_fn");
    if (!node)
        return -1;
    PyObject *h = NULL;
    if (node != Py_None) {
        h = PyObject_CallMethod(node, "register_prehook", "O", hook);
    } else {
        PyObject *rg = PyObject_GetAttrString(out, "requires_grad");
        int t = rg ? PyObject_IsTrue(rg) : -1;
        Py_XDECREF(rg);
        h = t > 0 ? PyObject_CallMethod(out, "register_hook", "O", hook)
                  : t == 0 ? Py_NewRef(Py_None) : NULL;
    }
    Py_DECREF(node);
    if (!h)
        return -1;
    Py_DECREF(h);
    return 0;
}

/* The outputs' pre-backward hook: the event's, or with frozen parameters
 * the one of the forward that watched its inputs ([Note: frozen
 * parameters] in fsdp2/state.py). */
static int hook_outputs(const fs_shard_event *ev, ShardGroupObject *g, PyObject *out)
{
    PyObject *own = NULL, *hook = ev->pre_backward;
    if (g && (g->params.trainable != g->params.n || (ev->opts & FS_OPT_WATCH))) {
        if (!(own = PyObject_CallNoArgs(ev->watching)))
            return -1;
        if (own != Py_None)
            hook = own;
    }
    int rc = 0;
    if (Py_IS_TYPE(out, (PyTypeObject *)ev->tensor)) {
        rc = hook_tensor(out, hook);
    } else {
        PyObject *r = PyObject_CallFunctionObjArgs(ev->hook_outputs, out, hook, NULL);
        rc = r ? 0 : -1;
        Py_XDECREF(r);
    }
    Py_XDECREF(own);
    return rc;
}

/* The post-forward: the reshard reshard_after_forward asks for (in its
 * range), the root's end of forward, the outputs' pre-backward hook (while
 * grad is on), the output cast. */
static PyObject *post_forward(const fs_shard_event *ev, ShardGroupObject *g, PyObject *out)
{
    const int o = ev->opts;
    if (g) {  /* the range even with nothing to free, as torch's */
        int err;
        PyObject *span = enter_span(ev, g, &err);
        if (err)
            return NULL;
        int rc = o & FS_OPT_STEP ? call0(ev->step) : o & FS_OPT_RESHARD ? release(g) : 0;
        if (leave_span(span, rc) < 0)
            return NULL;
    }
    if ((o & FS_OPT_ROOT) && call0(ev->root_end) < 0)
        return NULL;
    PyObject *grad = PyObject_CallNoArgs(ev->grad_enabled);
    int on = grad ? PyObject_IsTrue(grad) : -1;
    Py_XDECREF(grad);
    if (on < 0 || (on && hook_outputs(ev, g, out) < 0))
        return NULL;
    if (o & FS_OPT_CAST)
        return PyObject_CallOneArg(ev->cast, out);
    Py_RETURN_NONE;
}

/* The pre-backward: the end of backward queued (the first of a backward),
 * in its range the gather again (unshard_in_backward) and a device's
 * implicit prefetch, then the user's prefetch list. */
static PyObject *pre_backward(const fs_shard_event *ev, ShardGroupObject *g)
{
    const int o = ev->opts;
    if (ev->latch && fs_glue_latch_fire(ev->latch) < 0)
        return NULL;
    int err, rc = 0;
    PyObject *span = enter_span(ev, g, &err);
    if (err)
        return NULL;
    if (g && (o & FS_OPT_GATHER)) {
        rc = gather_step(ev, g, span || (o & FS_OPT_STEP));
    }
    if (rc == 0 && (o & FS_OPT_PREFETCH_IN))
        rc = call0(ev->prefetch);
    if (leave_span(span, rc) < 0)
        return NULL;
    if ((o & FS_OPT_PREFETCH_OUT) && call0(ev->prefetch) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Inputs a step handed back (a tuple (args, kwargs)) kept in *held, and
 * read into *args, *kwargs; None: no change. -1 with an exception set. */
static int take_inputs(PyObject *r, PyObject **held, PyObject **args, PyObject **kwargs)
{
    if (!r)
        return -1;
    if (r == Py_None) {
        Py_DECREF(r);
        return 0;
    }
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_TypeError, "flatshard: a pre-forward step returned no "
                        "(args, kwargs)");
        return -1;
    }
    Py_XSETREF(*held, r);
    *args = PyTuple_GET_ITEM(r, 0);
    *kwargs = PyTuple_GET_ITEM(r, 1);
    return 0;
}

/* The pre-forward: begin() (lazy init, the root's start of forward, the
 * forward order's record, the input cast), in its range the gather, frozen
 * parameters' inputs watched, the forward prefetch. Returns the inputs a
 * step changed, as (args, kwargs), or None. */
static PyObject *pre_forward(const fs_shard_event *ev, PyObject *args, PyObject *kwargs)
{
    PyObject *held = NULL;
    if ((ev->opts & FS_OPT_BEGIN) &&
        take_inputs(PyObject_CallFunctionObjArgs(ev->begin, args, kwargs, NULL), &held, &args,
                    &kwargs) < 0)
        return NULL;
    /* read after begin(): lazy init hands the options (and may make the group anew) */
    const int o = ev->opts;
    ShardGroupObject *g = ev->group == Py_None ? NULL : (ShardGroupObject *)ev->group;
    if (g) {
        int err, rc;
        PyObject *span = enter_span(ev, g, &err);
        if (err)
            goto fail;
        rc = gather_step(ev, g, span || (o & FS_OPT_STEP));
        if (leave_span(span, rc) < 0)
            goto fail;
        if ((g->params.trainable != g->params.n || (o & FS_OPT_WATCH)) &&
            take_inputs(PyObject_CallFunctionObjArgs(ev->watching, args, kwargs, NULL), &held,
                        &args, &kwargs) < 0)
            goto fail;
    }
    if ((o & FS_OPT_PREFETCH_OUT) && call0(ev->prefetch) < 0)
        goto fail;
    return held ? held : Py_NewRef(Py_None);
fail:
    Py_XDECREF(held);
    return NULL;
}

PyObject *fs_hooks_shard_event(const fs_shard_event *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames)
{
    static const char *what[] = {"pre-forward", "post-forward", "pre-backward"};
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    const Py_ssize_t want = self->kind == FS_EVENT_PRE_BACKWARD ? 1 : 3;
    if (kwnames || nargs != want) {
        PyErr_Format(PyExc_TypeError, "flatshard._C.Event: the %s hook takes %zd positional "
                     "arguments, got %zd", what[self->kind], want, nargs);
        return NULL;
    }
    ShardGroupObject *g = self->group == Py_None ? NULL : (ShardGroupObject *)self->group;
    switch (self->kind) {
    case FS_EVENT_PRE_FORWARD:
        return pre_forward(self, args[1], args[2]);
    case FS_EVENT_POST_FORWARD:
        return post_forward(self, g, args[2]);
    default:
        return pre_backward(self, g);
    }
}
