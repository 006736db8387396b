/* unit_internal.h - what unit.c and unit_reduce.c share inside the engine
 * (not for the glue). */
#ifndef FS_UNIT_INTERNAL_H
#define FS_UNIT_INTERNAL_H

#include "unit.h"

/* A reduction waiting in a bucket given up: its handles let go, nothing
 * written (a no-op when none waits). */
void fs_unit_cancel_bucketed(fs_unit *u, int group);

#endif
