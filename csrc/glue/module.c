/* module.c - flatshard._C's init: the module's state, its exceptions and
 * constants, and each glue file's types and functions added in turn
 * (py_comm.c, py_unit.c, py_shard_group.c, py_kernels.c, ...). Nothing else: the
 * helpers every glue file calls are py_helpers.c's.
 *
 * CPython C API only (no binding generator, no torch headers). Multi-phase
 * init, module state, heap types (see fs_py.h). */
#include "fs_py.h"

#include "unit_fsm.h"

/* ---------------------------------------------------------------------------
 * module init */

static int add_constants(PyObject *m)
{
#define C(name, v) if (PyModule_AddIntConstant(m, name, v) < 0) return -1
    C("F32", FS_F32); C("F16", FS_F16); C("BF16", FS_BF16); C("F64", FS_F64);
    C("U8", FS_U8); C("I32", FS_I32); C("I64", FS_I64);
    C("EV_PRE_FORWARD", FS_EV_PRE_FORWARD); C("EV_POST_FORWARD", FS_EV_POST_FORWARD);
    C("EV_PRE_BACKWARD", FS_EV_PRE_BACKWARD); C("EV_POST_BACKWARD", FS_EV_POST_BACKWARD);
    C("EV_FINALIZE", FS_EV_FINALIZE); C("EV_SUMMON_ENTER", FS_EV_SUMMON_ENTER);
    C("EV_SUMMON_EXIT", FS_EV_SUMMON_EXIT);
    C("ACT_UNSHARD", FS_ACT_UNSHARD); C("ACT_RESHARD", FS_ACT_RESHARD);
    C("ACT_REDUCE_GRAD", FS_ACT_REDUCE_GRAD); C("ACT_HOOK_BACKWARD", FS_ACT_HOOK_BACKWARD);
    C("FLAG_GRAD_ENABLED", FS_FLAG_GRAD_ENABLED); C("FLAG_NO_SYNC", FS_FLAG_NO_SYNC);
    C("STATE_IDLE", FS_STATE_IDLE); C("STATE_FORWARD", FS_STATE_FORWARD);
    C("STATE_BACKWARD_PRE", FS_STATE_BACKWARD_PRE); C("STATE_BACKWARD_POST", FS_STATE_BACKWARD_POST);
    C("STATE_SUMMON", FS_STATE_SUMMON);
    C("FULL_SHARD", FS_FULL_SHARD); C("SHARD_GRAD_OP", FS_SHARD_GRAD_OP); C("NO_SHARD", FS_NO_SHARD);
    C("SHARD_OPTIM", FS_SHARD_OPTIM);
    C("SHM_SECTIONS", FS_SHM_SECTIONS);
#undef C
    return 0;
}

/* Each glue file's types, functions and constants (fs_glue_add), in turn. */
int fs_comm_type_add(PyObject *module, fs_mod_state *st);        /* py_comm.c */
int fs_unit_type_add(PyObject *module, fs_mod_state *st);        /* py_unit.c */
int fs_optim_add(PyObject *module, fs_mod_state *st);            /* py_optim.c */
int fs_layout_add(PyObject *module, fs_mod_state *st);           /* py_layout.c */
int fs_divide_add(PyObject *module, fs_mod_state *st);           /* py_divide.c */
int fs_shard_group_type_add(PyObject *module, fs_mod_state *st); /* py_shard_group.c */
int fs_latch_type_add(PyObject *module, fs_mod_state *st);       /* py_latch.c */
int fs_arrival_type_add(PyObject *module, fs_mod_state *st);     /* py_arrival.c */
int fs_event_type_add(PyObject *module, fs_mod_state *st);       /* py_event.c */
int fs_unit_hook_type_add(PyObject *module, fs_mod_state *st);   /* py_unit_hook.c */
int fs_bucket_type_add(PyObject *module, fs_mod_state *st);      /* py_bucket.c */
int fs_disk_add(PyObject *module, fs_mod_state *st);             /* py_disk.c */
int fs_glue_pool_add(PyObject *module, fs_mod_state *st);        /* py_pool.c */
int fs_kernels_add(PyObject *module, fs_mod_state *st);          /* py_kernels.c */
int fs_quant_add(PyObject *module, fs_mod_state *st);            /* py_quant.c */
int fs_offload_pipe_type_add(PyObject *module, fs_mod_state *st); /* py_offload_pipe.c */
int fs_eager_type_add(PyObject *module, fs_mod_state *st);       /* py_eager.c */
int fs_snapshot_type_add(PyObject *module, fs_mod_state *st);    /* py_snapshot.c */

static const fs_glue_add glue_adds[] = {
    fs_comm_type_add, fs_unit_type_add, fs_optim_add, fs_layout_add, fs_divide_add,
    fs_shard_group_type_add, fs_latch_type_add, fs_arrival_type_add, fs_event_type_add,
    fs_unit_hook_type_add, fs_bucket_type_add, fs_disk_add, fs_glue_pool_add, fs_kernels_add,
    fs_quant_add, fs_offload_pipe_type_add, fs_eager_type_add, fs_snapshot_type_add,
};

static int module_exec(PyObject *m)
{
    fs_mod_state *st = fs_state_from_module(m);
    st->CoreError = PyErr_NewExceptionWithDoc(
        "flatshard._C.CoreError", "An error reported by flatshard's C core.", PyExc_RuntimeError, NULL);
    if (!st->CoreError || PyModule_AddObjectRef(m, "CoreError", st->CoreError) < 0)
        return -1;
    st->StateError = PyErr_NewExceptionWithDoc(
        "flatshard._C.StateError", "An event the unit state machine does not allow now.",
        st->CoreError, NULL);
    if (!st->StateError || PyModule_AddObjectRef(m, "StateError", st->StateError) < 0)
        return -1;
    for (size_t i = 0; i < sizeof glue_adds / sizeof glue_adds[0]; i++)
        if (glue_adds[i](m, st) < 0)
            return -1;
    if (add_constants(m) < 0)
        return -1;
    PyObject *api = PyCapsule_New((void *)&fs_host_device_api, FS_DEVICE_API_CAPSULE, NULL);
    int rc = api ? PyModule_AddObjectRef(m, "host_device_api", api) : -1;
    Py_XDECREF(api);
    return rc;
}

/* The state's fields as the array they are (fs_py.h: only objects). */
#define STATE_FIELDS(st) ((PyObject **)(st))
#define STATE_NFIELDS (sizeof(fs_mod_state) / sizeof(PyObject *))

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    fs_mod_state *st = fs_state_from_module(m);
    for (size_t i = 0; st && i < STATE_NFIELDS; i++)
        Py_VISIT(STATE_FIELDS(st)[i]);
    return 0;
}

static int module_clear(PyObject *m)
{
    fs_mod_state *st = fs_state_from_module(m);
    for (size_t i = 0; st && i < STATE_NFIELDS; i++)
        Py_CLEAR(STATE_FIELDS(st)[i]);
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyModuleDef fs_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "flatshard._C",
    .m_doc = "flatshard's C core: flat layouts, copies, the unit state machine, collectives.",
    .m_size = sizeof(fs_mod_state),
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&fs_module_def); }
