/* py_comm_ops.c - flatshard._C.Comm's all-gather and reduce-scatter over raw
 * pointers, for the Python layer's own collectives (state dicts, summon,
 * extensions). Deferring collectives is the engine's (engine/unit.h). */
#include "fs_py.h"

PyObject *fs_comm_issue_all_gather(CommObject *self, PyObject *args)
{
    unsigned long long sp, rp;
    long long n;
    int t;
    const char *tag = "";
    if (!PyArg_ParseTuple(args, "KKLi|s", &sp, &rp, &n, &t, &tag))
        return NULL;
    if (fs_comm_bind_stream(self) < 0)
        return NULL;
    fs_status s;
    FS_COMM_RECORD(self, s, FS_LOP_ALL_GATHER, tag, n, t,
                   fs_comm_all_gather(self->comm, (void *)sp, (void *)rp, n, t));
    return fs_comm_done(self, s, "all_gather", tag);
}

PyObject *fs_comm_issue_reduce_scatter(CommObject *self, PyObject *args)
{
    unsigned long long sp, rp;
    long long n;
    int t, avg;
    const char *tag = "";
    if (!PyArg_ParseTuple(args, "KKLip|s", &sp, &rp, &n, &t, &avg, &tag))
        return NULL;
    PyObject *ws;
    if (fs_comm_bind_stream(self) < 0 ||
        fs_comm_lend_workspace(self, t, n * self->comm->world_size, &ws) < 0)
        return NULL;
    fs_status s;
    FS_COMM_RECORD(self, s, FS_LOP_REDUCE_SCATTER, tag, n, t,
                   fs_comm_reduce_scatter(self->comm, (void *)sp, (void *)rp, n, t,
                                          avg ? FS_RED_AVG : FS_RED_SUM));
    fs_comm_return_workspace(self, &ws);
    return fs_comm_done(self, s, "reduce_scatter", tag);
}
