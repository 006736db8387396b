/* offload_pipe.h - the overlapped optimizer step of parameter offload: each
 * unit's host AdamW step runs on a host thread as soon as its reduced
 * gradient is in host memory, while backward goes on, and the unit's next
 * gather waits for that step alone.
 *
 * What it is: a FIFO of steps, one worker thread that runs them (the CPU
 * kernels of csrc/optim/, any variant: same bits), a count of the units in
 * flight bounded by max_units, and a per-slot count of steps not finished.
 * A slot is a unit (FSDP1) or a shard group (fully_shard): the engine group
 * attached to a slot (fs_group_core.gate, the pipe's fs_step_gate) waits for
 * the slot's steps before it reads its shards for a gather ([Note: step
 * before gather]). The engine's groups know only that gate, not the pipe.
 *
 * What it is not: a scheduler of collectives (the worker touches host
 * memory only, never a Comm or a device), nor an owner of the buffers (the
 * host keeps every buffer of a submitted step alive until the slot's
 * steps have run: fs_offload_pipe_busy, fs_offload_pipe_wait). The step counts (torch's float32 state['step']) are
 * incremented by the submitting thread, so the host reads them at once.
 *
 * Threads: submit and wait are called by one host thread (the one that owns
 * the engine calls); they hand the caller's lock back (unlock/lock: the
 * GIL) around any blocking wait. The worker never calls into the host.
 *
 * [Note: step before gather] A step writes the host shard in place; a
 * gather reads it (staged to the device, or all-gathered). The gather of a
 * group attached to slot k waits (on the host) until every step submitted
 * to slot k has run: the first forward after backward then overlaps with
 * the steps of the units it reaches later, in forward order. Nothing else
 * in the engine reads a shard (the host reads them for state dicts and
 * checkpoints, and drains the pipe first: fs_offload_pipe_wait(p, -1)). */
#ifndef FS_OFFLOAD_PIPE_H
#define FS_OFFLOAD_PIPE_H

#include <stdint.h>

#include "fs_status.h"
#include "group.h"
#include "optim.h"

typedef struct fs_offload_pipe fs_offload_pipe;

/* What the pipe did so far (a running count) and holds now. */
typedef struct {
    int max_units;              /* the bound given at creation */
    int units_in_flight;        /* slots with a step submitted and not run, now */
    int peak_units_in_flight;   /* the most at once so far */
    int64_t grad_bytes_in_flight;      /* gradient bytes the queued steps read, now */
    int64_t peak_grad_bytes_in_flight;
    int64_t steps_run;          /* parameters stepped */
    int64_t submits_blocked;    /* submits that waited for a unit to finish (the bound) */
    int64_t gathers_waited;     /* waits of a slot that found its step still queued or running */
    double step_s;              /* worker time in the kernels */
    double wait_s;              /* host time blocked in submit and wait */
} fs_offload_pipe_stats;

/* A pipe of nslots slots (>= 1), at most max_units (>= 1) of them in
 * flight; its worker thread started. FS_ERR_INVALID_ARG, FS_ERR_NO_MEMORY,
 * FS_ERR_BACKEND (no thread). */
fs_status fs_offload_pipe_new(int max_units, int nslots, fs_offload_pipe **out);
/* Every step run (the caller's lock is not held: no host to hand it to),
 * the worker stopped, everything freed. NULL: nothing. */
void fs_offload_pipe_free(fs_offload_pipe *p);

/* Slot `slot`'s steps: the n jobs (copied; their buffers stay the
 * caller's) run in order after every step submitted before. steps[i]
 * (Adam's float32 count, or NULL) is incremented here, now, and job i runs
 * with the new count (torch's order). When bounded, slot has nothing in
 * flight and max_units other slots do, this waits until one finishes (the
 * bound keeps the gradients of queued steps few while backward makes the
 * next ones; unbounded: every gradient of the step exists already, e.g.
 * after a norm pass, and each unit's next gather waits for its own). Once a step
 * failed, every later submit and wait returns its status (last_error).
 * unlock/lock: NULL, or what to hand back around a wait. */
fs_status fs_offload_pipe_submit(fs_offload_pipe *p, int slot, const fs_optim_job *jobs,
                                 float *const *steps, int n, fs_simd simd, int threads,
                                 int bounded, void *(*unlock)(void), void (*lock)(void *));
/* Until every step of `slot` (-1: of every slot) has run; a failed step's
 * status. */
fs_status fs_offload_pipe_wait(fs_offload_pipe *p, int slot, void *(*unlock)(void),
                               void (*lock)(void *));
/* 1 while `slot` (-1: any) has a step not run. */
int fs_offload_pipe_busy(fs_offload_pipe *p, int slot);
void fs_offload_pipe_get_stats(fs_offload_pipe *p, fs_offload_pipe_stats *out);
/* The words of the first failure ("" while none). */
const char *fs_offload_pipe_error(const fs_offload_pipe *p);
/* The gate (group.h) through which attached groups wait for their slot:
 * a group's core points at it (gate, gate_slot) while attached. */
const fs_step_gate *fs_offload_pipe_gate(fs_offload_pipe *p);

#endif
