/* py_quant.c - flatshard._C's entry points to the quantization kernels
 * (quant.h), for tests and benchmarks: raw data pointers (ints from
 * Tensor.data_ptr()) with numel and dtype codes, as py_kernels.c's. The
 * engine calls the kernels itself (engine/link_quant.c); nothing here is
 * on its path. */
#include "fs_py.h"

#include "quant.h"

PyDoc_STRVAR(quant_payload_bytes_doc,
             "quant_payload_bytes(numel, bits, block) -> bytes of the quantized payload\n"
             "of numel values (csrc/core/quant.h, [Note: quantized payload]).");
static PyObject *py_quant_payload_bytes(PyObject *m, PyObject *args)
{
    long long n, block;
    int bits;
    if (!PyArg_ParseTuple(args, "LiL", &n, &bits, &block))
        return NULL;
    if (!fs_quant_valid(bits, block) || n < 0)
        return PyErr_Format(PyExc_ValueError, "quant_payload_bytes: bits must be 8 or 4 and "
                            "block a positive multiple of %d up to %d, numel >= 0",
                            FS_QUANT_BLOCK_MULTIPLE, FS_QUANT_BLOCK_MAX);
    return PyLong_FromLongLong(fs_quant_payload_bytes(n, bits, block));
}

PyDoc_STRVAR(quantize_doc,
             "quantize(payload_ptr, src_ptr, src_dtype, numel, bits, block, simd='auto')\n"
             "payload <- numel values of src, block-wise ([Note: quantization rule]).");
static PyObject *py_quantize(PyObject *m, PyObject *args)
{
    unsigned long long pp, sp;
    int t, bits;
    long long n, block;
    const char *simd_name = "auto";
    if (!PyArg_ParseTuple(args, "KKiLiL|s", &pp, &sp, &t, &n, &bits, &block, &simd_name))
        return NULL;
    const int simd = fs_simd_arg(simd_name, "quantize");
    if (simd < 0)
        return NULL;
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_quantize((void *)pp, (const void *)sp, t, n, bits, block, (fs_simd)simd);
    Py_END_ALLOW_THREADS
    return fs_result(m, s, "quantize: bits 8 or 4, a valid block, a float dtype");
}

PyDoc_STRVAR(dequantize_doc,
             "dequantize(dst_ptr, dst_dtype, payload_ptr, numel, bits, block, accumulate,\n"
             "simd='auto'): dst <- (accumulate ? dst : 0) + the payload's values (accumulate:\n"
             "a float32 dst).");
static PyObject *py_dequantize(PyObject *m, PyObject *args)
{
    unsigned long long dp, pp;
    int t, bits, acc;
    long long n, block;
    const char *simd_name = "auto";
    if (!PyArg_ParseTuple(args, "KiKLiLp|s", &dp, &t, &pp, &n, &bits, &block, &acc,
                          &simd_name))
        return NULL;
    const int simd = fs_simd_arg(simd_name, "dequantize");
    if (simd < 0)
        return NULL;
    fs_status s;
    Py_BEGIN_ALLOW_THREADS
    s = fs_dequantize((void *)dp, t, (const void *)pp, n, bits, block, acc, (fs_simd)simd);
    Py_END_ALLOW_THREADS
    return fs_result(m, s, "dequantize: bits 8 or 4, a valid block, a float dtype "
                           "(float32 to accumulate)");
}

static PyMethodDef quant_methods[] = {
    {"quant_payload_bytes", py_quant_payload_bytes, METH_VARARGS, quant_payload_bytes_doc},
    {"quantize", py_quantize, METH_VARARGS, quantize_doc},
    {"dequantize", py_dequantize, METH_VARARGS, dequantize_doc},
    {NULL},
};

int fs_quant_add(PyObject *m, fs_mod_state *st)
{
    return PyModule_AddFunctions(m, quant_methods);
}
