"""Memory planner: each rank's bytes by category before training, from a
model (on the meta device: planning a 70B model allocates nothing) or a bare
parameter count, with the formula behind every line.

    from flatshard.plan import plan, rank
    p = plan(params=7e9, world_size=8, strategy="FULL_SHARD",
             mixed_precision="bf16", optimizer="adamw")
    print(p.table())

`rank` (ranking.py) orders the configurations that fit a device limit;
`watch`/`check` (measure.py) hold a plan against a training run;
report.py prints and plots, cli.py serves `python -m flatshard plan`.
This module is the arithmetic; the package's __init__.py gathers the public
names from here and from the modules above it.

Two accountings (`layout=`):
  "flatshard"  what flatshard (and torch FSDP1) hold: each flat buffer padded
               so every parameter starts 16-byte aligned and the buffer splits
               evenly over the shard group (fsdp/flat_param.py,
               csrc/core/layout.c); the persistent shard keeps the parameters' own
               dtype and is itself the master copy; mixed precision gathers a
               param_dtype copy; gradient shards are kept in the shard's
               dtype; SHARD_OPTIM (fsdp/zero1.py) keeps the whole buffer and
               whole gradient besides its shard. On CPU the model states predicted here equal the
               bytes flatshard allocates (tests/test_plan_measure.py).
  "zero"       the ZeRO paper's accounting (Rajbhandari et al. 2019, sec. 3):
               parameters and gradients in param_dtype, the optimizer's K bytes
               per parameter (Adam: fp32 master 4 + moments 8 = 12) on top.
Everything outside model states (gathered units, unreduced gradients,
activations) is an estimate and says so.
"""
from dataclasses import dataclass

import torch

from ..errors import bad_value
from ..options import normalize_comm_quant
from ..runtime.ahead import DEFAULT_BYTES as DEFAULT_AHEAD
from ..runtime.comm import DEFAULT_SLOT_BYTES
from .report import plan_table
from .units import flat_layout, typical_layers, units_from_count, units_from_model

STRATEGIES = ("NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD", "HYBRID_SHARD")
ZERO_NAMES = {"NO_SHARD": "DDP", "SHARD_OPTIM": "ZeRO-1", "SHARD_GRAD_OP": "ZeRO-2",
              "FULL_SHARD": "ZeRO-3", "HYBRID_SHARD": "HSDP"}
# Optimizer state: (moment buffers per element, bytes of step counter per tensor).
OPTIMIZERS = {"adamw": (2, 4), "adam": (2, 4), "sgd_momentum": (1, 0), "sgd": (0, 0)}
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "float64": 8, "fp64": 8}
OFFLOADS = (None, "cpu", "disk")
LAYOUTS = ("flatshard", "zero")
BACKENDS = ("shm", "torch", "nccl")
MODEL_STATES = ("params", "grads", "master", "moments", "optim_steps")


def _dtype_bytes(arg, value, allow_none=True):
    if value is None and allow_none:
        return None
    if isinstance(value, torch.dtype):
        return torch.empty((), dtype=value).element_size()
    if isinstance(value, str) and value.lower().replace("torch.", "") in DTYPE_BYTES:
        return DTYPE_BYTES[value.lower().replace("torch.", "")]
    raise bad_value(arg, value, "expected a torch dtype or one of " + ", ".join(DTYPE_BYTES))


@dataclass
class Line:
    key: str
    label: str
    bytes: int
    where: str      # "device", "host" or "disk"
    formula: str


class Plan:
    """One configuration's per-rank breakdown: `lines` (Line), totals by
    place, communication per step; `table()` prints it."""

    def __init__(self, config, lines, comm_bytes, comm_formula, transfer_bytes, notes):
        self.config, self.lines = config, lines
        self.comm_bytes, self.comm_formula = comm_bytes, comm_formula
        self.transfer_bytes = transfer_bytes
        self.notes = notes

    def __getitem__(self, key):
        return sum(ln.bytes for ln in self.lines if ln.key == key)

    def total(self, where="device"):
        return sum(ln.bytes for ln in self.lines if ln.where == where)

    @property
    def peak_rss(self):
        """Training on CPU, where every line but disk is host memory: the
        process's predicted peak resident bytes (the measured runtime
        included); None unless plan() was given runtime_bytes."""
        if not any(ln.key == "runtime" for ln in self.lines):
            return None
        return sum(ln.bytes for ln in self.lines if ln.where != "disk")

    @property
    def model_states(self):
        """params + grads + fp32 master + optimizer moments, wherever they live."""
        return sum(self[k] for k in MODEL_STATES)

    @property
    def name(self):
        c = self.config
        s = ZERO_NAMES[c["strategy"]]
        if c["strategy"] == "HYBRID_SHARD":
            s += f"({c['hybrid_group']})"
        if c["offload_params"]:
            s += " + param offload"
        elif c["offload_optimizer"]:
            s += f" + optim offload ({c['offload_optimizer']})"
        if c["activation_checkpointing"]:
            s += " + AC"
        return s

    def table(self, explain=True):
        """The breakdown as text; explain: each line's formula too."""
        return plan_table(self, explain)


def _gathered_units(units, elem_of, strategy, shard_world, prefetch, ahead=0):
    """Peak bytes of gathered (unsharded, compute-dtype) units and its formula.
    ahead: the gather-ahead budget (runtime/ahead.py), 0 for none."""
    size = [sum(flat_layout(g.numels, g.elem_bytes, shard_world)[1] * elem_of(g)
                for g in u.groups) for u in units]
    root, inner = size[-1], sorted(size[:-1], reverse=True)
    if strategy in ("FULL_SHARD", "HYBRID_SHARD"):
        k = 2 if prefetch else 1
        formula = (f"root unit (kept gathered from forward to backward) + the {k} largest "
                   f"other unit(s) gathered at once "
                   f"({'current + prefetched' if k == 2 else 'no prefetch'})")
        most = _ahead_peak(size[:-1], ahead)
        if most > sum(inner[:k]):
            return root + most, (f"root unit + the most gathered at once with "
                                 f"{ahead} bytes gathered ahead: a unit and the units after "
                                 "(or before) it that fit, in wrap order")
        return root + sum(inner[:k]), formula
    return sum(size), "every unit, padded, gathered from forward to the end of backward"


def _ahead_peak(sizes, budget):
    """With units gathered ahead (runtime/ahead.py): the most bytes one
    gather leaves live, a unit and the run of units after it (forward) or
    before it (backward) that fits the budget, or the run the root's gather
    takes; `sizes` in wrap order, which the forward order follows."""
    if not budget:
        return 0

    def run(i, step):  # the bytes of the run from index i going `step`, no copies
        left = budget
        while 0 <= i < len(sizes) and sizes[i] <= left:
            left -= sizes[i]
            i += step
        return budget - left
    best = run(0, 1)
    for i, s in enumerate(sizes):
        best = max(best, s + run(i + 1, 1), s + run(i - 1, -1))
    return best


def _activations(c):
    """Korthikanti et al. 2022 per transformer layer: s*b*h*(34 + 5*a*s/h)
    bytes with 16-bit activations; an estimate. A measured figure
    (activation_bytes, from measure.SavedActivations) replaces it."""
    if c["activation_bytes"]:
        return c["activation_bytes"], ("measured: the bytes autograd saved for backward in "
                                       "one forward (flatshard.plan.SavedActivations)")
    b, s, h, L = c["batch_size"], c["seq_len"], c["hidden"], c["layers"]
    if None in (b, s, h, L):
        return 0, "not estimated: give batch_size, seq_len, hidden and layers"
    a = c["heads"] or max(1, h // 128)
    scale = c["act_bytes"] / 2
    attn = 0 if c["flash_attention"] else 5 * a * s / h
    layer = s * b * h * (34 + attn) * scale
    logits = 4 * s * b * c["vocab"] if c["vocab"] else 0
    term = "34" if c["flash_attention"] else f"34 + 5*a*s/h, a={a}"
    if c["activation_checkpointing"]:
        total = L * 2 * s * b * h * scale + layer + logits
        f = (f"estimate: checkpointed: L*2*s*b*h (each layer's input) + one layer recomputed "
             f"s*b*h*({term})")
    else:
        total = L * layer + logits
        f = f"estimate (Korthikanti et al. 2022): L*s*b*h*({term})"
    if scale != 1:
        f += f", x{scale:g} for {c['act_bytes']}-byte activations"
    if logits:
        f += " + 4*s*b*V fp32 logits"
    return int(total), f + f"; L={L} s={s} b={b} h={h}"


def _quant_elem_bytes(bits, block):
    """Bytes per value a quantized payload moves: the codes and one float32
    scale per block (csrc/core/quant.h; its 8-byte padding left out)."""
    return bits / 8 + 4 / block


def _comm(units, c, n, world, cb, rb):
    """Bytes each rank sends per step (ring algorithms: all-gather and
    reduce-scatter move (n-1)/n of the buffer, all-reduce twice that; a
    quantized reduce-scatter's all-to-all moves the same share of its
    payloads). comm_quant replaces the gathers' and reduce-scatters' bytes
    per value by the payloads'; whole-gradient all-reduces and HSDP's
    all-reduce across groups keep reduce_bytes."""
    psi = sum(u.numel for u in units)
    st, r = c["strategy"], (n - 1) / n
    if world == 1:
        return 0, "one rank: no communication"
    q = c["comm_quant"]
    if q is not None and q.weights and st != "NO_SHARD":
        cb = _quant_elem_bytes(8, q.block_size)
    if q is not None and q.grads and st not in ("NO_SHARD", "SHARD_OPTIM"):
        rb_rs = _quant_elem_bytes(q.engine_args[1], q.block_size)
    else:
        rb_rs = rb
    f_q = "" if q is None else (f"; comm_quant: param_bytes {cb:g} (int8 + scales)"
                                if q.weights else "") + \
        (f"; reduce_bytes {rb_rs:g} in the reduce-scatter ({q.grads} + scales)"
         if q.grads and rb_rs != rb else "")
    v, f = _comm_bytes(units, c, n, world, cb, rb, rb_rs, psi, st, r)
    return v, f + f_q


def _comm_bytes(units, c, n, world, cb, rb, rb_rs, psi, st, r):
    if st == "NO_SHARD":
        return int(2 * r * psi * rb), "all-reduce gradients: 2*(N-1)/N*psi*reduce_bytes"
    if st == "SHARD_OPTIM" and c["layout"] == "zero":
        return int(r * psi * (rb_rs + cb)), ("reduce-scatter gradients + all-gather updated "
                                             "parameters: (N-1)/N*psi*(reduce_bytes+param_bytes)")
    if st == "SHARD_OPTIM":  # fsdp/zero1.py keeps whole gradients: an all-reduce
        return int(r * psi * (2 * rb + cb)), ("all-reduce gradients + all-gather updated "
                                              "parameters: (N-1)/N*psi*(2*reduce_bytes"
                                              "+param_bytes)")
    if st == "SHARD_GRAD_OP":
        return int(r * psi * (rb_rs + cb)), ("all-gather once (forward) + reduce-scatter: "
                                             "(N-1)/N*psi*(param_bytes+reduce_bytes)")
    root = units[-1].numel
    v = r * ((2 * (psi - root) + root) * cb + psi * rb_rs)
    f = ("all-gather twice (forward, backward; the root once) + reduce-scatter: "
         "(N-1)/N*((2*psi-root)*param_bytes + psi*reduce_bytes)")
    if st == "HYBRID_SHARD":
        reps = world // n
        v += 2 * (reps - 1) / reps * psi / n * rb
        f += " within the group + all-reduce of the shard across R=world/group groups: " \
             "2*(R-1)/R*psi/group*reduce_bytes"
    return int(v), f


def _quant_staging(units, q, world, st, reduce_bytes):
    """The bytes link_quant.c takes for the largest unit's quantized gather
    or reduction (both transient, never at once)."""
    wbits, gbits, block = q.engine_args
    best = 0
    for u in units:
        for g in u.groups:
            shard, padded = flat_layout(g.numels, g.elem_bytes, world)
            if wbits:
                best = max(best, padded * _quant_elem_bytes(8, block))
            if gbits and g.trainable and st not in ("NO_SHARD", "SHARD_OPTIM"):
                best = max(best, 2 * padded * _quant_elem_bytes(gbits, block) +
                           (0 if reduce_bytes == 4 else 4 * shard))
    return int(best)


def plan(model=None, *, params=None, world_size=1, strategy="FULL_SHARD", hybrid_group=None,
         mixed_precision=None, reduce_dtype=None, dtype=None, optimizer="adamw",
         layout="flatshard", offload_params=False, offload_optimizer=None, auto_wrap_policy=None,
         units=None, activation_checkpointing=False, batch_size=None, seq_len=None, hidden=None,
         layers=None, heads=None, vocab=None, flash_attention=False, backward_prefetch=True,
         forward_prefetch=False, comm_backend="shm", slot_bytes=None, disk_chunks=4,
         disk_chunk_bytes=64 << 20, runtime_bytes=None, activation_bytes=None,
         gather_ahead_bytes=None, keep_unsharded_storage=False,
         comm_quant=None, offload_pipeline=None, snapshots=False):
    """Per-rank memory of one configuration -> Plan (bytes, with formulas).

    model or params: an nn.Module (meta device fine; wrapped by
    auto_wrap_policy as flatshard would) or a parameter count (in `units`
    equal wrapped units; default `layers`, else the layer count of the
    published transformer nearest in size, which the plan's notes name:
    [Note: assumed units]). strategy: a
    ShardingStrategy (torch's or flatshard's) or its name, SHARD_OPTIM
    included; HYBRID_SHARD shards within groups of `hybrid_group` ranks.
    mixed_precision: MixedPrecision, a dtype or "bf16"/"fp16" (param_dtype).
    optimizer: adamw, adam, sgd_momentum, sgd. offload_params: torch FSDP1's
    CPUOffload(offload_params=True) (shards, gradients, optimizer on host).
    offload_optimizer: "cpu" (master + moments on host) or "disk" (on disk;
    the host holds disk_chunks staging chunks). batch_size/seq_len/hidden/
    layers[/heads/vocab]: per-rank activation estimate for a transformer.
    runtime_bytes: the process's resident bytes before the model is built,
    measured once (flatshard.memory.resident_bytes()); adds the runtime and
    the loss's buffers, and Plan.peak_rss becomes the predicted peak
    resident memory of a rank training on CPU. activation_bytes: the bytes
    autograd saves in one forward, measured (SavedActivations), in place of
    the transformer estimate. gather_ahead_bytes: bytes of units gathered
    ahead with a unit's all-gather (FLATSHARD_GATHER_AHEAD_BYTES); None: the
    backend's default (1 MiB on torch, 0 on shm). keep_unsharded_storage:
    fully_shard's set_keep_unsharded_storage(True) (torch 2.15): every
    unit's unsharded buffer stays allocated across reshard, so the gathered
    line is all of them at once.
    comm_quant: a
    flatshard.CommQuant: the communication per step with its payloads, and
    the staging its collectives take (docs/comm_quant.md).
    offload_pipeline: None,
    or the max_units_in_flight of flatshard.overlap_offload (with
    offload_params=True): the units whose steps are queued hold their
    gradient shards beside the next backward's.
    snapshots: flatshard.Snapshots every step: its segment in host shared
    memory, two slots of the rank's parameter shards and optimizer state.
    """
    c = _resolve(locals())
    if model is not None:
        unit_list = units_from_model(model, auto_wrap_policy)
    else:
        unit_list = units_from_count(params, c["units"], c["dtype_bytes"])
    return _plan(unit_list, c)


def _name(value):
    return getattr(value, "name", value)


# [Note: assumed units] A bare parameter count says nothing of how the model
# is wrapped, and ZeRO-3's gathered peak is the largest units' size: planned
# as one unit, 7e9 parameters would gather all of them at once, and ZeRO-3
# would show no saving over ZeRO-2. A transformer is wrapped one unit per
# layer, so without layers= or units= the count is split as the published
# model nearest in size is (units.py TYPICAL_LAYERS), and a note says so.


def _resolve(kw):
    c = dict(kw)
    if (c["model"] is None) == (c["params"] is None):
        raise bad_value("params", c["params"], "give exactly one of model= and params=",
                        "plan(model=...) for a module, plan(params=7e9) for a count")
    p = c["params"]
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or p < 1
                          or p != int(p)):
        raise bad_value("params", p, "expected a whole positive number of parameters")
    w = c["world_size"]
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise bad_value("world_size", w, "expected a positive int")
    st = _name(c["strategy"])
    if st not in STRATEGIES:
        raise bad_value("strategy", c["strategy"], "expected one of " + ", ".join(STRATEGIES)
                        + " (a ShardingStrategy or its name)")
    c["strategy"] = st
    if st == "HYBRID_SHARD":
        g = c["hybrid_group"]
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or w % g:
            raise bad_value("hybrid_group", g, f"HYBRID_SHARD needs a group size that divides "
                            f"world_size={w}", "e.g. hybrid_group=8 for 8 GPUs per node")
    mp = c["mixed_precision"]
    if mp is not None and hasattr(mp, "param_dtype"):
        c["reduce_dtype"] = c["reduce_dtype"] or mp.reduce_dtype
        mp = mp.param_dtype
    c["param_bytes"] = _dtype_bytes("mixed_precision", mp)
    c["reduce_bytes"] = _dtype_bytes("reduce_dtype", c["reduce_dtype"])
    c["dtype_bytes"] = _dtype_bytes("dtype", c["dtype"]) or 4
    if c["optimizer"] not in OPTIMIZERS:
        raise bad_value("optimizer", c["optimizer"], "expected one of " + ", ".join(OPTIMIZERS))
    if c["layout"] not in LAYOUTS:
        raise bad_value("layout", c["layout"], "expected 'flatshard' or 'zero'")
    if c["offload_optimizer"] not in OFFLOADS:
        raise bad_value("offload_optimizer", c["offload_optimizer"], "expected None, 'cpu' "
                        "or 'disk'")
    if c["comm_backend"] not in BACKENDS:
        raise bad_value("comm_backend", c["comm_backend"], "expected " + ", ".join(BACKENDS))
    if not isinstance(c["snapshots"], bool):
        raise bad_value("snapshots", c["snapshots"], "expected True or False")
    op = c["offload_pipeline"]
    if op is not None and (isinstance(op, bool) or not isinstance(op, int) or op < 1 or
                           not c["offload_params"]):
        raise bad_value("offload_pipeline", op, "expected None, or the units in flight (an "
                        "int >= 1) of overlap_offload, with offload_params=True")
    if c["offload_params"] and c["offload_optimizer"]:
        raise bad_value("offload_optimizer", c["offload_optimizer"], "offload_params=True "
                        "already puts the optimizer state on the host", "give one of them")
    for k in ("units", "batch_size", "seq_len", "hidden", "layers", "heads", "vocab",
              "slot_bytes", "disk_chunks", "disk_chunk_bytes", "runtime_bytes",
              "activation_bytes"):
        v = c[k]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise bad_value(k, v, "expected a positive int or None")
    b = c["gather_ahead_bytes"]
    if b is None:
        b = DEFAULT_AHEAD.get(c["comm_backend"], 0)
    elif isinstance(b, bool) or not isinstance(b, int) or b < 0:
        raise bad_value("gather_ahead_bytes", b, "expected a whole number of bytes >= 0 or "
                        "None (the backend's default)")
    c["gather_ahead_bytes"] = b
    c["units_assumed"] = None
    if c["params"] is not None and c["units"] is None and c["layers"] is None:
        c["units"], ref = typical_layers(c["params"])  # [Note: assumed units]
        c["units_assumed"] = (f"assumed {c['units']} equal units, one per layer of a "
                              f"transformer of about this size ({ref}); give layers= "
                              "(--layers) or units= for your model")
    if not isinstance(c["keep_unsharded_storage"], bool):
        raise bad_value("keep_unsharded_storage", c["keep_unsharded_storage"],
                        "expected True or False")
    q = normalize_comm_quant("comm_quant", c["comm_quant"])
    c["comm_quant"] = q if q is not None and (q.weights or q.grads) else None
    c["units"] = c["units"] or c["layers"] or 1
    c["slot_bytes"] = c["slot_bytes"] or DEFAULT_SLOT_BYTES
    c["hybrid_group"] = c["hybrid_group"] if st == "HYBRID_SHARD" else None
    return c


def _plan(units, c):
    w, st, zero = c["world_size"], c["strategy"], c["layout"] == "zero"
    n = c["hybrid_group"] or w          # ranks one copy is sharded over
    mp = c["param_bytes"]
    notes = [c["units_assumed"]] if c.get("units_assumed") else []
    # One rank has nothing to shard: flatshard runs it as NO_SHARD (no gather)
    # unless mixed precision needs the cast copy all the same.
    if n == 1 and st != "NO_SHARD" and not (mp and not zero):
        notes.append("one rank: runs as NO_SHARD")
        st = "NO_SHARD"
    # flatshard's ZeRO-1 (fsdp/zero1.py) keeps a shard, the whole buffer gathered
    # for good, and the whole gradient (the shard's .grad is a view of it).
    zero1 = st == "SHARD_OPTIM" and not zero
    shard_p = n if st in ("FULL_SHARD", "HYBRID_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIM") else 1
    if zero:
        shard_p = n if st in ("FULL_SHARD", "HYBRID_SHARD") else 1
    shard_g = 1 if st in ("NO_SHARD", "SHARD_OPTIM") else n
    shard_o = 1 if st == "NO_SHARD" else n
    moments, step_bytes = OPTIMIZERS[c["optimizer"]]
    lines = []

    def elem(g, lp):
        return (mp if lp and mp and g.floating else None) or g.elem_bytes

    def add(key, label, nbytes, where, formula):
        lines.append(Line(key, label, int(nbytes), where, formula))

    train = [g for u in units for g in u.groups if g.trainable]
    allg = [g for u in units for g in u.groups]
    psi = sum(g.numel for g in allg)
    if zero:
        # The paper's arithmetic: no padding; param_dtype copies, fp32 master.
        pb = mp or c["dtype_bytes"]
        ptrain = sum(g.numel for g in train)
        master = 4 if mp and mp < 4 else 0
        div = {1: "", n: f"/{n}"}
        add("params", "parameters", psi * pb / shard_p, "device",
            f"psi*{pb}{div[shard_p]} (param_dtype copy)")
        add("grads", "gradients", ptrain * pb / shard_g, "device", f"psi*{pb}{div[shard_g]}")
        add("master", "fp32 master copy", ptrain * master / shard_o, "device",
            f"psi*{master}{div[shard_o]}" if master else "none: no mixed precision")
        add("moments", "optimizer moments", ptrain * 4 * moments / shard_o, "device",
            f"psi*{4 * moments}{div[shard_o]} ({c['optimizer']}: {moments} fp32 buffers)")
    else:
        def held(groups, world, per_elem, extra=0, whole=False):
            return sum(flat_layout(g.numels, g.elem_bytes, world)[whole] * per_elem(g) + extra
                       for g in groups)
        pad = "shard_numel = round_up(ceil(padded/N), 16 bytes), each parameter 16-byte aligned"
        add("params", "parameters (persistent shard)", held(allg, shard_p, lambda g: g.elem_bytes),
            "device", f"sum over flat buffers of shard_numel(N={shard_p})*dtype bytes; {pad}"
            + ("; the shard is also the fp32 master" if mp else ""))
        if zero1:
            add("grads", "gradients (whole)", held(train, n, lambda g: g.elem_bytes, whole=True),
                "device", f"trainable buffers: padded_numel(N={n})*dtype bytes: the whole "
                "all-reduced gradient (the shard's .grad is a view of it)")
        else:
            add("grads", "gradients (shard)", held(train, shard_g, lambda g: g.elem_bytes),
                "device", f"trainable buffers: shard_numel(N={shard_g})*dtype bytes "
                "(kept in the shard's dtype)")
        add("master", "fp32 master copy", 0, "device",
            "none: the persistent shard keeps the parameters' own dtype and is the master")
        add("moments", "optimizer moments", held(train, shard_o, lambda g: g.elem_bytes * moments),
            "device", f"trainable buffers: {moments} x shard_numel(N={shard_o})*dtype bytes"
            f" ({c['optimizer']})")
        if step_bytes:  # stays in memory under disk offload
            add("optim_steps", "optimizer step counters", len(train) * step_bytes, "device",
                f"a {step_bytes}-byte step tensor per trainable buffer")
    # Gathered compute copies. A param_dtype copy exists only where the cast
    # changes the buffer (fsdp/flat_param.py's FlatGroup: floating, another dtype).
    def lp(g):
        return mp if mp and g.floating and mp != g.elem_bytes else 0
    prefetch = c["backward_prefetch"] or c["forward_prefetch"]
    if zero1:
        gb, _ = _gathered_units(units, lambda g: lp(g) or g.elem_bytes, st, n, 0)
        gf = ("every unit's whole buffer, padded_numel*dtype bytes, gathered for good"
              + (" (in param_dtype: the shard is the fp32 master)" if mp else ""))
    elif shard_p > 1 and c["keep_unsharded_storage"]:
        gb, _ = _gathered_units(units, lambda g: elem(g, True), "SHARD_GRAD_OP", shard_p, 0)
        gf = ("every unit's unsharded buffer, padded, kept across reshard "
              "(set_keep_unsharded_storage)")
    elif shard_p > 1:
        gb, gf = _gathered_units(units, lambda g: elem(g, True), st, shard_p, prefetch,
                                 c["gather_ahead_bytes"] if c["comm_backend"] != "nccl" else 0)
    elif zero or not any(lp(g) for g in allg):
        gb, gf = 0, "none: the parameters are whole on every rank"
    elif st == "NO_SHARD":
        gb, _ = _gathered_units(units, lp, "SHARD_GRAD_OP", 1, 0)
        gf = "a param_dtype copy of every unit, live from forward to the end of backward"
    else:  # one rank, mixed precision: units are cast (not gathered) one at a time
        gb, gf = _gathered_units(units, lp, st, 1, prefetch)
        gf = "param_dtype copies: " + gf
    add("params_gathered", "gathered units (peak)", gb, "device", gf)
    per_unit = sorted(sum(flat_layout(g.numels, g.elem_bytes, shard_p)[1] *
                          (elem(g, True) + (c["reduce_bytes"] or 0))
                          for g in u.groups if g.trainable) for u in units)
    # On a device the reductions are deferred with one in flight: the unit
    # before keeps its buffers while the next one's gradient is made.
    in_flight = c["comm_backend"] == "nccl" and len(per_unit) > 1
    ub = sum(per_unit[-2:]) if in_flight else (per_unit[-1] if per_unit else 0)
    if zero:
        add("grad_unreduced", "unreduced gradient (peak)", 0, "device",
            "not counted: the paper's model-state accounting (reduced in small buckets)")
    else:
        add("grad_unreduced", "unreduced gradient (peak)", ub, "device",
            "estimate: the " + ("two largest units' (one reduction in flight on a device)"
                                if in_flight else "largest unit's")
            + " full gradient in param_dtype"
            + (" + its reduce_dtype copy" if c["reduce_bytes"] else "") + " before reduction")
    q = c["comm_quant"]
    if q is not None and shard_p > 1 and not zero:
        add("comm_quant", "quantized comm staging (peak)",
            _quant_staging(units, q, shard_p, st, c["reduce_bytes"] or mp or c["dtype_bytes"]),
            "device", "transient, one collective at a time: a gather's world payloads of "
            "int8 + 4/block scale bytes per value over the unit's padded buffer, or a "
            "reduction's sent and received payloads (2 x padded x (bits/8 + 4/block)) and its "
            "float32 sum of the shard (4 x shard, unless it reduces in float32): the "
            "largest unit's larger one")
    else:
        add("comm_buffers", "communication buffers", 0, "device",
            f"not counted: the {c['comm_backend']} backend's own buffers")
    ab, af = _activations(dict(c, act_bytes=mp or c["dtype_bytes"]))
    add("activations", "activations", ab, "device", af)
    if c["runtime_bytes"]:
        # [Note: resident prediction] The process's peak resident memory on
        # CPU: everything above is host memory there, at its peak together
        # only at the start of backward, where the gradients are not made
        # yet but the loss's buffers are; the two cancel to within the
        # estimate's error for transformer training (tests/test_plan_rss.py).
        add("runtime", "runtime (measured)", c["runtime_bytes"], "host",
            "measured once: the process's resident bytes before the model is built (Python, "
            "torch, imported libraries, the process group)")
        if c["vocab"] and c["batch_size"] and c["seq_len"]:
            s_, b_, v_ = c["seq_len"], c["batch_size"], c["vocab"]
            add("loss_buffers", "loss backward over the vocabulary", 2 * 4 * s_ * b_ * v_,
                "device", "estimate: the gradients of the loss's log-softmax and of the "
                "logits, fp32, made at the start of backward: 2*4*s*b*V")
    # Offload: move the lines to the host (or disk).
    moved = ()
    if c["offload_params"]:
        moved = ("params", "grads", "master", "moments", "optim_steps")
    elif c["offload_optimizer"]:
        moved = ("master", "moments", "optim_steps")
    for ln in lines:
        if ln.key in moved:
            # On disk: the buffers; the step counters stay in host memory.
            disk = c["offload_optimizer"] == "disk" and ln.key != "optim_steps"
            ln.where = "disk" if disk else "host"
            ln.label += f" [{ln.where}]"
    if c["offload_pipeline"]:
        k = c["offload_pipeline"]
        unit_grads = sorted(sum(flat_layout(g.numels, g.elem_bytes, shard_g)[0] * g.elem_bytes
                                for g in u.groups if g.trainable) for u in units)
        add("offload_in_flight", "gradients of queued steps [host]", sum(unit_grads[-k:]),
            "host", f"the {k} largest units' gradient shards (shard_numel(N={shard_g})*dtype "
            "bytes): a unit's queued step reads its gradient until it has run, beside the "
            "next backward's (overlap_offload; nothing more on the device)")
    if c["snapshots"]:
        held_bytes = sum(ln.bytes for ln in lines
                         if ln.key in ("params", "master", "moments", "optim_steps"))
        add("snapshots", "snapshots, two slots [host shm]", 2 * held_bytes, "host",
            "2 x (parameter shard + fp32 master + optimizer moments + step counters): "
            "flatshard.Snapshots' segment in /dev/shm, one step in each slot")
    if c["offload_optimizer"] == "disk":
        add("disk_staging", "disk staging chunks", c["disk_chunks"] * c["disk_chunk_bytes"],
            "host", "disk_chunks*disk_chunk_bytes: the host stages optimizer state in chunks")
    comm, cf = _comm(units, dict(c, strategy=st), n, w, mp or c["dtype_bytes"],
                     c["reduce_bytes"] or mp or c["dtype_bytes"])
    # Host<->device bytes per step: each parameter shard comes in (or the
    # updated parameters, optimizer offload) and each gradient shard goes out.
    transfer = sum(ln.bytes for ln in lines if ln.key in ("params", "grads")) if moved else 0
    config = {k: c[k] for k in ("world_size", "hybrid_group", "optimizer", "layout",
                                "offload_params", "offload_optimizer", "offload_pipeline",
                                "activation_checkpointing",
                                "batch_size", "seq_len", "comm_backend")}
    config.update(strategy=c["strategy"], effective_strategy=st, params=psi,
                  units=sum(1 for u in units if u.numel),  # the units that hold parameters
                  comm_quant=c["comm_quant"],
                  param_bytes=mp, reduce_bytes=c["reduce_bytes"],
                  k_bytes=(4 if zero and mp and mp < 4 else 0) + 4 * moments)
    return Plan(config, lines, comm, cf, int(transfer), notes)
