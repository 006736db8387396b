/* py_group.c - what flatshard._C.Unit (py_unit.c) and flatshard._C.ShardGroup
 * (py_shard_group.c) share: the head of both objects (FS_GROUP_OBJECT_HEAD
 * in py_unit.h), binding their Comms' streams for an engine call, an engine
 * failure as an exception, and the getters over the engine's group core
 * (engine/group.h). Not a type of its own. */
#include "py_unit.h"

void fs_glue_group_init(GroupObject *self, fs_group_core *core, PyObject *name,
                        PyObject *comm, PyObject *replicate, PyObject *empty)
{
    self->core = core;
    self->name = Py_NewRef(name);
    self->comm = (CommObject *)Py_NewRef(comm);
    self->replicate = replicate != Py_None ? (CommObject *)Py_NewRef(replicate) : NULL;
    self->empty = empty != Py_None ? Py_NewRef(empty) : NULL;
}

void fs_glue_group_clear(GroupObject *self)
{
    Py_CLEAR(self->empty);
    Py_CLEAR(self->name);
    Py_CLEAR(self->comm);
    Py_CLEAR(self->replicate);
}

int fs_glue_group_bind(GroupObject *self)
{
    return fs_glue_bind(self->comm, self->replicate, &self->core->link, &self->core->replicate);
}

PyObject *fs_glue_group_failed(GroupObject *self, fs_status s, int collective, PyObject *note)
{
    PyObject *r = fs_glue_failed(Py_TYPE(self), s, self->core->err, self->comm, collective, note);
    Py_XDECREF(note);
    return r;
}

PyObject *fs_glue_group_get_name(GroupObject *self, void *closure)
{
    return Py_NewRef(self->name);
}

PyObject *fs_glue_group_get_comm(GroupObject *self, void *closure)
{
    return Py_NewRef((PyObject *)self->comm);
}

PyObject *fs_glue_group_get_unsharded(GroupObject *self, void *closure)
{
    return PyBool_FromLong(self->core->unsharded);
}

PyObject *fs_glue_group_get_gather_pending(GroupObject *self, void *closure)
{
    return PyBool_FromLong(self->core->gather_pending);
}

PyObject *fs_glue_group_get_reduce_pending(GroupObject *self, void *closure)
{
    return PyBool_FromLong(self->core->reduce_pending);
}
