/* py_pool.c - the module functions that show and steer the host pool
 * (pool.h) whose blocks the units' storages use (hooks/storage.c), and the
 * heap trim. */
#include "py_pool.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "pool.h"
#include "storage.h"

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
    return fs_hooks_pooled_storage(n, cache);
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
    return fs_hooks_mapped_storage(n, threads);
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
    {"pool_set_keep", py_pool_set_keep, METH_VARARGS, pool_set_keep_doc},
    {"pool_storage", (PyCFunction)(void (*)(void))py_pool_storage, METH_VARARGS | METH_KEYWORDS,
     pool_storage_doc},
    {NULL},
};

int fs_glue_pool_add(PyObject *module, fs_mod_state *st)
{
    return PyModule_AddFunctions(module, pool_methods);
}
