/* py_divide.c - flatshard._C.grad_divide and _C.reduce_dtype: core/reduce_rule.c's
 * factors as a dict and its reduce dtype as a code, for Python and for the
 * tests that hold them against torch's own. The rules stay in reduce_rule.c;
 * this file only converts. */
#include "fs_py.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "reduce_rule.h"

PyDoc_STRVAR(grad_divide_doc,
             "grad_divide(api, reduce_code, shard_world, replicate_world=1, factor=0.0,\n"
             "            force_sum=False) -> {'pre', 'in_comm', 'post', 'hold'}\n\n"
             "By what a gradient averaged over shard_world * replicate_world ranks is\n"
             "divided before its collective (pre), by the collective (in_comm: ReduceOp.AVG\n"
             "or PREMUL_SUM), after it (post), and what an all-reduce hook's reduce output\n"
             "is divided by (hold); 1.0 means none (reduce_rule.h, [Note: divide rule]).\n"
             "api: 'fsdp1' or 'fully_shard'; reduce_code: the reduce dtype's code;\n"
             "factor > 0: fully_shard's set_gradient_divide_factor; force_sum: its\n"
             "set_force_sum_reduction_for_comms.");
static PyObject *py_grad_divide(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"api", "reduce_code", "shard_world", "replicate_world", "factor",
                             "force_sum", NULL};
    const char *api;
    int code, shard_world, replicate_world = 1, force_sum = 0;
    double factor = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sii|idp:grad_divide", kwlist, &api, &code,
                                     &shard_world, &replicate_world, &factor, &force_sum))
        return NULL;
    fs_divide_api a;
    if (strcmp(api, "fsdp1") == 0)
        a = FS_DIVIDE_FLAT;
    else if (strcmp(api, "fully_shard") == 0)
        a = FS_DIVIDE_FULLY_SHARD;
    else
        return PyErr_Format(PyExc_ValueError, "grad_divide: api must be 'fsdp1' or "
                            "'fully_shard', got '%s'", api);
    fs_divide d;
    if (fs_divide_rule(a, (fs_dtype)code, shard_world, replicate_world, factor, force_sum, &d) !=
        FS_OK) {
        /* PyErr_Format has no float conversion (%g is refused from Python
         * 3.12 on): the factor is formatted as Python's repr of it. */
        char *factor_text = PyOS_double_to_string(factor, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
        if (factor_text == NULL)
            return NULL;
        PyErr_Format(PyExc_ValueError, "grad_divide: need a floating reduce dtype code, "
                     "shard_world >= 1, replicate_world >= 1, factor >= 0 (finite), and "
                     "no factor or force_sum for 'fsdp1'; got code=%d, shard_world=%d, "
                     "replicate_world=%d, factor=%s, force_sum=%d", code, shard_world,
                     replicate_world, factor_text, force_sum);
        PyMem_Free(factor_text);
        return NULL;
    }
    return Py_BuildValue("{sdsdsdsd}", "pre", d.pre, "in_comm", d.in_comm, "post", d.post,
                         "hold", d.hold);
}

PyDoc_STRVAR(reduce_dtype_doc,
             "reduce_dtype(rule, set_code, compute_code, accumulate_codes=()) -> code\n\n"
             "The dtype code gradients are reduced in (reduce_rule.h, [Note: reduce dtype\n"
             "rule]). rule: 'param_dtype' (FSDP1; fully_shard up to torch 2.14) or\n"
             "'grad_dtype' (fully_shard from torch 2.15); set_code: the reduce_dtype given\n"
             "(None: unset); compute_code: the compute dtype's; accumulate_codes: each\n"
             "parameter's accumulation dtype (grad_dtype, or its own dtype), read by\n"
             "'grad_dtype'.");
static PyObject *py_reduce_dtype(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"rule", "set_code", "compute_code", "accumulate_codes", NULL};
    const char *rule_name;
    PyObject *set_obj, *codes = NULL;
    int compute;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOi|O:reduce_dtype", kwlist, &rule_name,
                                     &set_obj, &compute, &codes))
        return NULL;
    fs_reduce_dtype_rule rule;
    if (strcmp(rule_name, "param_dtype") == 0)
        rule = FS_REDUCE_IN_COMPUTE;
    else if (strcmp(rule_name, "grad_dtype") == 0)
        rule = FS_REDUCE_IN_GRAD;
    else
        return PyErr_Format(PyExc_ValueError, "reduce_dtype: rule must be 'param_dtype' or "
                            "'grad_dtype', got '%s'", rule_name);
    long set = FS_DTYPE_COUNT;
    if (set_obj != Py_None) {
        set = PyLong_AsLong(set_obj);
        if (set == -1 && PyErr_Occurred())
            return NULL;
    }
    PyObject *result = NULL;
    fs_dtype *accumulate = NULL;
    int64_t *given = NULL;
    Py_ssize_t n = 0;
    if (codes && !(given = fs_int64_list(codes, &n, "reduce_dtype: accumulate_codes must be a "
                                                    "sequence of dtype codes")))
        return NULL;
    if (n > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "reduce_dtype: too many accumulate_codes");
        goto done;
    }
    if (!(accumulate = PyMem_New(fs_dtype, n ? n : 1))) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) /* out of range: not a float, which the rule refuses */
        accumulate[i] = given[i] >= 0 && given[i] < FS_DTYPE_COUNT ? (fs_dtype)given[i] : FS_U8;
    fs_dtype out;
    if (set < 0 || set > FS_DTYPE_COUNT || compute < 0 || compute >= FS_DTYPE_COUNT ||
        fs_reduce_dtype(rule, (fs_dtype)set, (fs_dtype)compute, accumulate, (int)n, &out) !=
            FS_OK) {
        PyErr_Format(PyExc_ValueError, "reduce_dtype: need float dtype codes (set_code None "
                     "or a float's) and, under 'grad_dtype', at least one accumulate code; "
                     "got rule='%s', set_code=%R, compute_code=%d, %zd accumulate codes",
                     rule_name, set_obj, compute, n);
        goto done;
    }
    result = PyLong_FromLong((long)out);
done:
    PyMem_Free(accumulate);
    free(given);
    return result;
}

static PyMethodDef divide_methods[] = {
    {"grad_divide", (PyCFunction)(void (*)(void))py_grad_divide, METH_VARARGS | METH_KEYWORDS,
     grad_divide_doc},
    {"reduce_dtype", (PyCFunction)(void (*)(void))py_reduce_dtype, METH_VARARGS | METH_KEYWORDS,
     reduce_dtype_doc},
    {NULL, NULL, 0, NULL},
};

int fs_divide_add(PyObject *module, fs_mod_state *st)
{
    return PyModule_AddFunctions(module, divide_methods);
}
