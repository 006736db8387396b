"""Every wait flatshard starts is bounded: FLATSHARD_COMM_TIMEOUT is checked
where it is read (finite, at least a second), the wrap-time agreement gives
up at the process group's own timeout when that is the shorter, and its
errors always name the rank they are about."""
import datetime
import os
import re
import time

import pytest
import torch.distributed as dist

from flatshard import FSDP, ConfigError
from flatshard.runtime import consistency
from flatshard.runtime import comm as fcomm
from flatshard.runtime import timeout as ftimeout
from toy_models import build


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "1e-9", "0.5", "0", "604801", "soon"])
def test_a_timeout_that_is_not_a_sane_number_of_seconds_is_refused(raw, monkeypatch):
    monkeypatch.setenv(ftimeout.ENV_TIMEOUT, raw)
    with pytest.raises(ConfigError, match=r"FLATSHARD_COMM_TIMEOUT=.* is not allowed; expected "
                                          r"a number of seconds from 1 to 604800"):
        ftimeout.comm_timeout_s()


@pytest.mark.parametrize("raw, want", [("1", 1.0), ("2.5", 2.5), ("604800", 604800.0)])
def test_a_timeout_in_range_is_taken(raw, want, monkeypatch):
    monkeypatch.setenv(ftimeout.ENV_TIMEOUT, raw)
    assert ftimeout.comm_timeout_s() == want


# ---------------------------------------------------------------------------
# the wrap-time agreement


def _one_rank_gives_up_before_the_wrap(group_timeout_s):
    """Rank 1 fails before the agreement (a setting only it has wrong) and
    goes on; rank 0 waits in the agreement."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group_timeout_s))
    if dist.get_rank() == 1:
        os.environ[fcomm.ENV_SLOT] = "junk"
    try:
        FSDP(build(), process_group=group)
        return "no error"
    except ConfigError as e:
        return str(e)
    finally:
        os.environ.pop(fcomm.ENV_SLOT, None)


def test_the_wrap_waits_no_longer_than_the_groups_timeout(dist_pool):
    # FLATSHARD_COMM_TIMEOUT is its default, 300 s: the group's 2 s must win,
    # as rank 0's message says (a 300 s wait would fail the pool's 60 s first).
    msg0, msg1 = dist_pool(2).run(_one_rank_gives_up_before_the_wrap, 2, timeout=60)
    assert "FLATSHARD_SHM_SLOT_BYTES" in msg1
    assert ("rank 1 did not reach the wrap of this model within 2 s (the process group's "
            "timeout) while rank 0 did") in msg0, msg0


class _StoreThatFailsItsWaits:
    """The group's store, except that wait() fails once every rank has posted
    (as when the store's connection breaks): nobody is missing."""

    def __init__(self, store, world):
        self.store, self.world = store, world

    def __getattr__(self, attr):
        return getattr(self.store, attr)

    def wait(self, keys, timeout):
        prefix = keys[0].rsplit("/", 1)[0] + "/"
        deadline = time.monotonic() + 20.0
        while not all(self.store.check([f"{prefix}{r}"]) for r in range(self.world)):
            assert time.monotonic() < deadline, "a rank never posted"
            time.sleep(0.02)
        raise RuntimeError("the store's connection was lost")


def _failing_store_wait():
    group = dist.new_group(backend="gloo")
    real = consistency._store
    consistency._store = lambda g: _StoreThatFailsItsWaits(real(g), dist.get_world_size(g))
    try:
        FSDP(build(), process_group=group)
        return "no error"
    except ConfigError as e:
        return str(e)
    finally:
        consistency._store = real


def test_a_failed_wait_with_every_rank_posted_names_the_waiting_rank(dist_pool):
    msgs = dist_pool(2).run(_failing_store_wait, timeout=60)
    for rank, msg in enumerate(msgs):
        assert not re.search(r"ranks? +did not", msg), msg  # a rank named by no number
        assert f"rank {rank} could not wait for the other ranks" in msg, msg
        assert "the store's connection was lost" in msg, msg
