/* ledger.h - a bounded record of the collectives issued through one Comm.
 *
 * Every collective flatshard issues is recorded before it starts and marked
 * when it ends: sequence number, operation, the unit it is for, size, dtype
 * and state. The sequence number counts collectives on the Comm, so on ranks
 * that are in step the same number is the same collective everywhere; when
 * a collective fails or times out, the entries say what this rank was doing,
 * and comparing them across ranks (comm_shm.c does it at every collective;
 * flatshard/runtime/diagnostics.py through the store after a failure) names the
 * first collective where the ranks went apart.
 *
 * A fixed ring of the last FS_LEDGER_CAP entries: no allocation, constant
 * cost per collective. Pure C; one writer (the thread issuing collectives,
 * which holds the GIL). */
#ifndef FS_LEDGER_H
#define FS_LEDGER_H

#include <stddef.h>
#include <stdint.h>

#include "fs_dtype.h"
#include "fs_status.h"

#define FS_LEDGER_CAP 64
#define FS_LEDGER_UNIT 48 /* unit names are truncated to 47 bytes */

typedef enum {
    FS_LOP_ALL_GATHER,
    FS_LOP_REDUCE_SCATTER,
    FS_LOP_ALL_REDUCE,
    FS_LOP_BROADCAST,
    FS_LOP_BARRIER,
    FS_LOP_ALL_TO_ALL,
} fs_ledger_op;

/* ENQUEUED: a device backend accepted it onto its stream; it finishes
 * later, unseen by the ledger (the NCCL watchdog times it). */
typedef enum {
    FS_LEDGER_ISSUED,
    FS_LEDGER_COMPLETED,
    FS_LEDGER_FAILED,
    FS_LEDGER_ENQUEUED,
} fs_ledger_state;

typedef struct {
    uint64_t seq;  /* 1, 2, ... per Comm; 0: empty slot */
    int64_t bytes; /* the collective's count argument, in bytes (per rank for all-gather and
                      reduce-scatter) */
    fs_ledger_op op;
    fs_ledger_state state;
    fs_dtype dtype;
    char unit[FS_LEDGER_UNIT]; /* the unit's name, or what the caller said it is for */
} fs_ledger_entry;

typedef struct {
    fs_ledger_entry ring[FS_LEDGER_CAP];
    uint64_t count; /* collectives recorded; the newest has seq == count */
} fs_ledger;

void fs_ledger_init(fs_ledger *l);

/* Record a collective about to be issued; returns its sequence number. */
uint64_t fs_ledger_issue(fs_ledger *l, fs_ledger_op op, const char *unit, int64_t count,
                         fs_dtype t);

/* Mark collective `seq` completed (s == FS_OK; enqueued when on_device) or
 * failed. */
void fs_ledger_finish(fs_ledger *l, uint64_t seq, fs_status s, int on_device);

/* Entry `seq`, or NULL if it was never recorded or has left the ring. */
const fs_ledger_entry *fs_ledger_get(const fs_ledger *l, uint64_t seq);

const char *fs_ledger_op_name(fs_ledger_op op);
const char *fs_ledger_state_name(fs_ledger_state s);

/* "all_gather #41 for 'blocks.3' (1.5 KiB float32, issued)", without the
 * state unless with_state; returns what snprintf returns. */
int fs_ledger_format(const fs_ledger_entry *e, int with_state, char *buf, size_t cap);

/* The last `n` entries, oldest first, one per line after `head`. */
void fs_ledger_tail(const fs_ledger *l, int n, const char *head, char *buf, size_t cap);

#endif
