/* module_cuda.c - flatshard._C_cuda's module init: its state, exceptions and
 * constants, and each glue file's functions and types added in turn
 * (py_cuda.c: the kernels' entry points; py_nccl.c: NcclComm), as
 * module.c is flatshard._C's. */
#include "py_cuda.h"

static int module_exec(PyObject *m)
{
    cuda_state *st = PyModule_GetState(m);
    st->CudaError = PyErr_NewExceptionWithDoc("flatshard._C_cuda.CudaError",
                                              "A CUDA error in a flatshard kernel or call.",
                                              PyExc_RuntimeError, NULL);
    if (!st->CudaError || PyModule_AddObjectRef(m, "CudaError", st->CudaError) < 0)
        return -1;
    st->NcclError = PyErr_NewExceptionWithDoc("flatshard._C_cuda.NcclError",
                                              "An NCCL error (the message names the collective).",
                                              st->CudaError, NULL);
    if (!st->NcclError || PyModule_AddObjectRef(m, "NcclError", st->NcclError) < 0)
        return -1;
    if (fs_cuda_kernels_add(m) < 0 || fs_nccl_type_add(m, st) < 0)
        return -1;
    if (PyModule_AddIntConstant(m, "SEGMENTS_PER_LAUNCH", FS_CUDA_SEGMENTS) < 0)
        return -1;
    PyObject *api = PyCapsule_New((void *)&fs_cuda_device_api, FS_DEVICE_API_CAPSULE, NULL);
    int rc = api ? PyModule_AddObjectRef(m, "device_api", api) : -1;
    Py_XDECREF(api);
    return rc;
}

/* The state's fields as the array they are (py_cuda.h: only objects). */
#define STATE_FIELDS(st) ((PyObject **)(st))
#define STATE_NFIELDS (sizeof(cuda_state) / sizeof(PyObject *))

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    cuda_state *st = PyModule_GetState(m);
    for (size_t i = 0; st && i < STATE_NFIELDS; i++)
        Py_VISIT(STATE_FIELDS(st)[i]);
    return 0;
}

static int module_clear(PyObject *m)
{
    cuda_state *st = PyModule_GetState(m);
    for (size_t i = 0; st && i < STATE_NFIELDS; i++)
        Py_CLEAR(STATE_FIELDS(st)[i]);
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyModuleDef fs_cuda_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "flatshard._C_cuda",
    .m_doc = "flatshard's CUDA kernels and NCCL backend (device pointers, explicit streams).",
    .m_size = sizeof(cuda_state),
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
};

PyMODINIT_FUNC PyInit__C_cuda(void) { return PyModuleDef_Init(&fs_cuda_module_def); }
