"""Which configuration fits, and which of those is fastest: every strategy
with and without offload (and activation checkpointing when an activation
estimate is possible) planned, checked against the device (and host) limit,
and ordered by an expected step time.

Expected step time (an estimate for ordering, not a prediction of seconds):
  compute   6*psi*tokens/flops per rank (tokens = batch_size*seq_len), plus
            2*psi*tokens/flops to recompute the forward under checkpointing
  network   the plan's communication bytes / net_bw
  host      offload traffic (parameter shards in, gradient shards out) / pcie_bw
  disk      optimizer state read and written once / disk_bw
"""
from dataclasses import dataclass

from ..errors import bad_value
from .core import plan
from .report import ranking_table

# Defaults for the step-time estimate: a current GPU node (bytes/s, flop/s).
NET_BW, PCIE_BW, DISK_BW, FLOPS = 100e9, 25e9, 5e9, 300e12
OFFLOAD_CHOICES = (dict(), dict(offload_optimizer="cpu"), dict(offload_params=True),
                   dict(offload_optimizer="disk"))


@dataclass
class Ranked:
    plan: object
    fits: bool
    step_s: float
    why: str        # what does not fit, or ""


class Ranking:
    """`fitting`: the configurations that fit, fastest first; `first` the
    fastest of them (None when nothing fits); `all` every one planned."""

    def __init__(self, ranked, device_bytes, host_bytes):
        self.all = ranked
        self.fitting = [r for r in ranked if r.fits]
        self.first = self.fitting[0] if self.fitting else None
        self.device_bytes, self.host_bytes = device_bytes, host_bytes

    def table(self):
        """The ranking as text: every configuration, whether it fits, and
        the first that does."""
        return ranking_table(self)


def step_time(p, flops=FLOPS, net_bw=NET_BW, pcie_bw=PCIE_BW, disk_bw=DISK_BW):
    c = p.config
    tokens = (c["batch_size"] or 0) * (c["seq_len"] or 0)
    psi = c["params"]
    t = 6 * psi * tokens / flops
    if c["activation_checkpointing"]:
        t += 2 * psi * tokens / flops
    t += p.comm_bytes / net_bw + p.transfer_bytes / pcie_bw
    t += 2 * p.total("disk") / disk_bw
    return t


def rank(model=None, *, device_bytes, host_bytes=None, strategies=None, flops=FLOPS,
         net_bw=NET_BW, pcie_bw=PCIE_BW, disk_bw=DISK_BW, **kw):
    """Plan every configuration (strategies x offload x checkpointing) with
    plan()'s keyword arguments, keep those whose device total fits in
    device_bytes (and host total in host_bytes), fastest first -> Ranking."""
    for name, v in (("device_bytes", device_bytes), ("host_bytes", host_bytes)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise bad_value(name, v, "expected a positive number of bytes")
    for k in ("strategy", "offload_params", "offload_optimizer", "activation_checkpointing"):
        if k in kw:
            raise bad_value(k, kw[k], "rank() tries every value itself",
                            "use plan() for one configuration, or strategies=[...]")
    if strategies is None:
        strategies = ["NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD"]
        if kw.get("hybrid_group"):
            strategies.append("HYBRID_SHARD")
    acts = [False, True] if kw.get("batch_size") and kw.get("hidden") else [False]
    ranked = []
    for st in strategies:
        for off in OFFLOAD_CHOICES:
            for ac in acts:
                p = plan(model, strategy=st, activation_checkpointing=ac, **off, **kw)
                why = []
                if p.total("device") > device_bytes:
                    why.append(f"device {p.total('device') / 2**30:.1f} GiB > "
                               f"{device_bytes / 2**30:.1f} GiB")
                if host_bytes is not None and p.total("host") > host_bytes:
                    why.append(f"host {p.total('host') / 2**30:.1f} GiB > "
                               f"{host_bytes / 2**30:.1f} GiB")
                ranked.append(Ranked(p, not why, step_time(p, flops, net_bw, pcie_bw, disk_bw),
                                     "; ".join(why)))
    # Fastest first; ties (no batch given) go to the less intrusive option.
    order = {id(r): i for i, r in enumerate(ranked)}
    ranked.sort(key=lambda r: (not r.fits, r.step_s, order[id(r)]))
    return Ranking(ranked, device_bytes, host_bytes)
