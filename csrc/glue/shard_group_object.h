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

/* [Note: plain events] (hooks/shard_events.c): whether the post-backward may
 * take the plain path, as Python decides it where what it depends on changes
 * (fsdp2/state.py FSDPState.hand_options): a lean state (not the root, host
 * Comms, no gather-ahead, no cast), no parameter that gathers itself or is
 * tensor-parallel, gradient sync, reshard after backward, a bool
 * reshard_after_forward, no reduction bucket. */
enum { FS_PLAIN_POST_BACKWARD = 16 };

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
    /* [Note: plain events]: what Python handed, and this backward's arrivals */
    int plain;             /* FS_PLAIN_* */
    int sums;              /* Python keeps reduce-dtype sums of backwards without sync */
    unsigned char *arrived; /* (arrived_cap) parameter i's gradient arrived */
    int arrived_cap, narrived;
    PyObject *owner;       /* a weak reference to the Python state, or NULL */
    PyObject *fallback;    /* fallback(owner): the state's post-backward in Python */
    PyObject *watch;       /* tuple of callables: any true, and a profiler or mode watches */
    PyObject *weakrefs;
} ShardGroupObject;

#endif
