/* fs_py.h - declarations shared by the CPython glue files (module.c: init;
 * py_helpers.c: the helpers below; py_comm.c, py_unit.c, ... : one type each).
 * Only the glue and hooks/ (the C over torch objects, which include this
 * header) include Python.h; the core and the engine do not (comm_torch.c
 * excepted: that backend is a Python call by nature). */
#ifndef FS_PY_H
#define FS_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "comm.h"
#include "comm_shm.h"
#include "engine.h"
#include "fs_device.h"
#include "fs_status.h"
#include "layout.h"
#include "ledger.h"
#include "optim.h"

/* Only objects: module.c visits and clears the fields as one array. */
typedef struct {
    PyObject *CoreError;  /* flatshard._C.CoreError(RuntimeError) */
    PyObject *StateError; /* an event the unit state machine refuses */
    PyObject *CommType;
    PyObject *UnitType;
    PyObject *FlatEntryType;  /* layout records (py_layout.c) */
    PyObject *FlatLayoutType;
    PyObject *Dim0EntryType;
    PyObject *Dim0LayoutType;
    PyObject *ShardGroupType;  /* py_shard_group.c */
    PyObject *ArrivalType;     /* py_arrival.c */
    PyObject *EventType;       /* py_event.c */
    PyObject *LatchType;       /* py_latch.c */
    PyObject *UnitHookType;    /* py_unit_hook.c */
    PyObject *BucketType;     /* py_bucket.c */
} fs_mod_state;

extern PyModuleDef fs_module_def;

fs_mod_state *fs_state_from_type(PyTypeObject *tp);
fs_mod_state *fs_state_from_module(PyObject *m);
/* What each glue file adds to the module (its types, functions and
 * constants), in module.c's order. */
typedef int (*fs_glue_add)(PyObject *module, fs_mod_state *st);
/* The heap type of `spec` made and added to the module under its short
 * name; kept in *slot (a new reference) unless slot is NULL. -1 on failure. */
int fs_add_type(PyObject *module, PyType_Spec *spec, PyObject **slot);

/* Raise for a failed status and return NULL. FS_ERR_PYTHON keeps the
 * exception already set; others raise CoreError (StateError for BAD_STATE)
 * with the formatted context followed by the status text. */
PyObject *fs_raise(fs_mod_state *st, fs_status s, const char *fmt, ...);
/* How a module function ends: None for FS_OK, else fs_raise with `what`
 * (m: the module) and NULL. */
PyObject *fs_result(PyObject *m, fs_status s, const char *what);

/* Data pointer of a torch tensor, through its data_ptr() method. */
int fs_tensor_ptr(PyObject *tensor, void **out);

/* An interned method or attribute name, made at its first use and kept
 * (`var`: a static of the call site). Calls that run at every engine event
 * look their names up this way instead of building a str from a C string
 * each time. NULL with the exception set when it cannot be made. */
#define FS_NAME(var, text) ((var) ? (var) : ((var) = PyUnicode_InternFromString(text)))

typedef struct {
    PyObject_HEAD
    fs_comm *comm;
    fs_ledger ledger;     /* every collective issued through this Comm (ledger.h) */
    PyObject *on_failure; /* on_failure(exc) after a collective failed, or NULL */
    /* kind='device': a backend over device memory, owned by another object */
    PyObject *owner;          /* keeps `comm` alive; it is not destroyed here */
    const fs_device_api *dev; /* the device's kernels (fs_device.h), or NULL on host */
    PyObject *stream_fn;      /* stream_fn() -> the caller's current stream, as an int */
    void *stream;             /* what it returned last (fs_comm_bind_stream) */
    PyObject *empty;          /* empty(numel, dtype_code) -> tensor: float32 staging */
    int device_index;         /* which device of dev's (torch's index), or -1: not given */
    PyObject *on_stop;        /* on_stop(comm, why) when this rank stops, or NULL */
    int stopped;              /* this rank told the others it stopped (py_group.c) */
} CommObject;

/* kind='device': ask stream_fn for the caller's current stream, keep it in
 * self->stream and order the backend's next collectives against it. A no-op
 * for host Comms. -1 with an exception set if stream_fn failed. */
int fs_comm_bind_stream(CommObject *self);

/* py_comm.c: the engine's view of a Comm (an empty link for NULL): its backend,
 * ledger and device table, the GIL handed back around collectives and
 * long loops. The stream is bound per call (py_group.c: fs_glue_group_bind). */
fs_link fs_glue_link(CommObject *comm);

fs_status fs_comm_torch_create(PyObject *fn, int rank, int world_size, fs_comm **out);

/* A collective through `self` failed and its exception is set: add this
 * rank's last ledger entries as a note, and call self.on_failure(exc) (set
 * by flatshard/runtime/diagnostics.py: it compares ledgers across ranks). Returns
 * NULL, with the exception still set. */
PyObject *fs_comm_failed(CommObject *self);

/* None after a successful collective; else raise naming op and tag, with
 * the ledger's note (fs_comm_failed), and NULL. */
PyObject *fs_comm_done(CommObject *self, fs_status s, const char *op, const char *tag);

/* An engine failure as an exception: err's words (a host failure keeps its
 * own exception), `note` added to it (may be NULL; a reference is not
 * taken), and the ledger's account when it failed in a collective. NULL. */
PyObject *fs_glue_failed(PyTypeObject *tp, fs_status s, const char *err, CommObject *comm,
                         int collective, PyObject *note);

/* py_layout.c: a Dim0Entry record; NULL with an exception set. */
PyObject *fs_dim0_entry_record(fs_mod_state *st, const fs_dim0_entry *e);

/* The object a weak reference points at, as a new reference; NULL when it is
 * gone (no exception) or on failure (an exception set). */
PyObject *fs_weak_get(PyObject *ref);

/* k sequences of ints of one length (objs[i]: NULL or None for none, out[i]
 * NULL then) as malloc'd int64 arrays out[i] that the caller frees: that
 * length (0 when none was given), or -1 with an exception set naming `what`
 * and names[i] (nothing to free). */
Py_ssize_t fs_int64_lists(int k, PyObject *const *objs, int64_t **out, const char *what,
                          const char *const *names);

/* The SIMD level a simd= argument names ('auto', 'scalar', 'avx2',
 * 'avx512'), or -1 with ValueError set (`what`, the entry point, first;
 * may be NULL). */
int fs_simd_arg(const char *name, const char *what);

/* py_optim.c: the jobs of a group call (adam_steps', sgd_steps',
 * OffloadPipe.submit's: tuples of pointers) over proto's kind and
 * hyperparameters, each checked, in PyMem arrays *js and *steps (an Adam
 * job's float32 step count) the caller frees. Their count, or -1 with an
 * exception naming `what` (nothing to free). */
Py_ssize_t fs_glue_optim_jobs(PyObject *jobs, const char *what, const fs_optim_job *proto,
                              fs_optim_job **js, float ***steps);

/* A sequence of ints as a malloc'd int64 array (*n elements); NULL with an
 * exception set (`what` is the TypeError's text). */
int64_t *fs_int64_list(PyObject *obj, Py_ssize_t *n, const char *what);

#endif
