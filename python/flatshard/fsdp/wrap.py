"""Auto-wrap policies: which submodules become their own units.

Accepted policy objects:
  * torch's policy classes (ModuleWrapPolicy, CustomPolicy) and flatshard's
    below: anything with torch's `_run_policy(root, ignored_modules,
    root_kwargs) -> {module: kwargs}` protocol;
  * torch's functional policies (functools.partial of
    transformer_auto_wrap_policy, size_based_auto_wrap_policy,
    lambda_auto_wrap_policy, or any `fn(module, recurse, nonwrapped_numel)`),
    walked with torch's recursive rule.
`targets()` turns either into one dict of target module -> kwarg overrides.
"""
from typing import Any, Callable, Dict, Iterable, Set

import torch.nn as nn

from ..errors import bad_type, not_built


class ModuleWrapPolicy:
    """Wrap every module that is an instance of one of `module_classes`."""

    def __init__(self, module_classes: Iterable[type]):
        self._module_classes = set(module_classes)

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        classes = tuple(self._module_classes)
        return {m: {} for m in root_module.modules()
                if m not in ignored_modules and isinstance(m, classes)}

    def __call__(self, module, recurse, *args, **kwargs):
        return True if recurse else isinstance(module, tuple(self._module_classes))

    def __repr__(self):
        return f"ModuleWrapPolicy({self._module_classes})"


class CustomPolicy:
    """`lambda_fn(module)` returns False (not a unit), True (a unit with the
    root's options) or a dict of options overriding the root's for that unit."""

    def __init__(self, lambda_fn: Callable[[nn.Module], Any]):
        self._lambda_fn = lambda_fn

    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        out = {}
        for m in root_module.modules():
            if m in ignored_modules:
                continue
            res = self._lambda_fn(m)
            if not isinstance(res, (bool, dict)):
                raise bad_type("auto_wrap_policy (CustomPolicy lambda_fn result)", res,
                               "True, False or a dict of FSDP keyword overrides")
            if res:
                out[m] = res if isinstance(res, dict) else {}
        return out


_POLICY_ARGS = """
    Called by the wrapper (bind the policy's own arguments with
    functools.partial): `module` is the candidate submodule; with
    `recurse=True` the question is whether to look inside it, with
    `recurse=False` whether it becomes a unit; `nonwrapped_numel` counts its
    parameters not already in a unit below it."""


def transformer_auto_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls):
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


transformer_auto_wrap_policy.__doc__ = """torch's transformer_auto_wrap_policy: every
    module that is an instance of a class in `transformer_layer_cls` (a set of
    classes) becomes a unit.""" + _POLICY_ARGS


def size_based_auto_wrap_policy(module, recurse, nonwrapped_numel, min_num_params=int(1e8),
                                force_leaf_modules=None, exclude_wrap_modules=None):
    force_leaf = set(force_leaf_modules or (nn.MultiheadAttention,))
    exclude = set(exclude_wrap_modules or (nn.ModuleList, nn.ModuleDict))
    if recurse:
        return not isinstance(module, tuple(force_leaf))
    return nonwrapped_numel >= min_num_params and not isinstance(module, tuple(exclude))


size_based_auto_wrap_policy.__doc__ = """torch's size_based_auto_wrap_policy: a module
    becomes a unit when at least `min_num_params` of its parameters are not in
    a unit yet; never looks inside `force_leaf_modules` (default:
    nn.MultiheadAttention) and never wraps `exclude_wrap_modules` themselves
    (default: nn.ModuleList, nn.ModuleDict).""" + _POLICY_ARGS


def lambda_auto_wrap_policy(module, recurse, nonwrapped_numel, lambda_fn):
    return True if recurse else bool(lambda_fn(module))


lambda_auto_wrap_policy.__doc__ = """torch's lambda_auto_wrap_policy: a module becomes a
    unit when `lambda_fn(module)` is true.""" + _POLICY_ARGS


def _walk(module, fn, ignored_modules, ignored_params, out, is_root):
    """torch FSDP1's recursive rule: ask fn(recurse=True) whether to descend,
    wrap children first, then ask fn(recurse=False) with the numel left
    unwrapped. Returns the numel this subtree put into units."""
    numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not fn(module=module, recurse=True, nonwrapped_numel=numel):
        return 0
    wrapped = 0
    for child in module.children():
        if child not in ignored_modules:
            wrapped += _walk(child, fn, ignored_modules, ignored_params, out, False)
    if not is_root and fn(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
        out[module] = {}
        return numel
    return wrapped


def targets(policy, root: nn.Module, ignored_modules: Set[nn.Module], ignored_params,
            root_kwargs: Dict[str, Any]) -> Dict[nn.Module, Dict[str, Any]]:
    """Target modules (never the root) -> keyword overrides for their unit."""
    if hasattr(policy, "_run_policy"):
        out = dict(policy._run_policy(root, set(ignored_modules), dict(root_kwargs)))
        # torch's policies return full kwargs; keep only what differs.
        for m, kw in out.items():
            out[m] = {k: v for k, v in (kw or {}).items()
                      if k not in root_kwargs or root_kwargs[k] is not v}
    elif callable(policy):
        out = {}
        _walk(root, policy, set(ignored_modules), ignored_params, out, True)
    else:
        raise bad_type("auto_wrap_policy", policy,
                       "a policy object (ModuleWrapPolicy, CustomPolicy, torch's or flatshard's) "
                       "or a callable fn(module, recurse, nonwrapped_numel)")
    out.pop(root, None)
    _check_full_precision_classes(root, ignored_modules, root_kwargs.get("mixed_precision"))
    return out


def _check_full_precision_classes(root, ignored_modules, mp):
    """torch, under an auto_wrap_policy with mixed precision, wraps the
    modules of mp._module_classes_to_ignore (batch norms by default) on
    their own and runs them in full precision; flatshard does not build
    that, so a model holding one is refused rather than run otherwise."""
    classes = tuple(getattr(mp, "_module_classes_to_ignore", None) or ())
    if not classes or not all(isinstance(c, type) for c in classes):
        return  # none, or a bad value: refused with the other mixed_precision checks
    found = sorted({type(m).__name__ for m in root.modules()
                    if m not in ignored_modules and isinstance(m, classes)})
    if found:
        raise not_built("mixed_precision._module_classes_to_ignore", classes,
                        f"torch wraps the model's {', '.join(found)} modules on their own and "
                        "runs them in full precision under an auto_wrap_policy, which "
                        "flatshard does not build", "pass MixedPrecision(..., "
                        "_module_classes_to_ignore=()) to run them in param_dtype with their "
                        "unit")
