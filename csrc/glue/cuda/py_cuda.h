/* py_cuda.h - what the CPython glue of flatshard._C_cuda shares
 * (module_cuda.c: module init; py_cuda.c: the kernels' entry points;
 * py_nccl.c: the NcclComm type). The
 * kernels and the NCCL backend they wrap are csrc/cuda/'s (fs_cuda.h);
 * this folder only parses arguments and raises. */
#ifndef FS_PY_CUDA_H
#define FS_PY_CUDA_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "comm.h"
#include "fs_cuda.h"

#if PY_VERSION_HEX < 0x030D0000
#define Py_IsFinalizing _Py_IsFinalizing /* public from 3.13 */
#endif

/* Only objects: module_cuda.c visits and clears the fields as one array. */
typedef struct {
    PyObject *CudaError; /* RuntimeError */
    PyObject *NcclError; /* CudaError */
    PyObject *NcclCommType;
} cuda_state;

extern PyModuleDef fs_cuda_module_def; /* module_cuda.c */
/* py_cuda.c: the module state of one of the module's types. */
cuda_state *fs_cuda_state_of_type(PyTypeObject *tp);
/* py_cuda.c: the kernels' entry points added to the module. */
int fs_cuda_kernels_add(PyObject *module);
/* py_nccl.c: create flatshard._C_cuda.NcclComm into st->NcclCommType and the module. */
int fs_nccl_type_add(PyObject *module, cuda_state *st);

#endif
