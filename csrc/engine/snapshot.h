/* snapshot.h - one rank's snapshot store: a POSIX shared-memory segment on
 * its host that outlives the process, so that the rank restarted after a
 * crash finds the state of the last steps it copied there.
 *
 * What it is: a segment (0600, created by its owner, named by the caller:
 * the job and the rank) holding a header and two slots. Each slot holds one
 * step's parts (a list of byte ranges: parameter shards, optimizer state,
 * a serialized record), each part with its CRC-32C (core/checksum.h). A
 * write goes to the slot that does not hold the newest complete step, and
 * the slot's "complete" mark is cleared before the copy and set after it,
 * last ([Note: the complete mark]): a crash at any point of a copy leaves
 * the other slot's step whole. The copy runs on the snapshot's own thread,
 * so that it overlaps the caller's next compute; the caller keeps the
 * sources unchanged until fs_snapshot_wait (the optimizer writes them).
 *
 * What it is not: an agreement between ranks on which step counts (the
 * caller's, through its process group's store), nor a reader of tensors (a
 * part is bytes; the caller knows what they were).
 *
 * Threads: every call comes from one host thread; a wait hands the
 * caller's lock back (unlock/lock: the GIL). The worker never calls out.
 *
 * [Note: the complete mark] A slot is trusted only when its header's
 * `complete` is 1; it is stored with release order after the parts, their
 * table and the table's CRC, and cleared (with a fence) before the first
 * byte of a new copy. A reader checks the mark, then the table's CRC, then
 * each part's CRC (fs_snapshot_verify): a torn or damaged slot is named,
 * never loaded. */
#ifndef FS_SNAPSHOT_H
#define FS_SNAPSHOT_H

#include <stddef.h>
#include <stdint.h>

#include "fs_status.h"

typedef struct fs_snapshot fs_snapshot;

/* One byte range to copy. */
typedef struct {
    const void *ptr;
    int64_t bytes;
} fs_snap_part;

/* What a slot holds (complete == 0: nothing to trust). */
typedef struct {
    int complete;
    int64_t step;
    int64_t nparts;
    int64_t capacity_bytes; /* the slot's region in the segment */
} fs_snap_slot_info;

/* Open the segment `name` ("/..." as shm_open takes it). create: make it
 * when absent (0600; an existing one is kept, with its slots). A segment
 * that is not a snapshot store is refused (FS_ERR_INVALID_ARG). err: the
 * reason on failure (errno's words kept). */
fs_status fs_snapshot_open(const char *name, int create, fs_snapshot **out, char *err,
                           size_t err_cap);
/* The copy in flight finished (or stopped), the thread stopped, the segment
 * unmapped; the segment stays on the host. NULL: nothing. */
void fs_snapshot_close(fs_snapshot *s);
/* Remove segment `name` from the host. */
fs_status fs_snapshot_unlink(const char *name, char *err, size_t err_cap);

/* Copy the n parts (the array is copied; the bytes stay the caller's until
 * fs_snapshot_wait) as step `step` into the slot that does not hold the
 * newest complete step, on the snapshot's thread; waits first for a copy in
 * flight. The slot grows when the parts do not fit (the segment grows; the
 * other slot stays where it is); budget_bytes > 0: FS_ERR_INVALID_ARG when
 * the segment would pass it. stop_after_bytes >= 0 (tests only): the copy
 * stops after that many bytes and leaves the slot incomplete, as a crash
 * there would. */
fs_status fs_snapshot_write(fs_snapshot *s, int64_t step, const fs_snap_part *parts, int64_t n,
                            int64_t budget_bytes, int64_t stop_after_bytes,
                            void *(*unlock)(void), void (*lock)(void *), char *err,
                            size_t err_cap);
/* Until the copy in flight (if any) has finished. */
void fs_snapshot_wait(fs_snapshot *s, void *(*unlock)(void), void (*lock)(void *));
/* 1 while a copy is in flight. */
int fs_snapshot_busy(fs_snapshot *s);

/* Slot `slot` no longer trusted (its complete mark cleared): a step the
 * ranks did not all commit, to be computed again. Waits for a copy in flight. */
void fs_snapshot_drop(fs_snapshot *s, int slot, void *(*unlock)(void), void (*lock)(void *));

void fs_snapshot_slot_info(const fs_snapshot *s, int slot, fs_snap_slot_info *out);
/* Bytes of the segment (header and both slots). */
int64_t fs_snapshot_segment_bytes(const fs_snapshot *s);
/* A complete slot's table and every part checked against their CRCs:
 * *bad = -1 when all hold, -2 when the slot is not complete or its table is
 * damaged, else the index of the first damaged part. */
void fs_snapshot_verify(const fs_snapshot *s, int slot, int64_t *bad);
/* Bytes of part `part` of a complete slot, or -1. */
int64_t fs_snapshot_part_bytes(const fs_snapshot *s, int slot, int64_t part);
/* dst[0..bytes) = part `part` of a complete slot; FS_ERR_INVALID_ARG when
 * the slot is not complete, part out of range, or bytes differs. */
fs_status fs_snapshot_read(const fs_snapshot *s, int slot, int64_t part, void *dst,
                           int64_t bytes);

#endif
