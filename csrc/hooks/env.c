/* env.c - the engine's host table (engine.h) over torch: tensors'
 * data pointers, storages given and taken their bytes ([Note: pooled
 * storage] in storage.c), memory for one operation, references held
 * across a deferred collective. Engine calls run with the GIL held
 * (the engine hands it back around collectives and long loops: the links'
 * unlock/lock); so do these entries. Every handle the engine releases is a
 * Python object: a tensor, or a capsule over host memory. ctx is the
 * address of the owner's `empty` (device memory from it; NULL: host
 * memory). */
#include "env.h"

#include "storage.h"

#include <stdlib.h>
#include <string.h>


static fs_status env_data(void *ctx, void *tensor, void **ptr)
{
    int rc = fs_tensor_ptr((PyObject *)tensor, ptr);
    return rc < 0 ? FS_ERR_HOST : FS_OK;
}

static fs_status env_set_storage(void *ctx, void *storage, int64_t nbytes, void **data)
{
    PyObject *empty = *(PyObject **)ctx;
    int rc = fs_hooks_set_storage((PyObject *)storage, nbytes, empty != NULL);
    *data = NULL;
    return rc < 0 ? FS_ERR_HOST : FS_OK;
}

/* Host memory as a Python object: a capsule whose destructor frees it. */
static void host_free(PyObject *cap)
{
    free(PyCapsule_GetPointer(cap, "flatshard.host"));
}
static void staging_free(PyObject *cap)
{
    fs_hooks_give_staging(PyCapsule_GetPointer(cap, "flatshard.staging"));
}

static fs_status env_take(void *ctx, int64_t nbytes, unsigned flags, void **data, void **handle)
{
    PyObject *empty = *(PyObject **)ctx;
    PyObject *h = NULL;
    void *p = NULL;
    if (empty) { /* torch's allocator on the device: its statistics stay true */
        if ((h = PyObject_CallFunction(empty, "Li", (long long)nbytes, FS_U8)) &&
            (flags & FS_TAKE_ZERO)) {
            PyObject *r = PyObject_CallMethod(h, "zero_", NULL);
            Py_XDECREF(r);
            if (!r)
                Py_CLEAR(h);
        }
        if (h && fs_tensor_ptr(h, &p) < 0)
            Py_CLEAR(h);
    } else if (flags & (FS_TAKE_TRANSIENT | FS_TAKE_STAGING)) { /* staging: the pool's */
        if ((p = fs_hooks_take_staging(nbytes))) {
            if (flags & FS_TAKE_ZERO)
                memset(p, 0, (size_t)nbytes);
            if (!(h = PyCapsule_New(p, "flatshard.staging", staging_free)))
                fs_hooks_give_staging(p);
        }
    } else {
        p = flags & FS_TAKE_ZERO ? calloc(1, (size_t)nbytes) : malloc((size_t)nbytes);
        if (!p)
            PyErr_NoMemory();
        else if (!(h = PyCapsule_New(p, "flatshard.host", host_free)))
            free(p);
    }
    *data = p;
    *handle = h;
    return h ? FS_OK : FS_ERR_HOST;
}

static void env_release(void *ctx, void *handle)
{
    Py_XDECREF((PyObject *)handle);
}

static void *env_hold(void *ctx, void *tensor)
{
    Py_XINCREF((PyObject *)tensor);
    return tensor;
}

fs_env fs_hooks_env(PyObject **empty)
{
    return (fs_env){empty, env_data, env_set_storage, env_take, env_release, env_hold};
}
