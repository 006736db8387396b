"""The planner's view of a model: its units (what flatshard would wrap
together) and their flat buffers, read from shapes and dtypes only, so a
model on the meta device costs nothing. Sizes of the flat buffers come from
the C layout code that lays out the real ones."""
import math
from dataclasses import dataclass

import torch.nn as nn

from .. import _C
from ..errors import bad_type
from ..fsdp.wrap import targets


def flat_layout(numels, elem_bytes, shard_world):
    """(shard_numel, padded_numel) of one flat buffer, from the C layout code
    that builds the real ones (csrc/core/layout.c): each parameter starts on a
    16-byte boundary, the shard is ceil(total / world) rounded up to 16 bytes,
    padded = shard * world."""
    align = _C.align_numel(elem_bytes)
    layout, _ = _C.layout_flat([int(n) for n in numels], shard_world, 0, align)
    return layout.shard_numel, layout.padded_numel


@dataclass
class Group:
    """One flat buffer of a unit: parameters sharing (dtype, requires_grad)."""
    numels: list
    elem_bytes: int
    trainable: bool
    floating: bool = True

    @property
    def numel(self):
        return sum(self.numels)


@dataclass
class Unit:
    name: str
    groups: list

    @property
    def numel(self):
        return sum(g.numel for g in self.groups)


def units_from_model(model, auto_wrap_policy=None):
    """The units flatshard would build for `model` (fsdp/api.py _collect's rules:
    the policy's targets innermost first, then the root; each unit's own
    parameters grouped by (dtype, requires_grad); a tied parameter counted
    once). Works on the meta device: only shapes and dtypes are read."""
    if not isinstance(model, nn.Module):
        raise bad_type("model", model, "an nn.Module (built on the meta device is fine)")
    found = targets(auto_wrap_policy, model, set(), set(), {}) if auto_wrap_policy else {}
    names = {m: n for n, m in model.named_modules()}
    inner = sorted(found, key=lambda m: -names[m].count("."))
    skip, seen, units = set(inner), set(), []
    for root in inner + [model]:
        keys, by_key, stack = [], {}, [root]
        while stack:
            mod = stack.pop(0)
            for p in mod._parameters.values():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                key = (p.element_size(), p.requires_grad, p.is_floating_point())
                if key not in by_key:
                    by_key[key] = []
                    keys.append(key)
                by_key[key].append(p.numel())
            stack += [c for c in mod._modules.values() if c is not None and c not in skip]
        units.append(Unit(names[root] or "<root>", [Group(by_key[k], *k) for k in keys]))
    return units


# Layer counts of published decoder-only transformers, by parameter count:
# GPT-3's family (Brown et al. 2020, Table 2.1) and Llama's (Touvron et al.
# 2023; Llama 3.1). A count given without its layers is planned as the
# nearest of these (on a log scale) would be wrapped: one unit per layer.
TYPICAL_LAYERS = ((125e6, 12, "GPT-3 Small"), (350e6, 24, "GPT-3 Medium"),
                  (1.3e9, 24, "GPT-3 XL"), (2.7e9, 32, "GPT-3 2.7B"), (6.7e9, 32, "Llama 7B"),
                  (13e9, 40, "Llama 13B"), (32.5e9, 60, "Llama 33B"), (70e9, 80, "Llama 2 70B"),
                  (175e9, 96, "GPT-3 175B"), (405e9, 126, "Llama 3.1 405B"))


def typical_layers(params):
    """(layers, model name) of the published transformer nearest in size to
    `params` parameters (TYPICAL_LAYERS), at most one layer per parameter."""
    _, layers, name = min(TYPICAL_LAYERS, key=lambda t: abs(math.log(params / t[0])))
    return min(layers, int(params)), name


def units_from_count(params, units=1, elem_bytes=4):
    """`params` parameters in `units` equal wrapped units (the first takes
    the remainder) and an empty root."""
    per, rest = divmod(int(params), units)
    out = [Unit(f"unit{i}", [Group([per + (rest if i == 0 else 0)], elem_bytes, True)])
           for i in range(units)]
    return out + [Unit("<root>", [])]
