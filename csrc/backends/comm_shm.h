/* comm_shm.h - making and inspecting the shared-memory backend
 * (comm_shm.c): what the glue, the engine driver and the host build of the
 * NCCL backend call to get an fs_comm over a segment. Everything else goes
 * through comm.h. */
#ifndef FS_COMM_SHM_H
#define FS_COMM_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "ledger.h"
#include "shm_staging.h"

/* This rank's end of segment `name` (rank 0 passes create=1 and makes it;
 * the others map it, FS_ERR_BACKEND while it is not ready). `ledger` (may
 * be NULL): the backend publishes its newest entry to the other ranks at
 * each collective, and checks that theirs match. `staging`: an
 * fs_stage_policy ([Note: staging stores]). err: the cause, for any failure. */
fs_status fs_comm_shm_create(const char *name, int rank, int world_size, size_t slot_bytes,
                             double timeout_s, int staging, int create,
                             const fs_ledger *ledger, fs_comm **out, char *err, size_t err_cap);
/* Remove a segment's name (one that is not there: FS_OK). */
fs_status fs_shm_unlink(const char *name);
/* Collectives staged with cached and with streaming stores; -1 for a Comm
 * of another backend. */
int fs_comm_shm_stores_used(const fs_comm *c, uint64_t out[2]);

#endif
