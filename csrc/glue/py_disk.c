/* py_disk.c - flatshard._C.disk_adam_step: the glue of optim_disk.c.
 * Buffers cross as data pointers of contiguous fp32 tensors and file
 * descriptors as ints; python/flatshard/optim/disk_offload.py checks them, opens
 * and renames the files. The GIL is released for the whole step. */
#include "fs_py.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "optim_disk.h"

PyDoc_STRVAR(disk_adam_step_doc,
             "disk_adam_step(fd_in, fd_out, segments, chunk_numel, nslots, *, lr, beta1, beta2,\n"
             "               eps, weight_decay, decoupled, maximize, threads=1)\n"
             "-> (bytes_read, bytes_written)\n"
             "One Adam/AdamW step with the moments streamed from fd_in (-1: zeros) to fd_out.\n"
             "segments: [(param_ptr, grad_ptr or 0, n, file_offset, step), ...]. An I/O error\n"
             "raises OSError with its errno.");
static PyObject *py_disk_adam_step(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"fd_in", "fd_out", "segments", "chunk_numel", "nslots", "lr",
                             "beta1", "beta2", "eps", "weight_decay", "decoupled", "maximize",
                             "threads", NULL};
    int fd_in, fd_out, nslots, decoupled = 1, maximize = 0, threads = 1;
    long long chunk;
    PyObject *segments;
    float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.0f;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiOLi|$fffffppi", kwlist, &fd_in, &fd_out,
                                     &segments, &chunk, &nslots, &lr, &b1, &b2, &eps, &wd,
                                     &decoupled, &maximize, &threads))
        return NULL;
    PyObject *seq = PySequence_Fast(segments, "disk_adam_step: segments must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    fs_disk_segment *segs = NULL;
    PyObject *res = NULL, *text = NULL, *e = NULL;
    if (n > 1 << 30) {
        PyErr_Format(PyExc_ValueError, "disk_adam_step: too many segments");
        goto done;
    }
    if (!(segs = calloc(n ? (size_t)n : 1, sizeof(fs_disk_segment)))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long p, g;
        long long cnt, off, step;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "KKLLL;disk_adam_step: each "
                              "segment is (param_ptr, grad_ptr, n, file_offset, step)",
                              &p, &g, &cnt, &off, &step))
            goto done;
        segs[i] = (fs_disk_segment){(float *)p, (const float *)g, cnt, off, step};
    }
    fs_disk_stream s = {.fd_in = fd_in, .fd_out = fd_out, .chunk_numel = chunk,
                        .nslots = nslots, .threads = threads};
    fs_adam_hparams h = {lr, b1, b2, eps, wd, 1, decoupled, maximize};
    fs_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fs_disk_adam_step(&s, segs, (int)n, &h, fs_simd_best());
    Py_END_ALLOW_THREADS
    if (st == FS_ERR_BACKEND) { /* OSError(errno, text), as open() raises it */
        text = PyUnicode_FromFormat("flatshard: disk offload: %s the optimizer state file "
                                    "failed: %s", s.err_write ? "writing" : "reading",
                                    strerror(s.err));
        if (text && (e = Py_BuildValue("(iO)", s.err, text)))
            PyErr_SetObject(PyExc_OSError, e);
    } else if (st != FS_OK) {
        fs_raise(fs_state_from_module(m), st, "disk_adam_step: need chunk_numel > 0, "
                 "nslots >= 2, fd_out >= 0, n >= 0, step >= 1");
    } else {
        res = Py_BuildValue("LL", (long long)s.bytes_read, (long long)s.bytes_written);
    }
done:
    Py_XDECREF(e);
    Py_XDECREF(text);
    free(segs);
    Py_DECREF(seq);
    return res;
}

static PyMethodDef disk_methods[] = {
    {"disk_adam_step", (PyCFunction)(void (*)(void))py_disk_adam_step,
     METH_VARARGS | METH_KEYWORDS, disk_adam_step_doc},
    {NULL},
};

int fs_disk_add(PyObject *module, fs_mod_state *st)
{
    return PyModule_AddFunctions(module, disk_methods);
}
