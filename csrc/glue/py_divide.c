/* py_divide.c - flatshard._C.grad_divide: core/reduce_rule.c's factors as a
 * dict, for Python and for the tests that hold them against torch's own.
 * The rule stays in reduce_rule.c; this file only converts. */
#include "fs_py.h"

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

static PyMethodDef divide_methods[] = {
    {"grad_divide", (PyCFunction)(void (*)(void))py_grad_divide, METH_VARARGS | METH_KEYWORDS,
     grad_divide_doc},
    {NULL, NULL, 0, NULL},
};

int fs_divide_add(PyObject *module)
{
    return PyModule_AddFunctions(module, divide_methods);
}
