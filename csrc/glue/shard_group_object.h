/* shard_group_object.h - flatshard._C.ShardGroup's object: the engine's
 * fs_shard_group (engine/shard_group.h) and what Python handed around it.
 * The layout only, shared by its type (py_shard_group.c: argument parsing,
 * the engine calls one by one) and its events (hooks/shard_events.c, whose
 * hook types are py_event.c and py_arrival.c). */
#ifndef FS_SHARD_GROUP_OBJECT_H
#define FS_SHARD_GROUP_OBJECT_H

#include "grads.h"
#include "group_object.h"
#include "params.h"
#include "shard_group.h"

/* [Note: post-backward sequence] (hooks/shard_events.c): what a group's
 * post-backward does, as Python decides it where what it depends on changes
 * (fsdp2/state.py FSDPState.hand_options). */
enum {
    FS_PB_SYNC = 1,      /* gradient sync: reduce (else keep the gradients, unsynced()) */
    FS_PB_RESHARD = 2,   /* reshard after backward */
    FS_PB_RESHARD_C = 4, /* ... in C (no extension, a bool reshard_after_forward, lean) */
    FS_PB_REDUCE_C = 8,  /* the reduction in C where nothing read at the call stands in its
                          * way: a lean state (not the root, host Comms, no gather-ahead, no
                          * cast), no parameter that gathers itself or is tensor-parallel, a
                          * bool reshard_after_forward, no reduction bucket */
    FS_PB_RANGE = 16,    /* this torch has the accumulate range: accumulate() while watched */
};

/* The post-backward's Python steps, by their place in ShardGroupObject.steps. */
enum {
    FS_STEP_ACCUMULATE, /* sums of backwards without sync added (in torch's range) */
    FS_STEP_REDUCE,     /* the reduction Python makes (ranges, a device, a bucket, ...) */
    FS_STEP_RESHARD,    /* the reshard Python makes (held for frozen parameters, ext) */
    FS_STEP_UNSYNCED,   /* no sync: gradients kept as reduce-dtype sums */
    FS_STEP_SPAN,       /* the reshard's range (a context), while one watches */
    FS_NSTEPS
};

/* [Note: handed fields] The collector may visit a group (tp_traverse)
 * wherever Python can run, and releasing a reference is such a place:
 * torch's tensor deallocation hands the GIL to other threads
 * (THPVariable_clear), whose collections then traverse the group. So a
 * field handed from Python is replaced in one step: the new objects, their
 * count and the engine's handles into them in place before the old ones are
 * released (Py_XSETREF), and a clear empties the fields before it releases
 * what they held (fs_params_clear, fs_grads_clear). Ranks run as threads
 * (torch's threaded process group), a cast (model.to) freeing the old local
 * tensors inside set_params, crashed the collector of the other rank's
 * thread otherwise (tests/test_threaded_collector.py). */
typedef struct {
    FS_GROUP_OBJECT_HEAD
    fs_shard_group g;
    PyObject *shards;      /* tuple: the local shards (tensor handles point into it) */
    PyObject *full, *storage;
    fs_params params;      /* the registration on the modules (hooks/params.h) */
    fs_grads grads;        /* the reduction's tensors (hooks/grads.h) */
    /* [Note: post-backward sequence]: what Python handed, and this backward's arrivals */
    int plain;             /* FS_PB_* */
    int sums;              /* Python keeps reduce-dtype sums of backwards without sync */
    unsigned char *arrived; /* (arrived_cap) parameter i's gradient arrived */
    int arrived_cap, narrived;
    PyObject *owner;       /* a weak reference to the Python state, or NULL */
    PyObject *steps;       /* the post-backward's Python steps, each step(owner): FS_STEP_* */
    PyObject *watch;       /* tuple of callables: any true, and a profiler or mode watches */
    PyObject *weakrefs;
} ShardGroupObject;

#endif
