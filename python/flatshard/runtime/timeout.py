"""How long any wait flatshard starts may last: FLATSHARD_COMM_TIMEOUT
(default 300 s), capped by the process group's own timeout where that is
shorter.

Read by every collective backend (comm.py's shm and torch, cuda_nccl.py's
NCCL), by device.py and by the wrap-time agreement (consistency.py), so it
sits below all of them and imports nothing of flatshard's but the
environment table and the errors.
"""
import math

import torch

from .. import envvars
from ..errors import bad_value

ENV_TIMEOUT = "FLATSHARD_COMM_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
# Under a second, healthy ranks on a loaded host time out; past a week, a hang
# is as good as unbounded (and float('inf') would fail every wait at once).
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 86400.0


def comm_timeout_s():
    """FLATSHARD_COMM_TIMEOUT in seconds (read at each call), or the default."""
    raw = envvars.read(ENV_TIMEOUT)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:  # also refuses nan
        raise bad_value(ENV_TIMEOUT, raw, f"expected a number of seconds from {MIN_TIMEOUT_S:g} "
                        f"to {MAX_TIMEOUT_S:g} (one week)")
    return value


def group_timeout_s(group):
    """The process group's own timeout (its backend's), or None where the
    backend does not say."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def wait_timeout(group):
    """-> (seconds, what set them): how long any wait flatshard starts for
    `group` may last. FLATSHARD_COMM_TIMEOUT, capped by the group's own
    timeout: a rank that gave up on the group (its collectives timed out)
    must not leave its peers waiting on flatshard's longer one."""
    mine, theirs = comm_timeout_s(), group_timeout_s(group)
    if theirs is not None and theirs < mine:
        return theirs, "the process group's timeout"
    return mine, ENV_TIMEOUT
