"""The planner's output: text tables, the stacked-bar figure, and the
`python -m flatshard plan` subcommand."""
import importlib
import re

from .errors import ConfigError, bad_value

GIB = 2 ** 30
COLORS = {"params": "#4c72b0", "params_gathered": "#8fb0de", "grads": "#dd8452",
          "grad_unreduced": "#f2b98f", "master": "#937860", "moments": "#c44e52", "optim_steps": "#c44e52",
          "comm_buffers": "#8c8c8c", "activations": "#55a868"}
STRATS = ("NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD")


def _gib(n):
    return f"{n / GIB:,.2f}"


def plan_table(p, explain=True):
    c = p.config
    head = (f"{p.name}: {c['params']:,} parameters, world {c['world_size']}, "
            f"{c['strategy']}, optimizer {c['optimizer']} (K={c['k_bytes']} bytes/param), "
            f"param bytes {c['param_bytes'] or 'as stored'}, layout {c['layout']}")
    rows = [head] + [f"  note: {n}" for n in p.notes]
    rows.append(f"  {'per rank':<34}{'GiB':>10}  {'where':<6}" + ("  formula" if explain else ""))
    for ln in p.lines:
        rows.append(f"  {ln.label:<34}{_gib(ln.bytes):>10}  {ln.where:<6}"
                    + (f"  {ln.formula}" if explain else ""))
    for where in ("device", "host", "disk"):
        if p.total(where) or where == "device":
            rows.append(f"  {'total ' + where:<34}{_gib(p.total(where)):>10}")
    if p.peak_rss is not None:
        rows.append(f"  {'peak resident on CPU':<34}{_gib(p.peak_rss):>10}"
                    + ("  every line but disk, at once" if explain else ""))
    rows.append(f"  communication per step: {_gib(p.comm_bytes)} GiB sent per rank"
                + (f" ({p.comm_formula})" if explain else ""))
    if p.transfer_bytes:
        rows.append(f"  host<->device per step: {_gib(p.transfer_bytes)} GiB")
    return "\n".join(rows)


def compare_table(plans):
    """One column per configuration, one row per line (GiB per rank)."""
    keys = list(dict.fromkeys(ln.key for p in plans for ln in p.lines))
    label = {ln.key: ln.label.split(" [")[0].split(" (")[0] for p in plans for ln in p.lines}
    w = max(14, *(len(p.name) + 2 for p in plans))
    rows = [f"{'GiB per rank':<32}" + "".join(f"{p.name:>{w}}" for p in plans)]
    def cell(p, k):
        away = any(ln.key == k and ln.where != "device" for ln in p.lines)
        return f"{_gib(p[k]) + ('*' if away else ''):>{w}}"
    for k in keys:
        rows.append(f"{label[k]:<32}" + "".join(cell(p, k) for p in plans))
    for title, fn in (("total device", lambda p: p.total("device")),
                      ("total host", lambda p: p.total("host")),
                      ("total disk", lambda p: p.total("disk")),
                      ("comm per step", lambda p: p.comm_bytes)):
        rows.append(f"{title:<32}" + "".join(f"{_gib(fn(p)):>{w}}" for p in plans))
    rows.append("(* held on host or disk, not on the device)")
    return "\n".join(rows)


def ranking_table(r):
    rows = [f"{'configuration':<40}{'device GiB':>12}{'host GiB':>10}{'step s (est.)':>15}  fits"]
    for x in r.all:
        p = x.plan
        rows.append(f"{p.name:<40}{_gib(p.total('device')):>12}{_gib(p.total('host')):>10}"
                    f"{x.step_s:>15.3f}  {'yes' if x.fits else 'no: ' + x.why}")
    rows.append(f"first to fit in {_gib(r.device_bytes)} GiB: "
                + (r.first.plan.name if r.first else "none (more ranks, offload, "
                   "checkpointing or a smaller batch)"))
    return "\n".join(rows)


def plot(plans, path, device_bytes=None, title=None):
    """Stacked bars of each plan's device bytes by line, the limit as a line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("flatshard: --plot needs matplotlib, which is not installed; "
                          "pip install matplotlib (or flatshard[test])") from None
    fig, ax = plt.subplots(figsize=(1.6 * len(plans) + 3, 4.8))
    names = [p.name.replace(" + ", "\n+ ") for p in plans]
    bottom = [0.0] * len(plans)
    keys = list(dict.fromkeys(ln.key for p in plans for ln in p.lines))
    for k in keys:
        vals = [sum(ln.bytes for ln in p.lines if ln.key == k and ln.where == "device") / GIB
                for p in plans]
        if not any(vals):
            continue
        label = next(ln.label for p in plans for ln in p.lines if ln.key == k)
        label = label.split(" [")[0].split(" (")[0]
        ax.bar(names, vals, bottom=bottom, label=label, color=COLORS.get(k))
        bottom = [b + v for b, v in zip(bottom, vals)]
    if device_bytes:
        ax.axhline(device_bytes / GIB, color="black", linestyle="--",
                   label=f"device memory {device_bytes / GIB:.0f} GiB")
    ax.set_ylabel("GiB per rank (device)")
    ax.set_title(title or "")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ command line

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
    import torch
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
        from .wrap import ModuleWrapPolicy
        kw["auto_wrap_policy"] = ModuleWrapPolicy({_load(a.wrap, "--wrap")})
    return model, kw


def run(a):
    from .plan import plan
    from .plan_rank import rank
    model, kw = _kwargs(a)
    off = {"none": {}, "optimizer": dict(offload_optimizer="cpu"),
           "params": dict(offload_params=True), "disk": dict(offload_optimizer="disk")}
    strategies = a.strategy or list(STRATS) + (["HYBRID_SHARD"] if a.hybrid_group else [])
    plans = [plan(model, strategy=s, activation_checkpointing=a.ac, **off[a.offload], **kw)
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
