/* unit_fsm.h - the per-unit state machine of just-in-time gathering.
 *
 * A unit is one wrapped module: its parameters live sharded between steps
 * and are unsharded (all-gathered) only around its forward and backward.
 * The Python layer reports events from torch hooks; this machine says which
 * transition they make and what must be done (the actions). It holds no
 * buffers: whether the unsharded buffers are populated is tracked by the
 * unit object, so UNSHARD/RESHARD are idempotent requests.
 *
 *   IDLE --PRE_FORWARD--> FORWARD --POST_FORWARD--> IDLE
 *   IDLE --PRE_BACKWARD--> BACKWARD_PRE --POST_BACKWARD(all grad groups)--> BACKWARD_POST
 *   any backward state --FINALIZE--> IDLE        (end of the backward pass)
 *   IDLE --SUMMON_ENTER--> SUMMON --SUMMON_EXIT--> IDLE
 *
 * A forward that runs during backward (recomputation) is allowed and comes
 * back to the backward state it interrupted.
 */
#ifndef FS_UNIT_FSM_H
#define FS_UNIT_FSM_H

#include <stdint.h>
#include "fs_status.h"

/* Values match torch's ShardingStrategy (hybrid is a second link, not a
 * strategy here); SHARD_OPTIM, which torch does not have, follows them. */
typedef enum {
    FS_FULL_SHARD = 1,    /* ZeRO-3: reshard after forward and after backward */
    FS_SHARD_GRAD_OP = 2, /* ZeRO-2: keep unsharded from forward to backward */
    FS_NO_SHARD = 3,      /* DDP: never sharded; gradients all-reduced */
    FS_SHARD_OPTIM = 6,   /* ZeRO-1: parameters gathered once and kept whole; gradients
                             all-reduced whole; only the optimizer's shard is sharded */
} fs_strategy;

typedef enum {
    FS_STATE_IDLE = 0,
    FS_STATE_FORWARD = 1,
    FS_STATE_BACKWARD_PRE = 2,
    FS_STATE_BACKWARD_POST = 3,
    FS_STATE_SUMMON = 4,
} fs_unit_state;

typedef enum {
    FS_EV_PRE_FORWARD = 0,
    FS_EV_POST_FORWARD = 1,
    FS_EV_PRE_BACKWARD = 2,
    FS_EV_POST_BACKWARD = 3, /* one per gradient group, `group` says which */
    FS_EV_FINALIZE = 4,
    FS_EV_SUMMON_ENTER = 5,
    FS_EV_SUMMON_EXIT = 6,
} fs_event;

enum {
    FS_ACT_UNSHARD = 1,       /* make the unsharded buffers live and gathered */
    FS_ACT_RESHARD = 2,       /* free the unsharded buffers */
    FS_ACT_REDUCE_GRAD = 4,   /* reduce this group's unsharded gradient into its shard */
    FS_ACT_HOOK_BACKWARD = 8, /* register pre-backward hooks on the forward outputs */
};

enum {
    FS_FLAG_GRAD_ENABLED = 1, /* autograd records this forward */
    FS_FLAG_NO_SYNC = 2,      /* inside no_sync(): keep unsharded gradients local */
};

typedef struct {
    fs_strategy strategy;
    int is_root;       /* the root is not resharded after forward (needed first in backward) */
    uint64_t grad_mask; /* groups (< 64) that get gradients: POST_BACKWARD comes once for each */
} fs_unit_cfg;

typedef struct {
    fs_unit_state state;
    fs_unit_state resume;   /* state a recomputation forward returns to */
    uint64_t reduced_mask;  /* gradient groups whose POST_BACKWARD arrived this backward */
    int summon_was_sharded; /* reshard on SUMMON_EXIT only if it was sharded before */
} fs_unit_fsm;

void fs_unit_fsm_init(fs_unit_fsm *m);

/* Apply `ev`. On success *actions holds FS_ACT_* bits. On FS_ERR_BAD_STATE
 * the machine is unchanged. `is_unsharded` tells whether the buffers are
 * currently gathered (used for SUMMON bookkeeping only). */
fs_status fs_unit_step(const fs_unit_cfg *cfg, fs_unit_fsm *m, fs_event ev, unsigned flags,
                       int group, int is_unsharded, unsigned *actions);

const char *fs_unit_state_name(fs_unit_state s);
const char *fs_event_name(fs_event e);

#endif
