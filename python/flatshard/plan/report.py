"""The planner's output: text tables (one plan, a comparison, a ranking) and
the stacked-bar figure. Imports nothing of the planner: core.py and
ranking.py call it to print their results, cli.py to print the command's."""
from ..errors import ConfigError

GIB = 2 ** 30
COLORS = {"params": "#4c72b0", "params_gathered": "#8fb0de", "grads": "#dd8452",
          "grad_unreduced": "#f2b98f", "master": "#937860", "moments": "#c44e52", "optim_steps": "#c44e52",
          "comm_buffers": "#8c8c8c", "activations": "#55a868"}


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
    notes = list(dict.fromkeys(n for p in plans for n in p.notes))
    for n in notes:
        which = [p.name for p in plans if n in p.notes]
        rows.append(f"note: {n}" + ("" if len(which) == len(plans) else
                                    f" ({', '.join(which)})"))
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
