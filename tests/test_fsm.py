"""The unit state machine (csrc/engine/unit_fsm.c) as a pure transition function."""
import pytest

from flatshard import _C

S = {_C.STATE_IDLE: "IDLE", _C.STATE_FORWARD: "FORWARD", _C.STATE_BACKWARD_PRE: "BACKWARD_PRE",
     _C.STATE_BACKWARD_POST: "BACKWARD_POST", _C.STATE_SUMMON: "SUMMON"}
UN, RE, RG, HB = _C.ACT_UNSHARD, _C.ACT_RESHARD, _C.ACT_REDUCE_GRAD, _C.ACT_HOOK_BACKWARD
GRAD, NOSYNC = _C.FLAG_GRAD_ENABLED, _C.FLAG_NO_SYNC


class Machine:
    def __init__(self, strategy, is_root=False, grad_mask=1):
        self.cfg = (strategy, int(is_root), grad_mask)
        self.fsm = (_C.STATE_IDLE, _C.STATE_IDLE, 0, 0)
        self.unsharded = strategy == _C.NO_SHARD

    def __call__(self, ev, flags=0, group=-1):
        self.fsm, act = _C.fsm_step(self.cfg, self.fsm, ev, flags, group, self.unsharded)
        if act & UN:
            self.unsharded = True
        if act & RE:
            self.unsharded = False
        return act

    @property
    def state(self):
        return S[self.fsm[0]]


def training_step(m, flags=GRAD, sync=True):
    """Forward, backward with one gradient group, end of backward."""
    acts = [m(_C.EV_PRE_FORWARD, flags), m(_C.EV_POST_FORWARD, flags)]
    acts += [m(_C.EV_PRE_BACKWARD), m(_C.EV_POST_BACKWARD, 0 if sync else NOSYNC, 0)]
    acts.append(m(_C.EV_FINALIZE))
    return acts


def test_full_shard_non_root_reshards_after_forward_and_backward():
    m = Machine(_C.FULL_SHARD)
    assert training_step(m) == [UN, RE | HB, UN, RG | RE, RE]
    assert m.state == "IDLE" and not m.unsharded


def test_full_shard_root_keeps_parameters_for_backward():
    m = Machine(_C.FULL_SHARD, is_root=True)
    assert training_step(m) == [UN, HB, UN, RG | RE, RE]


def test_shard_grad_op_keeps_parameters_until_backward_ends():
    m = Machine(_C.SHARD_GRAD_OP)
    acts = training_step(m)
    assert acts[1] == HB and m.state == "IDLE" and not m.unsharded


def test_no_shard_never_moves_parameters():
    m = Machine(_C.NO_SHARD)
    assert training_step(m) == [0, HB, 0, RG, 0]
    assert m.unsharded


def test_no_sync_skips_reduction_but_still_reshards():
    m = Machine(_C.FULL_SHARD)
    assert training_step(m, sync=False)[3] == RE


@pytest.mark.parametrize("strategy", [_C.FULL_SHARD, _C.SHARD_GRAD_OP])
def test_forward_without_grad_always_reshards(strategy):
    m = Machine(strategy, is_root=True)
    assert m(_C.EV_PRE_FORWARD, 0) == UN
    assert m(_C.EV_POST_FORWARD, 0) == RE
    assert not m.unsharded


def test_reduction_waits_for_every_gradient_group():
    m = Machine(_C.FULL_SHARD, grad_mask=0b101)  # groups 0 and 2 take gradients
    m(_C.EV_PRE_FORWARD, GRAD), m(_C.EV_POST_FORWARD, GRAD), m(_C.EV_PRE_BACKWARD)
    assert m(_C.EV_POST_BACKWARD, 0, 2) == RG and m.state == "BACKWARD_PRE"
    assert m(_C.EV_POST_BACKWARD, 0, 0) == RG | RE and m.state == "BACKWARD_POST"
    with pytest.raises(_C.CoreError):  # group 1 takes no gradient
        m(_C.EV_POST_BACKWARD, 0, 1)


def test_repeated_pre_backward_is_idempotent():
    m = Machine(_C.FULL_SHARD)
    m(_C.EV_PRE_FORWARD, GRAD), m(_C.EV_POST_FORWARD, GRAD)
    assert m(_C.EV_PRE_BACKWARD) == UN
    assert m(_C.EV_PRE_BACKWARD) == 0


def test_recompute_forward_inside_backward_returns_to_backward():
    m = Machine(_C.FULL_SHARD)
    m(_C.EV_PRE_FORWARD, GRAD), m(_C.EV_POST_FORWARD, GRAD), m(_C.EV_PRE_BACKWARD)
    assert m(_C.EV_PRE_FORWARD, GRAD) == UN
    assert m(_C.EV_POST_FORWARD, GRAD) == 0 and m.state == "BACKWARD_PRE"


def test_summon_restores_previous_sharding():
    m = Machine(_C.FULL_SHARD)
    assert m(_C.EV_SUMMON_ENTER) == UN and m.state == "SUMMON"
    assert m(_C.EV_SUMMON_EXIT) == RE and not m.unsharded
    m = Machine(_C.FULL_SHARD, is_root=True)
    m(_C.EV_PRE_FORWARD, GRAD), m(_C.EV_POST_FORWARD, GRAD)  # root stays unsharded
    assert m(_C.EV_SUMMON_ENTER) == UN and m(_C.EV_SUMMON_EXIT) == 0


@pytest.mark.parametrize("state_events,bad", [
    ([], _C.EV_POST_FORWARD),
    ([], _C.EV_POST_BACKWARD),
    ([_C.EV_PRE_FORWARD], _C.EV_PRE_FORWARD),
    ([_C.EV_PRE_FORWARD], _C.EV_PRE_BACKWARD),
    ([_C.EV_PRE_FORWARD], _C.EV_FINALIZE),
    ([_C.EV_SUMMON_ENTER], _C.EV_PRE_FORWARD),
    ([_C.EV_SUMMON_ENTER], _C.EV_SUMMON_ENTER),
    ([], _C.EV_SUMMON_EXIT),
])
def test_refused_events_raise_and_leave_state(state_events, bad):
    m = Machine(_C.FULL_SHARD)
    for ev in state_events:
        m(ev, GRAD, 0)
    before = m.fsm
    with pytest.raises(_C.StateError, match="not allowed"):
        m(bad, GRAD, 0)
    assert m.fsm == before
