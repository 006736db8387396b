"""What FullyShardedDataParallel's constructor decides before it builds
anything: the units, and for each its module, its options and its
parameters. Runs once per constructor call, on each rank alone: no
collective, no FSDP instance.

  checked_arguments  the arguments config.resolve does not check (the
                     policy, param_init_fn, the ignored modules against the
                     module), refused at once on the rank that passes them
  plan_units         runs auto_wrap_policy (wrap.py) and param_init_fn on
                     the module, resolves each unit's options (a policy may
                     override them per unit) and collects its parameters:
                     -> [UnitPlan], innermost first, the root last, and the
                     lines the ranks compare before building
                     (runtime/consistency.py)

The wrapper (api.py) has the ranks agree on the plan, then builds one unit
per UnitPlan. Modules wrapped already are told by their `_unit`
(unit.unit_of), so nothing here imports the wrapper class.
"""
import collections

import torch
import torch.nn as nn

from ..errors import ConfigError, ConfigTypeError, bad_type, bad_value
from ..tensors import DTYPE_CODES, check_plain
from . import config
from .flat_param import Alias
from .unit import unit_of
from .wrap import targets


def _is_wrapped(m):
    """Whether `m` is an FSDP module already (built by an earlier wrap);
    anything else, a module or not (an ignored_states entry), is not."""
    return isinstance(m, nn.Module) and unit_of(m) is not None


class UnitPlan:
    """One unit to build: its module, options and parameters, grouped by
    (dtype, requires_grad) as [(key, [(param, [Alias, ...]), ...]), ...]."""

    def __init__(self, module, name, cfg, groups):
        self.module, self.name, self.cfg, self.groups = module, name, cfg, groups
        self.label = name or "<root>"

    def describe(self):
        """Lines every rank must agree on (runtime/consistency.py)."""
        c = self.cfg
        lines = [f"unit {self.label!r}: {c.strategy.name} use_orig_params={c.use_orig_params} "
                 f"backward_prefetch={c.backward_prefetch and c.backward_prefetch.name} "
                 f"forward_prefetch={c.forward_prefetch} "
                 f"limit_all_gathers={c.limit_all_gathers} comm_backend={c.comm_backend} "
                 f"mixed_precision={c.mixed_precision}" +
                 (" offload_params=True" if c.offload_params else "")]
        for (dtype, requires_grad), order in self.groups:
            for p, aliases in order:
                lines.append(f"  {'='.join(a.fqn for a in aliases)} {tuple(p.shape)} "
                             f"{str(dtype).replace('torch.', '')} "
                             f"{'trainable' if requires_grad else 'frozen'}")
        return lines


class WrapContext:
    """What all units built by one constructor call share."""

    def __init__(self, ignored_modules, ignored_params):
        self.ignored_modules = ignored_modules
        self.ignored_params = ignored_params
        self.owner = {}  # id(param) -> (unit name, fqn) of the unit managing it


def checked_arguments(module, auto_wrap_policy, param_init_fn, sync_module_states,
                      ignored_modules, ignored_states):
    """The arguments config.resolve does not check, checked on this rank alone
    (their types, and the ignored modules against the module): a bad one is
    refused at once, on every rank that passes it, before the ranks agree.
    A rank that raises in the agreement waits for the others to hear it
    (consistency._leave), and a rank-dependent code path may leave them
    never calling. -> (the policy to run, WrapContext)."""
    if not isinstance(sync_module_states, bool):
        raise bad_type("sync_module_states", sync_module_states, "True or False")
    config.check_param_init_fn(param_init_fn)
    policy = config.checked_policy(auto_wrap_policy)
    ignored_mods, ignored_params = _expand_ignored(module, ignored_modules, ignored_states)
    return policy, WrapContext(ignored_mods, ignored_params)


def plan_units(module, cfg, kw, policy, param_init_fn, sync_module_states, ctx):
    """Decide every unit from the checked arguments, with no collective: run
    the policy and param_init_fn, check the parameters. -> ([UnitPlan,
    innermost first, the root last], WrapContext) and the description the
    ranks compare."""
    ignored_mods, ignored_params = ctx.ignored_modules, ctx.ignored_params
    # The policy sees the modules before they are materialized, as torch's does.
    found = _policy_targets(policy, module, kw, ctx) if policy is not None else {}
    wrapped = {m for m in module.modules() if _is_wrapped(m)}
    _materialize(module, param_init_fn, ignored_mods, ignored_params, set(found) | wrapped,
                 cfg.device)
    for n, p in module.named_parameters():
        if p in ignored_params:
            continue
        check_plain(p, f"parameter {n}", "FullyShardedDataParallel")
        if p.device != cfg.device:
            raise bad_value("device_id", cfg.device, f"parameter {n} is on {p.device}",
                            f"move the module to {cfg.device} before wrapping")
    names = {m: n for n, m in module.named_modules()}
    units = [m for m in found if not _is_wrapped(m)]
    unit_set, plan = set(units), []
    # Innermost first: a parent's unit excludes the units below it. (A stable
    # sort of the policy's order: the same on every rank.)
    for m in sorted(units, key=lambda m: -names[m].count(".")):
        cfg_m = config.resolve_override(names[m], kw, found[m])
        plan.append(UnitPlan(m, names[m], cfg_m, _collect(m, names[m], ctx, unit_set)))
    plan.append(UnitPlan(module, "", cfg, _collect(module, "", ctx, unit_set)))
    lines = [f"options: sync_module_states={sync_module_states}"]
    if sync_module_states:  # buffers are broadcast too
        for n, b in module.named_buffers():
            check_plain(b, f"buffer {n}", "FullyShardedDataParallel(sync_module_states=True)")
        lines += [f"  buffer {n} {tuple(b.shape)} {str(b.dtype).replace('torch.', '')}"
                  for n, b in module.named_buffers()]
    for up in plan:
        lines += up.describe()
    return (plan, ctx), lines


def _expand_ignored(module, ignored_modules, ignored_states):
    """ignored_modules or ignored_states, checked against `module` -> (the
    modules left out, every one below them included; the parameters left out)."""
    if ignored_modules is not None and ignored_states is not None:
        raise bad_value("ignored_states", ignored_states, "ignored_modules and ignored_states "
                        "cannot both be given", "pass everything in ignored_states")
    mods, params = set(), set()
    items = ignored_modules if ignored_modules is not None else ignored_states
    name = "ignored_modules" if ignored_modules is not None else "ignored_states"
    if items is None:
        return mods, params
    allowed = "an iterable of nn.Module" + (" or nn.Parameter" if name == "ignored_states" else "")
    if isinstance(items, (nn.Module, str)):  # a Sequential or a str would iterate silently
        raise bad_type(name, items, allowed, "pass a list, e.g. [model.head]")
    try:
        items = list(items)
    except TypeError:
        raise bad_type(name, items, allowed) from None
    inside_mods, inside_params = set(module.modules()), set(module.parameters())
    for it in items:
        if _is_wrapped(it):
            raise bad_value(name, it, "an FSDP-wrapped module cannot be ignored")
        if it is module:
            raise bad_value(name, type(it).__name__, "it is the module being wrapped, so nothing "
                            "would be sharded", "to keep the whole model unsharded, do not wrap "
                            "it with FSDP")
        if isinstance(it, nn.Module):
            if it not in inside_mods:
                raise bad_value(name, it, "it is not a submodule of the module being wrapped",
                                "list submodules of the wrapped model only")
            mods.update(it.modules())
        elif isinstance(it, nn.Parameter) and name == "ignored_states":
            if it not in inside_params:
                raise bad_value(name, f"<Parameter of shape {tuple(it.shape)}>", "it is not a "
                                "parameter of the module being wrapped",
                                "list the wrapped model's own parameters only")
            params.add(it)
        else:
            raise bad_type(name, it, allowed)
    for m in mods:
        params.update(m.parameters(recurse=False))
    return mods, params


def _policy_targets(policy, module, kw, ctx):
    """auto_wrap_policy's targets -> {module: overrides}; the policy's own
    errors are configuration errors that name it."""
    try:
        return targets(policy, module, ctx.ignored_modules, ctx.ignored_params, kw)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"flatshard: auto_wrap_policy={policy!r} raised {type(e).__name__}: "
                          f"{e}; fix the policy (it is called on every submodule)") from e


def _has_meta(m):
    return any(t.is_meta for t in list(m.parameters(recurse=False)) +
               list(m.buffers(recurse=False)))


def _post_order(module, units):
    """The units under `module`, children before parents and siblings in
    registration order: the order torch's auto-wrap builds them in."""
    out, seen = [], set()

    def visit(m):
        for child in m.children():
            if id(child) not in seen:
                seen.add(id(child))
                visit(child)
                if child in units:
                    out.append(child)
    visit(module)
    return out


def _own_modules(root, stop):
    """`root` and the modules below it that belong to its unit, breadth-first,
    not entering a module in `stop` (other units, ignored modules)."""
    out, queue, seen = [], collections.deque([root]), {id(root)}
    while queue:
        m = queue.popleft()
        out.append(m)
        for child in m.children():
            if id(child) not in seen and child not in stop:
                seen.add(id(child))
                queue.append(child)
    return out


def _reset_on(device, names):
    """What materializes a module when param_init_fn is None, as torch's FSDP
    does: its own tensors moved to empty storage on `device`, then its own
    reset_parameters(). names: module -> its name, for the error."""
    def reset(m):
        if not (list(m.parameters(recurse=False)) or list(m.buffers(recurse=False))):
            return
        if not callable(getattr(m, "reset_parameters", None)):
            raise bad_value("param_init_fn", None, f"module {names.get(m) or '<root>'} "
                            f"({type(m).__name__}) is on the meta device and has no "
                            "reset_parameters() to initialize it",
                            "give it a reset_parameters() method, or pass param_init_fn="
                            "lambda m: m.to_empty(device='cpu', recurse=False) followed by "
                            "your initialization")
        with torch.no_grad():
            m.to_empty(device=device, recurse=False)
            m.reset_parameters()
    return reset


def _materialize(module, param_init_fn, ignored_modules, ignored_params, units, device):
    """Meta-device modules materialized unit by unit as torch's FSDP does,
    so that the same seed gives the same weights: the units in the order
    its auto-wrap builds them (children first, then the root), and in each
    unit that has a parameter or buffer on the meta device every module of
    the unit, breadth-first, handed to param_init_fn (all of them, as torch
    does), or with param_init_fn None reset where it holds tensors of its
    own (to_empty on the wrapper's device, then reset_parameters())."""
    names = {m: n for n, m in module.named_modules()}
    init = param_init_fn if param_init_fn is not None else _reset_on(device, names)
    for root in _post_order(module, units) + [module]:
        # torch's test: a parameter it manages, or any buffer not ignored, on meta
        if any(p.is_meta for p in root.parameters() if p not in ignored_params) or \
                any(b.is_meta for m in root.modules() if m not in ignored_modules
                    for b in m.buffers(recurse=False)):
            for m in _own_modules(root, (units - {root}) | ignored_modules):
                init(m)
    left = [n for n, m in module.named_modules() if m not in ignored_modules and _has_meta(m)]
    if left:
        raise bad_value("param_init_fn", param_init_fn, "it left parameters on the meta device "
                        f"in {left[:3]}", "make it materialize every module it is given")


def _collect(module, name, ctx, units):
    """The parameters a unit rooted at `module` manages: not in a module that
    is (or will be) a unit of its own, not ignored. Errors name the parameter."""
    label = name or "<root>"
    keys, by_key = [], {}
    stack = [(module, name)]
    while stack:
        mod, path = stack.pop(0)
        for attr, p in mod._parameters.items():
            if p is None or p in ctx.ignored_params:
                continue
            fqn = f"{path}.{attr}" if path else attr
            prev = ctx.owner.get(id(p))
            if prev is not None and prev[0] != label:
                raise ConfigError(
                    f"flatshard: parameter {fqn} is shared with {prev[1]}, which belongs to "
                    f"unit {prev[0]!r}, but it is also used in unit {label!r}; a shared "
                    "parameter must live in one unit: wrap a common parent of both modules "
                    "instead (change auto_wrap_policy)")
            if p.dtype not in DTYPE_CODES:
                raise ConfigTypeError(
                    f"flatshard: module has parameter {fqn} of dtype {p.dtype}, which cannot be "
                    f"sharded; allowed: {', '.join(str(d) for d in DTYPE_CODES)}. Convert it, "
                    "or list it in ignored_states to keep it whole on every rank")
            ctx.owner[id(p)] = (label, fqn)
            key = (p.dtype, p.requires_grad)
            if key not in by_key:
                by_key[key] = ({}, [])
                keys.append(key)
            seen, order = by_key[key]
            if id(p) not in seen:
                seen[id(p)] = len(order)
                order.append((p, []))
            order[seen[id(p)]][1].append(Alias(mod, attr, fqn))
        for cname, child in mod._modules.items():
            if child is None or child in ctx.ignored_modules or child in units or \
                    _is_wrapped(child):
                continue
            stack.append((child, f"{path}.{cname}" if path else cname))
    return [(k, by_key[k][1]) for k in keys]
