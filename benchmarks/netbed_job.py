"""One rank of a job on the two-host bed (netbed.py starts four of these,
two in each network namespace): trains every configuration of the job
spec side by side, a step of each in turn, and writes its figures.

    (started by netbed.py) python3 netbed_job.py SPEC.json OUT_DIR

The spec (netbed.py job_spec) names the model (dim, blocks, batch), the
steps, the seed and the configurations (strategy FULL_SHARD or HSDP,
comm_backend auto or torch, quant off / int8 / int8+int4). The environment names the rank as torchrun would
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
the namespace's link (NETBED_IFNAME: gloo binds to it, and its kernel
counters give the bytes that crossed the link) and the host's name
(NETBED_HOST, set in this process' own UTS namespace so that flatshard's
comm_backend="auto" sees two hosts: shared memory inside one, the process
group across). Every rank writes OUT_DIR/rank<r>.json: per configuration,
each step's wall time, its loss (the mean over all ranks' batches) and the
bytes its host sent on the link.
"""
import json
import os
import socket
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

QUANTS = {"off": None, "int8": dict(weights="int8"), "int8+int4": dict(weights="int8",
                                                                        grads="int4")}


class Block(nn.Module):
    """A residual MLP block: 8*dim^2 + 5*dim parameters, the unit of wrapping."""

    def __init__(self, dim):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def build(spec):
    """The model every configuration (and the tests' reference) starts from."""
    torch.manual_seed(spec["seed"])
    d = spec["dim"]
    return nn.Sequential(*[Block(d) for _ in range(spec["blocks"])], nn.Linear(d, d))


def batches(spec):
    """The global batch of each step (world * batch rows); rank r trains rows
    [r*batch, (r+1)*batch)."""
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    rows = spec["world"] * spec["batch"]
    return [(torch.randn(rows, spec["dim"], generator=g), torch.randn(rows, spec["dim"],
                                                                       generator=g))
            for _ in range(spec["steps"])]


def comm_quant(name):
    """The wrapper's comm_quant= keyword for a quant name ({} for off)."""
    if QUANTS[name] is None:
        return {}
    import flatshard
    cls = getattr(flatshard, "CommQuant", None)
    if cls is None:
        raise SystemExit(f"netbed_job: quant {name!r} needs flatshard.CommQuant (quantized "
                         "collectives), which this flatshard does not have; use quant 'off'")
    return {"comm_quant": cls(**QUANTS[name])}


def wrap(spec, cfg):
    import flatshard
    from flatshard import FSDP, ShardingStrategy
    strategy = {"FULL_SHARD": ShardingStrategy.FULL_SHARD,
                "HSDP": ShardingStrategy.HYBRID_SHARD}[cfg["strategy"]]
    model = FSDP(build(spec), sharding_strategy=strategy, comm_backend=cfg["backend"],
                 auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                 **comm_quant(cfg["quant"]))
    return model, torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)


def link_tx_bytes():
    """Bytes this host (namespace) has sent on the bed's link so far."""
    with open(f"/sys/class/net/{os.environ['NETBED_IFNAME']}/statistics/tx_bytes") as f:
        return int(f.read())


def engine_sent(model):
    """Bytes sent as the engine counts them, where this flatshard reports
    them (memory_stats' *sent* entries); {} where it does not."""
    import flatshard
    stats = flatshard.memory_stats(model)
    return {k: v for k, v in stats.items() if "sent" in k and isinstance(v, int)}


def backends(model):
    """The backends the root unit's collectives run on: (shard group's,
    replicate group's or None)."""
    from flatshard.fsdp.groups import unit_comms
    _, comm, replicate, _ = unit_comms(model._cfg)
    return [comm.backend, None if replicate is None else replicate.backend]


def main():
    spec_path, out_dir = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    socket.sethostname(os.environ["NETBED_HOST"])  # this process' own UTS namespace
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NETBED_IFNAME"]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    counts = int(os.environ["LOCAL_RANK"]) == 0  # one reader of the host's link counter
    runs = [wrap(spec, cfg) for cfg in spec["configs"]]
    res = [dict(cfg, times=[], losses=[], link_tx=[], engine_sent={}) for cfg in spec["configs"]]
    mine = slice(rank * spec["batch"], (rank + 1) * spec["batch"])
    for x, y in batches(spec):
        for (model, opt), r in zip(runs, res):  # every configuration in turn, a step each
            dist.barrier()
            tx0, t0 = link_tx_bytes() if counts else 0, time.perf_counter()
            loss = ((model(x[mine]) - y[mine]) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            r["times"].append(time.perf_counter() - t0)
            r["link_tx"].append(link_tx_bytes() - tx0 if counts else 0)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            r["losses"].append(mean.item() / dist.get_world_size())
    for (model, _), r in zip(runs, res):
        r["engine_sent"], r["backends"] = engine_sent(model), backends(model)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "host": socket.gethostname(), "configs": res}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
