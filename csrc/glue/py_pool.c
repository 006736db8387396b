/* py_pool.c - host units' unsharded buffers from flatshard's pool
 * (pool.h) instead of torch's CPU allocator, and the module functions that
 * show and steer the pool.
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
#include "py_pool.h"

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
static PyObject *pooled_storage(int64_t nbytes, int cacheable)
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

int fs_glue_set_storage(PyObject *storage, int64_t nbytes, int on_device)
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
    else if ((other = pooled_storage(nbytes, 1)))
        rc = swap_into(storage, other);
done:
    Py_XDECREF(other); /* after a swap, what the storage held; after a failed one, its own */
    return rc;
}

void *fs_glue_take_staging(int64_t nbytes)
{
    void *p = NULL;
    if (fs_pool_take(fs_pool_process(), (size_t)nbytes, 1, &p) != FS_OK)
        return PyErr_Format(PyExc_MemoryError, "flatshard: cannot map %lld bytes of host "
                            "memory for a collective's staging buffer: not enough memory",
                            (long long)nbytes);
    return p;
}

void fs_glue_give_staging(void *p)
{
    if (p)
        fs_pool_give(fs_pool_process(), p);
}

/* ---------------------------------------------------------------------------
 * module functions */

PyDoc_STRVAR(pool_stats_doc,
             "pool_stats() -> dict: the host pool of unsharded buffers: live_bytes (handed\n"
             "out now), cached_bytes (free, kept resident for the next gather),\n"
             "peak_live_bytes, and counts of maps, reuses and unmaps.");
static PyObject *py_pool_stats(PyObject *m, PyObject *Py_UNUSED(a))
{
    fs_pool_stats s = fs_pool_get_stats(fs_pool_process());
    return Py_BuildValue("{sKsKsKsKsKsK}", "live_bytes", (unsigned long long)s.live_bytes,
                         "cached_bytes", (unsigned long long)s.cached_bytes, "peak_live_bytes",
                         (unsigned long long)s.peak_live_bytes, "maps",
                         (unsigned long long)s.maps, "reuses", (unsigned long long)s.reuses,
                         "unmaps", (unsigned long long)s.unmaps);
}

PyDoc_STRVAR(pool_trim_doc, "pool_trim(idle_only=False) -> bytes returned to the system: unmap\n"
                            "the free cached blocks (idle_only: only when none is in use).");
static PyObject *py_pool_trim(PyObject *m, PyObject *args)
{
    int idle_only = 0;
    if (!PyArg_ParseTuple(args, "|p", &idle_only))
        return NULL;
    fs_pool *pool = fs_pool_process();
    size_t r = idle_only ? fs_pool_trim_idle(pool) : fs_pool_trim(pool);
    return PyLong_FromSize_t(r);
}

PyDoc_STRVAR(pool_reset_peak_doc, "pool_reset_peak(): peak_live_bytes restarts from now.");
static PyObject *py_pool_reset_peak(PyObject *m, PyObject *Py_UNUSED(a))
{
    fs_pool_reset_peak(fs_pool_process());
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pool_set_keep_doc,
             "pool_set_keep(blocks): how many free blocks the pool keeps resident\n"
             "(default 2: the next unit's gather and one prefetch).");
static PyObject *py_pool_set_keep(PyObject *m, PyObject *args)
{
    int keep;
    if (!PyArg_ParseTuple(args, "i", &keep))
        return NULL;
    if (keep < 0)
        return PyErr_Format(PyExc_ValueError, "pool_set_keep: blocks must be >= 0, got %d", keep);
    fs_pool_set_keep(fs_pool_process(), keep);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pool_storage_doc,
             "pool_storage(nbytes, cache=True) -> UntypedStorage over a pool block: the\n"
             "block goes back to the pool when the storage's memory is dropped, and is\n"
             "kept for the next request of its size (cache) or unmapped at once.");
static PyObject *py_pool_storage(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"nbytes", "cache", NULL};
    long long n;
    int cache = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|p", kwlist, &n, &cache))
        return NULL;
    if (n <= 0)
        return PyErr_Format(PyExc_ValueError, "pool_storage: nbytes must be > 0, got %lld", n);
    return pooled_storage(n, cache);
}

PyDoc_STRVAR(mapped_storage_doc,
             "mapped_storage(nbytes, threads=1) -> UntypedStorage, zero-filled, over a\n"
             "mapping of its own (huge pages from 2 MiB, where the system gives them without\n"
             "a stall), populated by up to `threads` threads, unmapped when the storage's\n"
             "memory is dropped: for optimizer state, streamed whole every step.");
static PyObject *py_mapped_storage(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"nbytes", "threads", NULL};
    long long n;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L|i", kwlist, &n, &threads))
        return NULL;
    if (threads < 1)
        return PyErr_Format(PyExc_ValueError, "mapped_storage: threads must be >= 1, got %d",
                            threads);
    if (n <= 0)
        return PyErr_Format(PyExc_ValueError, "mapped_storage: nbytes must be > 0, got %lld", n);
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
                            "for optimizer state: not enough memory", n);
    }
    return storage_over(o, n);
}

/* [Note: heap trim] (runtime/heap.py): what units freed since the last trim */
#define FS_HEAP_TRIM_BYTES ((int64_t)64 << 20)
static int64_t heap_pending;

static void heap_trim_now(void)
{
    heap_pending = 0;
#ifdef __GLIBC__
    Py_BEGIN_ALLOW_THREADS
    malloc_trim(0);
    Py_END_ALLOW_THREADS
#endif
}

void fs_glue_heap_freed(int64_t nbytes, int last)
{
    heap_pending += nbytes;
    if (heap_pending >= FS_HEAP_TRIM_BYTES || last)
        heap_trim_now();
}

PyDoc_STRVAR(heap_trim_doc,
             "heap_trim() -> bool: hand the C library heap's free pages back to the system\n"
             "(glibc's malloc_trim; False where there is none). What torch frees in a\n"
             "backward pass (activations, unit gradients) stays in that heap otherwise, and\n"
             "the next large request is mapped anew beside it.");
static PyObject *py_heap_trim(PyObject *m, PyObject *Py_UNUSED(a))
{
    heap_trim_now();
#ifdef __GLIBC__
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

PyDoc_STRVAR(heap_pending_doc, "heap_pending() -> int: bytes freed since the last trim.");
static PyObject *py_heap_pending(PyObject *m, PyObject *Py_UNUSED(a))
{
    return PyLong_FromLongLong(heap_pending);
}

static PyMethodDef pool_methods[] = {
    {"heap_trim", py_heap_trim, METH_NOARGS, heap_trim_doc},
    {"heap_pending", py_heap_pending, METH_NOARGS, heap_pending_doc},
    {"mapped_storage", (PyCFunction)(void (*)(void))py_mapped_storage, METH_VARARGS | METH_KEYWORDS,
     mapped_storage_doc},
    {"pool_stats", py_pool_stats, METH_NOARGS, pool_stats_doc},
    {"pool_trim", py_pool_trim, METH_VARARGS, pool_trim_doc},
    {"pool_reset_peak", py_pool_reset_peak, METH_NOARGS, pool_reset_peak_doc},
    {"pool_set_keep", py_pool_set_keep, METH_VARARGS, pool_set_keep_doc},
    {"pool_storage", (PyCFunction)(void (*)(void))py_pool_storage, METH_VARARGS | METH_KEYWORDS,
     pool_storage_doc},
    {NULL},
};

int fs_glue_pool_add(PyObject *module)
{
    return PyModule_AddFunctions(module, pool_methods);
}
