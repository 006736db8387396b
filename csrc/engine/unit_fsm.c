/* unit_fsm.c - see unit_fsm.h. Pure logic, no buffers, no Python. */
#include "unit_fsm.h"

const char *fs_unit_state_name(fs_unit_state s)
{
    static const char *names[] = {"IDLE", "FORWARD", "BACKWARD_PRE", "BACKWARD_POST", "SUMMON"};
    return (unsigned)s < 5 ? names[s] : "INVALID";
}

const char *fs_event_name(fs_event e)
{
    static const char *names[] = {"pre_forward",  "post_forward", "pre_backward", "post_backward",
                                  "finalize",     "summon_enter", "summon_exit"};
    return (unsigned)e < 7 ? names[e] : "invalid";
}

void fs_unit_fsm_init(fs_unit_fsm *m)
{
    m->state = FS_STATE_IDLE;
    m->resume = FS_STATE_IDLE;
    m->reduced_mask = 0;
    m->summon_was_sharded = 0;
}

static int in_backward(fs_unit_state s)
{
    return s == FS_STATE_BACKWARD_PRE || s == FS_STATE_BACKWARD_POST;
}

fs_status fs_unit_step(const fs_unit_cfg *cfg, fs_unit_fsm *m, fs_event ev, unsigned flags,
                       int group, int is_unsharded, unsigned *actions)
{
    /* NO_SHARD units are never sharded: unshard/reshard requests vanish.
     * SHARD_OPTIM units are never resharded; an unshard request stays (its
     * compute buffers are live already, but a summon gathers the full
     * precision ones under mixed precision). */
    const unsigned movable = cfg->strategy == FS_NO_SHARD      ? 0u
                             : cfg->strategy == FS_SHARD_OPTIM ? FS_ACT_UNSHARD
                                                               : (FS_ACT_UNSHARD | FS_ACT_RESHARD);
    const int grad = (flags & FS_FLAG_GRAD_ENABLED) != 0;
    unsigned act = 0;
    *actions = 0;

    switch (ev) {
    case FS_EV_PRE_FORWARD:
        if (m->state == FS_STATE_IDLE || in_backward(m->state)) {
            m->resume = m->state;
            m->state = FS_STATE_FORWARD;
            act = FS_ACT_UNSHARD;
            break;
        }
        return FS_ERR_BAD_STATE; /* re-entered forward, or forward inside summon */

    case FS_EV_POST_FORWARD:
        if (m->state != FS_STATE_FORWARD)
            return FS_ERR_BAD_STATE;
        m->state = m->resume;
        if (in_backward(m->resume))
            break; /* recomputation: the backward that follows still needs it */
        if (!grad || (cfg->strategy == FS_FULL_SHARD && !cfg->is_root))
            act |= FS_ACT_RESHARD; /* no backward will come, or ZeRO-3 frees now */
        if (grad)
            act |= FS_ACT_HOOK_BACKWARD;
        break;

    case FS_EV_PRE_BACKWARD:
        if (m->state == FS_STATE_BACKWARD_PRE)
            break; /* another output of the same unit: already handled */
        if (m->state != FS_STATE_IDLE && m->state != FS_STATE_BACKWARD_POST)
            return FS_ERR_BAD_STATE;
        if (m->state == FS_STATE_IDLE)
            m->reduced_mask = 0;
        m->state = FS_STATE_BACKWARD_PRE;
        act = FS_ACT_UNSHARD;
        break;

    case FS_EV_POST_BACKWARD: {
        if (group < 0 || group >= 64 || !(cfg->grad_mask & ((uint64_t)1 << group)))
            return FS_ERR_INVALID_ARG;
        if (m->state != FS_STATE_BACKWARD_PRE)
            return FS_ERR_BAD_STATE;
        uint64_t bit = (uint64_t)1 << group;
        m->reduced_mask |= bit;
        if (!(flags & FS_FLAG_NO_SYNC))
            act |= FS_ACT_REDUCE_GRAD;
        if ((m->reduced_mask & cfg->grad_mask) == cfg->grad_mask) {
            m->state = FS_STATE_BACKWARD_POST;
            act |= FS_ACT_RESHARD;
        }
        break;
    }

    case FS_EV_FINALIZE:
        if (m->state == FS_STATE_FORWARD || m->state == FS_STATE_SUMMON)
            return FS_ERR_BAD_STATE;
        m->state = FS_STATE_IDLE;
        m->reduced_mask = 0;
        act = FS_ACT_RESHARD;
        break;

    case FS_EV_SUMMON_ENTER:
        if (m->state != FS_STATE_IDLE)
            return FS_ERR_BAD_STATE;
        m->state = FS_STATE_SUMMON;
        m->summon_was_sharded = !is_unsharded;
        act = FS_ACT_UNSHARD;
        break;

    case FS_EV_SUMMON_EXIT:
        if (m->state != FS_STATE_SUMMON)
            return FS_ERR_BAD_STATE;
        m->state = FS_STATE_IDLE;
        if (m->summon_was_sharded)
            act = FS_ACT_RESHARD;
        break;

    default:
        return FS_ERR_INVALID_ARG;
    }
    *actions = act & (movable | FS_ACT_REDUCE_GRAD | FS_ACT_HOOK_BACKWARD);
    return FS_OK;
}
