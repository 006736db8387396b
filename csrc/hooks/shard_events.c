/* shard_events.c - a fully_shard group's events: the one implementation of
 * each event's plain path, which the objects torch calls run (glue/py_event.c,
 * glue/py_arrival.c: no Python frame between torch and the engine).
 *
 *   flatshard._C.Event(kind, group, fallback, ...)  a module's forward
 *       pre-hook (PRE_FORWARD), forward hook (POST_FORWARD), or the hook
 *       where backward reaches the module's outputs (PRE_BACKWARD)
 *   flatshard._C.Arrival(group, i)   parameter i's post-accumulate-grad hook
 *
 * [Note: plain events] Every step of an ordinary training takes the same
 * path through each event: gather the group and register the unsharded
 * parameters (pre-forward, pre-backward), register the sharded ones and free
 * (post-forward), and once every trainable parameter's gradient has arrived,
 * reduce-scatter the gradients into the sharded ones, free and register the
 * sharded parameters (post-backward). That path is written here, in C, over
 * the group's own fields (glue/shard_group_object.h); Python hands what it depends on
 * when that changes (FSDPState.hand_plain: the FS_PLAIN_* flags, the sums of
 * backwards without sync), and what can change within a step is checked at
 * each call with a few field reads: parameters assigned or a requires_grad
 * flipped since (params.h), the unsharded buffer not made yet, frozen
 * parameters, a hook on the reduce output, a gradient Python must hand, a
 * profiler or dispatch mode watching (their ranges and counts are Python's).
 * Any of those, and the event calls its fallback, the state's Python hook
 * (fsdp2/state.py), which handles every case and reaches the engine through
 * the same group: the event's sequence written a second time, in Python,
 * over the same engine calls and the same registration and reduction in C
 * (params.c, grads.c, fs_hooks_shard_reduce). Nothing is done twice at run
 * time, for the plain path acts only where it finishes. The Event and
 * Arrival objects hold no state of their own beyond what they were made
 * with.
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
 * The plain path of each event, on the group's fields */

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

/* The plain gather (pre-forward, pre-backward): 0 the modules hold the
 * unsharded parameters (gathered now or before), with *hooks set where a
 * trainable one has no gradient hook yet; 1 not plain now (nothing done);
 * -1 with an exception set. */
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

/* The plain post-backward: 1 done, 0 not plain now (nothing done), -1. */
static int plain_post_backward(ShardGroupObject *g)
{
    const fs_params *p = &g->params;
    if (!(g->plain & FS_PLAIN_POST_BACKWARD) || g->sums || p->trainable != p->n ||
        g->grads.hold || g->comm->dev)
        return 0;
    int w = watched(g);
    if (w)
        return w < 0 ? -1 : 0;
    PyObject *r = fs_hooks_shard_reduce(g, Py_None, 0, 1, NULL);
    if (!r)
        return -1;
    const int asked = r == Py_None;
    Py_DECREF(r);
    if (asked)  /* a gradient of a subclass: Python hands its values */
        return 0;
    return release(g) < 0 ? -1 : 1;
}

int fs_hooks_shard_post_backward(ShardGroupObject *g)
{
    fs_hooks_shard_clear_arrived(g);
    int r = plain_post_backward(g);
    if (r)
        return r < 0 ? -1 : 0;
    PyObject *owner = g->owner && g->fallback ? fs_weak_get(g->owner) : NULL;
    if (!owner)  /* the state is gone: nobody to run it for */
        return PyErr_Occurred() ? -1 : 0;
    PyObject *out = PyObject_CallOneArg(g->fallback, owner);
    Py_DECREF(owner);
    if (!out)
        return -1;
    Py_DECREF(out);
    return 0;
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
 * The event hooks' sequence */

static PyObject *call_fallback(const fs_shard_event *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames)
{
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

static int run_hooks(const fs_shard_event *self, int hooks)
{
    if (!hooks)
        return 0;
    PyObject *r = PyObject_CallNoArgs(self->hook_grads);
    if (!r)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* hook(grad) where backward reaches `out`, one plain tensor: a pre-hook on
 * its grad_fn, or a tensor hook on a leaf that requires grad (what
 * runtime/trees.hook_before_backward does for that case). */
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

static PyObject *post_forward(const fs_shard_event *self, ShardGroupObject *g, PyObject *out)
{
    if (release(g) < 0)
        return NULL;
    PyObject *grad = PyObject_CallNoArgs(self->grad_enabled);
    int on = grad ? PyObject_IsTrue(grad) : -1;
    Py_XDECREF(grad);
    if (on <= 0)
        return on < 0 ? NULL : Py_NewRef(Py_None);
    if (Py_IS_TYPE(out, (PyTypeObject *)self->tensor))
        return hook_tensor(out, self->pre_backward) < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *r = PyObject_CallFunctionObjArgs(self->hook_outputs, out, self->pre_backward, NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

PyObject *fs_hooks_shard_event(const fs_shard_event *self, PyObject *const *args, size_t nargsf,
                               PyObject *kwnames)
{
    ShardGroupObject *g = (ShardGroupObject *)self->group;
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    const int flags = g->plain;
    int want, hooks = 0;
    switch (self->kind) {
    case FS_EVENT_PRE_FORWARD:
        want = FS_PLAIN_PRE_FORWARD;
        break;
    case FS_EVENT_POST_FORWARD:
        want = FS_PLAIN_POST_FORWARD;
        break;
    default:  /* before lazy init no latch: Python's */
        want = self->latch ? FS_PLAIN_PRE_BACKWARD : -1;
    }
    if (want < 0 || !(flags & want) || kwnames || nargs != (self->kind == FS_EVENT_PRE_BACKWARD
                                                            ? 1 : 3))
        return call_fallback(self, args, nargsf, kwnames);
    /* frozen parameters: Python watches the forward's inputs and holds the
     * reshard back for them */
    if (self->kind != FS_EVENT_PRE_BACKWARD && g->params.trainable != g->params.n)
        return call_fallback(self, args, nargsf, kwnames);
    int w = watched(g);
    if (w)
        return w < 0 ? NULL : call_fallback(self, args, nargsf, kwnames);
    if (self->kind == FS_EVENT_POST_FORWARD)
        return post_forward(self, g, args[2]);
    /* the first pre-backward of a backward queues its end */
    if (self->kind == FS_EVENT_PRE_BACKWARD && fs_glue_latch_fire(self->latch) < 0)
        return NULL;
    if (self->kind == FS_EVENT_PRE_BACKWARD && !(flags & FS_PLAIN_GATHER_BACKWARD))
        Py_RETURN_NONE;
    int r = gather(g, &hooks);
    if (r < 0 || run_hooks(self, hooks) < 0)
        return NULL;
    if (r || (self->kind == FS_EVENT_PRE_FORWARD && g->params.trainable != g->params.n))
        return call_fallback(self, args, nargsf, kwnames); /* it finds the group gathered */
    Py_RETURN_NONE;
}
