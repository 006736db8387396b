/* storage.c - host units' unsharded buffers from flatshard's pool
 * (pool.h) instead of torch's CPU allocator: torch storages over pool
 * blocks (glue/py_pool.c has the module functions that show and steer the
 * pool).
 *
 * [Note: pooled storage] A unit's full (or lp) buffer is a torch storage
 * that views and autograd-saved tensors refer to, so its StorageImpl must
 * stay the same object across reshard/unshard; only the memory behind it
 * changes. Unsharding takes a block from the pool, wraps it as a DLPack
 * tensor (whose deleter hands the block back) and swaps that tensor's data
 * pointer into the unit's storage (UntypedStorage._swap_data_ptr_, the
 * mechanism torch's CUDA-graph trees use for the same purpose); resharding
 * swaps in a fresh empty storage and drops it, which runs the deleter. So
 * a resharded buffer still has a zero-byte storage, which is what the rest
 * of flatshard reads as "resharded". Device units keep storage resize_
 * (torch's caching allocator already reuses device blocks). Host blocks come
 * from the process's pool (pool.h: fs_pool_process). */
#include "storage.h"

#include <stdlib.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "dlpack.h"
#include "pool.h"

static PyObject *from_dlpack; /* torch._C._from_dlpack (a capsule in, no Python
                               * wrapper around it), else torch.utils.dlpack's */
static int have_swap = -1;    /* torch's UntypedStorage has _swap_data_ptr_ (else resize_) */
static PyObject *storage_type; /* torch.UntypedStorage */

typedef struct {
    DLManagedTensor managed;
    int64_t shape[1];
    void *block;
    size_t mapped; /* a mapping of its own (mapped_storage), unmapped at the end; 0: pooled */
} pooled_dl;

static void pooled_dl_delete(DLManagedTensor *self)
{
    pooled_dl *o = self->manager_ctx;
    if (o->mapped)
        fs_unmap(o->block, o->mapped);
    else
        fs_pool_give(fs_pool_process(), o->block);
    free(o);
}

static void capsule_destructor(PyObject *cap)
{
    /* Renamed to "used_dltensor" once torch took ownership. */
    if (PyCapsule_IsValid(cap, "dltensor")) {
        DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
        m->deleter(m);
    }
}

static int torch_refs(void)
{
    if (from_dlpack)
        return 0;
    PyObject *dl = PyImport_ImportModule("torch.utils.dlpack");
    PyObject *torch = dl ? PyImport_ImportModule("torch") : NULL;
    PyObject *tc = torch ? PyObject_GetAttrString(torch, "_C") : NULL;
    if (tc) {
        from_dlpack = PyObject_GetAttrString(tc, "_from_dlpack");
        if (!from_dlpack) {
            PyErr_Clear();
            from_dlpack = PyObject_GetAttrString(dl, "from_dlpack");
        }
        storage_type = from_dlpack ? PyObject_GetAttrString(torch, "UntypedStorage") : NULL;
    }
    Py_XDECREF(dl);
    Py_XDECREF(tc);
    Py_XDECREF(torch);
    if (!storage_type)
        Py_CLEAR(from_dlpack);
    else
        have_swap = PyObject_HasAttrString(storage_type, "_swap_data_ptr_");
    return from_dlpack ? 0 : -1;
}

/* A DLPack record for a storage to come (torch's references found first);
 * NULL with the exception set. */
static pooled_dl *new_record(void)
{
    if (torch_refs() < 0)
        return NULL;
    pooled_dl *o = calloc(1, sizeof *o);
    if (!o)
        PyErr_NoMemory();
    return o;
}

/* A uint8 storage over o->block (nbytes); o is torch's from here on, or
 * freed with its memory on failure. */
static PyObject *storage_over(pooled_dl *o, int64_t nbytes)
{
    o->shape[0] = nbytes;
    DLTensor *d = &o->managed.dl_tensor;
    d->data = o->block;
    d->device.device_type = FS_kDLCPU;
    d->ndim = 1;
    d->shape = o->shape;
    d->dtype = (DLDataType){FS_kDLUInt, 8, 1};
    o->managed.manager_ctx = o;
    o->managed.deleter = pooled_dl_delete;
    PyObject *cap = PyCapsule_New(&o->managed, "dltensor", capsule_destructor);
    if (!cap) {
        pooled_dl_delete(&o->managed);
        return NULL;
    }
    PyObject *t = PyObject_CallOneArg(from_dlpack, cap);
    Py_DECREF(cap); /* torch owns the block now, or the destructor gave it back */
    if (!t)
        return NULL;
    static PyObject *name;
    PyObject *st = FS_NAME(name, "untyped_storage") ? PyObject_CallMethodNoArgs(t, name) : NULL;
    Py_DECREF(t);
    return st;
}

/* A new uint8 storage over a pool block of nbytes; the block goes back to
 * the pool when torch drops the storage's data pointer. */
PyObject *fs_hooks_pooled_storage(int64_t nbytes, int cacheable)
{
    pooled_dl *o = new_record();
    if (!o)
        return NULL;
    fs_status s;
    if ((size_t)nbytes <= FS_POOL_SMALL_BYTES) { /* a cached block, or a short mapping */
        s = fs_pool_take(fs_pool_process(), (size_t)nbytes, cacheable, &o->block);
    } else {
        Py_BEGIN_ALLOW_THREADS /* mapping and faulting in a unit's pages takes a while */
        s = fs_pool_take(fs_pool_process(), (size_t)nbytes, cacheable, &o->block);
        Py_END_ALLOW_THREADS
    }
    if (s != FS_OK) {
        free(o);
        return PyErr_Format(PyExc_MemoryError, "flatshard: cannot map %lld bytes of host memory "
                            "for an unsharded buffer: not enough memory", (long long)nbytes);
    }
    return storage_over(o, nbytes);
}

static int swap_into(PyObject *storage, PyObject *other)
{
    static PyObject *name;
    PyObject *r = FS_NAME(name, "_swap_data_ptr_")
                      ? PyObject_CallMethodOneArg(storage, name, other) : NULL;
    Py_XDECREF(r);
    return r ? 0 : -1;
}

static int64_t storage_nbytes(PyObject *storage)
{
    static PyObject *name;
    PyObject *r = FS_NAME(name, "nbytes") ? PyObject_CallMethodNoArgs(storage, name) : NULL;
    if (!r)
        return -1;
    long long n = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return n;
}

int fs_hooks_set_storage(PyObject *storage, int64_t nbytes, int on_device)
{
    if (!on_device && torch_refs() < 0)
        return -1;
    /* A device: torch's allocator, [Note: pooled storage]. A torch without
     * _swap_data_ptr_ (older releases) takes the same path on the host. */
    if (on_device || !have_swap) {
        PyObject *r = PyObject_CallMethod(storage, "resize_", "L", (long long)nbytes);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    int64_t now = storage_nbytes(storage);
    if (now < 0)
        return -1;
    if (now == nbytes)
        return 0;
    PyObject *other = NULL;
    int rc = -1;
    if (now > 0) { /* back to zero bytes first; the block returns to the pool */
        if (torch_refs() < 0 || !(other = PyObject_CallNoArgs(storage_type)) ||
            swap_into(storage, other) < 0)
            goto done;
        Py_CLEAR(other);
    }
    if (nbytes == 0)
        rc = 0;
    else if ((other = fs_hooks_pooled_storage(nbytes, 1)))
        rc = swap_into(storage, other);
done:
    Py_XDECREF(other); /* after a swap, what the storage held; after a failed one, its own */
    return rc;
}

void *fs_hooks_take_staging(int64_t nbytes)
{
    void *p = NULL;
    if (fs_pool_take(fs_pool_process(), (size_t)nbytes, 1, &p) != FS_OK)
        return PyErr_Format(PyExc_MemoryError, "flatshard: cannot map %lld bytes of host "
                            "memory for a collective's staging buffer: not enough memory",
                            (long long)nbytes);
    return p;
}

void fs_hooks_give_staging(void *p)
{
    if (p)
        fs_pool_give(fs_pool_process(), p);
}

PyObject *fs_hooks_mapped_storage(int64_t n, int threads)
{
    pooled_dl *o = new_record();
    if (!o)
        return NULL;
    fs_status s;
    Py_BEGIN_ALLOW_THREADS /* faulting in the pages takes a while */
    s = fs_map_resident((size_t)n, threads, &o->block, &o->mapped);
    Py_END_ALLOW_THREADS
    if (s != FS_OK) {
        free(o);
        return PyErr_Format(PyExc_MemoryError, "flatshard: cannot map %lld bytes of host memory "
                            "for optimizer state: not enough memory", (long long)n);
    }
    return storage_over(o, n);
}
