/* group_object.h - the head a flatshard._C.Unit and a flatshard._C.ShardGroup
 * share (first in both, as PyObject_HEAD is first in every object): the
 * Python objects around the engine object, and where its core
 * (engine/group.h) is. The layout only: the head's functions are
 * py_group.c's (py_group.h). */
#ifndef FS_GROUP_OBJECT_H
#define FS_GROUP_OBJECT_H

#include "fs_py.h"
#include "group.h"

typedef struct GroupObject GroupObject;
/* An engine status as None, or the exception of its group (its own note). */
typedef PyObject *(*fs_glue_done)(GroupObject *self, fs_status s);

/* What a Unit and a ShardGroup share, first in both as PyObject_HEAD is
 * first in every object: the Python objects around the engine object, and
 * where its core (engine/group.h) is, which py_group.c reads. */
#define FS_GROUP_OBJECT_HEAD                                                           \
    PyObject_HEAD                                                                      \
    fs_group_core *core;   /* the engine object's core, inside this object */          \
    PyObject *name;                                                                    \
    CommObject *comm;                                                                  \
    CommObject *replicate; /* HSDP, HYBRID_SHARD: the Comm across replicas, or NULL */ \
    PyObject *empty;       /* device groups: empty(numel, dtype_code) -> tensor */     \
    fs_glue_done done;     /* an engine status as None or this type's exception */     \
    int ready;             /* the engine object was made (dealloc destroys it) */

struct GroupObject {
    FS_GROUP_OBJECT_HEAD
};

#define FS_GROUP(o) ((GroupObject *)(o))

#endif
