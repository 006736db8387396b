/* py_unit.h - flatshard._C.Unit (py_unit.c): the FSDP1 unit's type around
 * the engine's fs_unit (engine/unit.h). Its object's layout is
 * unit_object.h; its events are hooks/unit_events.c. */
#ifndef FS_PY_UNIT_H
#define FS_PY_UNIT_H

#include "unit_object.h"

/* None for FS_OK, else the unit's exception (its note names the unit and
 * operation). */
PyObject *fs_glue_unit_done(UnitObject *self, fs_status s);

#endif
