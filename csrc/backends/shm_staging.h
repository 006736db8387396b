/* shm_staging.h - how the shm backend writes its staging slots: cached
 * (plain) stores or streaming stores, chosen per kind and size of
 * collective by measuring both while the group runs.
 *
 * [Note: staging stores] Each byte a rank stages is written into its slot
 * and then read by its peers from there. Which store is faster depends on
 * where the ranks' CPUs lie, and that can change while a run goes on (a
 * virtual machine's vCPUs are moved by the host). Measured with two
 * processes on a 2-vCPU Zen 3 guest, 1 MiB all-gathers (benchmarks/
 * results/comm.md, "The shm backend's staging stores"):
 *   - vCPUs that share a cache: plain stores 43-47 us, streaming 81-86 us.
 *     A staged line stays in the shared cache for its readers.
 *   - vCPUs that do not: plain stores 117-210 us, streaming 66-96 us. The
 *     slot's lines are still held by the peer that read them last time, so
 *     each plain store first waits for that copy to be invalidated across
 *     the two caches; a streaming store skips that read for ownership.
 * Neither is right everywhere, and the placement is not visible to the
 * process. So the group measures: for each class (collective kind, size to
 * within 2x) one collective in 16 uses the other store, rank 0 keeps a
 * running estimate of each store's time per byte, and it switches the class
 * to the other store when that one is clearly faster. A try of the slower
 * store costs (1.8x, one call in 16: a 1 MiB point of bench_comm.py lost
 * 10% to it), so while the other store keeps losing by a wide margin it is
 * tried half as often each time, down to one call in 256; a switch, a
 * narrow margin, or the preferred store slowing down since the last try
 * (the placement may have changed) goes back to one in 16.
 * Every rank reads the class's choice from the segment at the start of a
 * collective; the choice never changes a result's bits, only its speed, so a
 * rank that reads it a collective late is harmless.
 *
 * This file is the bookkeeping alone (no shared memory, no clock): the
 * backend times the collectives and publishes the choice. */
#ifndef FS_SHM_STAGING_H
#define FS_SHM_STAGING_H

#include <stddef.h>
#include <stdint.h>

/* FLATSHARD_SHM_STAGING: measured (auto), or one store always. */
typedef enum { FS_STAGE_AUTO = 0, FS_STAGE_CACHED = 1, FS_STAGE_STREAMED = 2 } fs_stage_policy;

/* The store a collective uses (the index of the estimates). */
enum { FS_STORE_CACHED = 0, FS_STORE_STREAMED = 1 };

#define FS_STAGE_OPS 8   /* the backend's collective kinds (OP_* in comm_shm.c) */
#define FS_STAGE_SIZES 24 /* 2^12 bytes and below, ..., 2^35 and above */
#define FS_STAGE_CLASSES (FS_STAGE_OPS * FS_STAGE_SIZES)
/* The other store is tried every (16 << backoff)-th collective of a class,
 * backoff 0 to FS_STAGE_BACKOFF_MAX. */
#define FS_STAGE_EXPLORE_EVERY 16
#define FS_STAGE_BACKOFF_MAX 4
/* A class's first collectives, which page in the slots and the caller's
 * buffers: timed by nobody. The next one explores at once. */
#define FS_STAGE_COLD 2
/* The other store takes over when its estimate is below this fraction of
 * the current one's (hysteresis: noise alone does not flip a class). */
#define FS_STAGE_SWITCH_BELOW 0.85
/* Backing off needs the other store this much slower; the preferred one
 * this much slower than at the last try ends the back-off. */
#define FS_STAGE_WIDE 1.3

/* A class's choice as every rank reads it (one byte in the segment): the
 * preferred store in bit 0, the back-off above it. 0: cached, every 16th
 * tried. */
typedef uint8_t fs_stage_word;

typedef struct {
    uint32_t count[FS_STAGE_CLASSES];        /* collectives of the class begun */
    double est_ns_per_byte[FS_STAGE_CLASSES][2]; /* running estimates; 0: none yet */
    double pref_at_try[FS_STAGE_CLASSES];    /* the preferred store's, at the last try */
} fs_stage_tuner;

/* The class of a collective of kind `op` (< FS_STAGE_OPS) over `bytes`. */
int fs_stage_class(int op, size_t bytes);

/* The store for the next collective of class k, whose choice is `w`: the
 * other one for the class's first collective after the cold ones
 * (FS_STAGE_COLD) and every (16 << backoff)-th, else the preferred one.
 * Counts the collective. Every rank calls it for the same collectives, so
 * all try the other store together. */
int fs_stage_pick(fs_stage_tuner *t, int k, fs_stage_word w);

/* Rank 0, after fs_stage_pick: a collective of class k took `ns` of work
 * over `bytes` with `store` (a cold one is not counted); returns the
 * class's choice from now on. */
fs_stage_word fs_stage_learn(fs_stage_tuner *t, int k, int store, double ns, size_t bytes,
                             fs_stage_word w);

#endif
