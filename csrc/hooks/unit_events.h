/* unit_events.h - an FSDP1 unit's backward events ([Note: unit plain
 * events] in unit_events.c), over the unit's own fields
 * (glue/unit_object.h). */
#ifndef FS_HOOKS_UNIT_EVENTS_H
#define FS_HOOKS_UNIT_EVENTS_H

#include "unit_object.h"

enum { FS_UNIT_HOOK_PRE_BACKWARD = 0, FS_UNIT_HOOK_POST_BACKWARD = 1 };

/* The event `kind` of u (FS_UNIT_HOOK_*; group: POST_BACKWARD's group
 * index) with torch's argument (the gradient, or the group's compute
 * buffer): the plain path where it applies, else the unit's Python method.
 * None, or NULL with an exception set. */
PyObject *fs_hooks_unit_event(UnitObject *u, int kind, int group, PyObject *arg);
/* The prefetch before the unit that ran before u in forward (its gather
 * begun), where it is idle; 0, or -1 with an exception set. */
int fs_hooks_unit_prefetch_previous(UnitObject *u);
/* What follows u's reshard in backward: the BACKWARD_POST prefetch, and on
 * the host the freed bytes counted for the heap trim. 0 or -1. */
int fs_hooks_unit_released(UnitObject *u);

#endif
