"""`python -m flatshard plan`: the planner's command line (__main__.py adds
this parser). Plans every requested strategy (core.py), ranks what fits a
memory size (ranking.py) and prints or plots the result (report.py)."""
import importlib
import re

import torch

from ..errors import bad_value
from ..fsdp.wrap import ModuleWrapPolicy
from .core import plan
from .ranking import rank
from .report import compare_table, plot

STRATS = ("NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD")


def parse_bytes(text):
    """'80GiB', '141GB', '8e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", str(text))
    units = {None: 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10,
             "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    try:
        return int(float(m.group(1)) * units[m.group(2)])
    except (AttributeError, ValueError, KeyError):
        raise bad_value("memory size", text, "expected a number with an optional unit, "
                        "e.g. 80GiB, 141GB or 8e9") from None


def _load(spec, what):
    mod, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(mod)
        for a in attr.split("."):
            obj = getattr(obj, a)
        return obj
    except (ImportError, AttributeError, ValueError) as e:
        raise bad_value(what, spec, f"expected MODULE:NAME that imports ({e})") from None


def add_parser(commands):
    p = commands.add_parser(
        "plan", help="predict each rank's memory per configuration; rank what fits",
        description="Per-rank memory by category (parameters, gathered units, gradients, "
        "fp32 master, optimizer moments, communication buffers, activations) for each "
        "sharding strategy, with the formula of every line (--explain).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    src.add_argument("--model", help="MODULE:CALLABLE returning an nn.Module; called on the "
                     "meta device, so nothing is allocated")
    p.add_argument("--wrap", help="MODULE:CLASS of the modules to wrap as units (with --model)")
    p.add_argument("--world", type=int, default=1, help="number of ranks")
    p.add_argument("--hybrid-group", type=int, help="HYBRID_SHARD group size (ranks per node)")
    p.add_argument("--strategy", action="append", choices=STRATS + ("HYBRID_SHARD",),
                   help="repeatable; default: all four ZeRO stages")
    p.add_argument("--mixed-precision", default="none", choices=["none", "bf16", "fp16"])
    p.add_argument("--reduce-dtype", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd_momentum",
                                                            "sgd"])
    p.add_argument("--layout", default="flatshard", choices=["flatshard", "zero"])
    p.add_argument("--offload", default="none", choices=["none", "optimizer", "params", "disk"])
    p.add_argument("--snapshots", action="store_true",
                   help="add flatshard.Snapshots' host shared memory (two slots of the "
                   "rank's shards and optimizer state)")
    p.add_argument("--offload-pipeline", type=int, metavar="UNITS",
                   help="with --offload params: overlap_offload's max_units_in_flight")
    p.add_argument("--ac", action="store_true", help="activation checkpointing")
    for k in ("layers", "hidden", "heads", "seq", "batch", "vocab"):
        p.add_argument(f"--{k}", type=int)
    p.add_argument("--flash", action="store_true", help="attention scores not stored")
    p.add_argument("--backend", default="nccl", choices=["shm", "torch", "nccl"])
    p.add_argument("--device-memory", help="e.g. 80GiB: rank the configurations that fit")
    p.add_argument("--host-memory", help="host memory per rank, with --device-memory")
    p.add_argument("--plot", help="write stacked bars per configuration to this .png")
    p.add_argument("--explain", action="store_true", help="print every line's formula")
    p.set_defaults(run=run)


def _kwargs(a):
    kw = dict(world_size=a.world, hybrid_group=a.hybrid_group, optimizer=a.optimizer,
              layout=a.layout, mixed_precision=None if a.mixed_precision == "none"
              else a.mixed_precision, reduce_dtype=a.reduce_dtype, layers=a.layers,
              hidden=a.hidden, heads=a.heads, seq_len=a.seq, batch_size=a.batch, vocab=a.vocab,
              flash_attention=a.flash, comm_backend=a.backend)
    if a.params is not None:
        return None, dict(kw, params=a.params)
    factory = _load(a.model, "--model")
    with torch.device("meta"):
        model = factory()
    if a.wrap:
        kw["auto_wrap_policy"] = ModuleWrapPolicy({_load(a.wrap, "--wrap")})
    return model, kw


def run(a):
    model, kw = _kwargs(a)
    off = {"none": {}, "optimizer": dict(offload_optimizer="cpu"),
           "params": dict(offload_params=True), "disk": dict(offload_optimizer="disk")}
    if a.offload_pipeline is not None:
        if a.offload != "params":
            raise SystemExit("--offload-pipeline: needs --offload params (the overlapped "
                             "step is parameter offload's)")
        off["params"]["offload_pipeline"] = a.offload_pipeline
    strategies = a.strategy or list(STRATS) + (["HYBRID_SHARD"] if a.hybrid_group else [])
    plans = [plan(model, strategy=s, activation_checkpointing=a.ac, snapshots=a.snapshots,
                  **off[a.offload], **kw)
             for s in strategies]
    device = parse_bytes(a.device_memory) if a.device_memory else None
    if a.explain:
        print("\n\n".join(p.table(explain=True) for p in plans))
    else:
        print(compare_table(plans))
    if device is not None:
        host = parse_bytes(a.host_memory) if a.host_memory else None
        r = rank(model, device_bytes=device, host_bytes=host, strategies=strategies, **kw)
        print()
        print(r.table())
    if a.plot:
        extra = [] if a.offload != "none" else [
            plan(model, strategy="FULL_SHARD", activation_checkpointing=a.ac, **o, **kw)
            for o in (off["optimizer"], off["params"])]
        plot(plans + extra, a.plot, device, title=f"{plans[0].config['params'] / 1e9:.1f}B "
             f"parameters on {a.world} ranks, {a.mixed_precision}, {a.optimizer}")
        print(f"flatshard: wrote {a.plot}")
