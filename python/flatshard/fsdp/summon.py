"""summon_full_params: every unit's full parameters, in their original shapes,
inside a with-block (torch FSDP1's semantics).

Per unit: the SUMMON_ENTER event of the C state machine says whether to
gather (sharded strategies) and SUMMON_EXIT whether to free again (only if
the unit was sharded before, so a unit left unsharded by a forward stays
so). Inside, the module's parameters are views of the full buffer:
  use_orig_params=True   each registered parameter's .data is its full view;
  use_orig_params=False  the flat shards are unregistered and the original
                         names are registered as nn.Parameter views,
so `named_parameters()` shows the plain model's shapes either way. On exit
the registrations are restored exactly and, with writeback, this rank's
slice of the full buffer is copied back into its shard.
"""
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _C
from ..errors import bad_type, bad_value
from ..runtime.comm import all_gather_into
from .flat_param import flat_param_name
from .unit import fsdp_units
from .zero1 import refresh


def group_rank(fs):
    return dist.get_rank(fs._cfg.group)


def full_views(g):
    """Parameter views of a group's (live) full buffer, outside autograd."""
    chunks = torch.split_with_sizes(g.full.detach(), g.split_sizes)
    return [chunks[s].view(shape) for s, shape in zip(g.view_slots, g.shapes)]


def all_gather_shard(fs, local):
    """A shard-sized tensor from every rank of the unit -> the padded full
    tensor, through the unit's own Comm (its backend and its ledger)."""
    if fs._unit.no_shard:
        return local
    comm = fs._unit.c.comm
    out = torch.empty(local.numel() * comm.world_size, dtype=local.dtype)
    all_gather_into(comm, out, local.contiguous(), tag=fs._unit.name)
    return out


def _check_args(units, writeback, rank0_only, offload_to_cpu, with_grads):
    for name, v in (("writeback", writeback), ("rank0_only", rank0_only),
                    ("offload_to_cpu", offload_to_cpu), ("with_grads", with_grads)):
        if not isinstance(v, bool):
            raise bad_type(name, v, "True or False")
    if writeback and rank0_only:
        raise bad_value("writeback", writeback, "writeback=True with rank0_only=True is not "
                        "supported: only rank 0 sees the full parameters", "pass writeback=False")
    if with_grads and offload_to_cpu:
        raise bad_value("with_grads", with_grads, "with_grads=True with offload_to_cpu=True is "
                        "not supported (as in torch FSDP)")
    if with_grads and not all(u._unit.use_orig_params for u in units):
        raise bad_value("with_grads", with_grads, "with_grads=True needs use_orig_params=True "
                        "(the original parameters have no .grad otherwise)",
                        "wrap with use_orig_params=True")


@contextlib.contextmanager
def summon_full_params(module, recurse=True, writeback=True, rank0_only=False,
                       offload_to_cpu=False, with_grads=False):
    """FSDP.summon_full_params. offload_to_cpu is accepted and has nothing to
    do: flatshard's parameters already live in host memory."""
    if not isinstance(module, nn.Module):
        raise bad_type("module", module, "an nn.Module")
    if not isinstance(recurse, bool):
        raise bad_type("recurse", recurse, "True or False")
    units = fsdp_units(module, recurse)
    _check_args(units, writeback, rank0_only, offload_to_cpu, with_grads)
    with contextlib.ExitStack() as stack:
        for fs in units:
            stack.enter_context(summon_unit(fs, writeback, rank0_only, with_grads))
        yield


@contextlib.contextmanager
def summon_unit(fs, writeback=False, rank0_only=False, with_grads=False):
    """One unit's part of summon_full_params. Yields whether this rank sees
    the full parameters (False on ranks other than 0 under rank0_only)."""
    unit = fs._unit
    was_sharded = not unit.c.is_unsharded
    act = unit.c.step(_C.EV_SUMMON_ENTER, 0)
    try:
        if act & _C.ACT_UNSHARD:
            unit.c.unshard(True)  # full precision, also under mixed precision
        grads = _gather_grads(fs) if with_grads else None
        if rank0_only and group_rank(fs) != 0:
            if was_sharded:  # gathered only because the collective needs every rank
                unit.c.reshard()
            yield False
            return
        restore = _show_orig(fs) if unit.use_orig_params else _show_as_params(fs)
        shown_grads = _show_grads(fs, grads) if grads is not None else None
        try:
            yield True
        finally:
            restore()
            if shown_grads is not None:
                shown_grads(writeback)
            if writeback:
                _write_back(fs)
    finally:
        act = unit.c.step(_C.EV_SUMMON_EXIT, 0)
        if act & _C.ACT_RESHARD:
            unit.c.reshard()
        elif getattr(unit, "shard_optim", False) and any(g.lp is not None for g in unit.groups):
            # ZeRO-1 keeps lp whole: drop the fp32 gather, and lp again from
            # the (maybe written) shards
            refresh(unit)


def _show_orig(fs):
    unit = fs._unit
    for g in unit.groups:
        for p, v in zip(g.params, full_views(g)):
            p.data = v

    def restore():
        for g in unit.groups:
            shard = g.shard.detach()
            for i, p in enumerate(g.params):
                p.data = g.piece(shard, i, unit.no_shard)
    return restore


def _show_as_params(fs):
    """use_orig_params=False: register each original parameter as an
    nn.Parameter view (one object per parameter, shared by its aliases)."""
    unit = fs._unit
    # the module holding the flat parameters (a checkpoint wrapper may sit between)
    wrapped = getattr(unit, "flat_param_module", None) or fs._fsdp_wrapped_module
    saved_params = {wrapped: dict(wrapped._parameters)}
    saved_attrs = {}  # (module, attr) -> the tensor attribute shown outside
    for g in unit.groups:
        wrapped._parameters.pop(flat_param_name(g.index), None)
    for g in unit.groups:
        for view, aliases in zip(full_views(g), g.aliases):
            param = nn.Parameter(view, requires_grad=g.requires_grad)
            for a in aliases:
                saved_params.setdefault(a.module, dict(a.module._parameters))
                if (a.module, a.attr) not in saved_attrs:
                    saved_attrs[a.module, a.attr] = a.module.__dict__.pop(a.attr, None)
                a.module._parameters[a.attr] = param

    def restore():
        for m, params in saved_params.items():
            m._parameters.clear()
            m._parameters.update(params)
        for (m, attr), value in saved_attrs.items():
            m.__dict__[attr] = value
    return restore


def _gather_grads(fs):
    """use_orig_params=True: the full gradient of each group whose parameters
    have one, gathered from the gradient pieces (None where none has)."""
    out = []
    for g in fs._unit.groups:
        if g.full.grad is not None:
            raise bad_value("with_grads", True, f"unit {fs._unit.name!r} holds gradients "
                            "accumulated under no_sync() that are not reduced yet",
                            "run a synchronised backward first")
        pieces = [p.grad for p in g.params]
        if all(x is None for x in pieces):
            out.append(None)
            continue
        local = torch.zeros(g.shard_numel, dtype=g.dtype)
        for i, x in enumerate(pieces):
            if x is not None:
                g.piece(local, i, False).copy_(x.reshape(-1))
        out.append(all_gather_shard(fs, local))
    return out


def _show_grads(fs, fulls):
    """p.grad becomes the full gradient view while shown; on exit the old
    gradient pieces come back (updated from the full ones with writeback)."""
    unit = fs._unit
    saved = []
    for g, full in zip(unit.groups, fulls):
        if full is None:
            continue
        chunks = torch.split_with_sizes(full, g.split_sizes)
        for i, (p, s, shape) in enumerate(zip(g.params, g.view_slots, g.shapes)):
            saved.append((g, i, p, p.grad, full))
            if p.grad is not None:
                p.grad = chunks[s].view(shape)

    def restore(writeback):
        for g, i, p, old, full in saved:
            if old is None:
                continue
            if writeback:
                mine = _my_slice(fs, g, full)
                old.copy_(g.piece(mine, i, False).view(old.shape))
            p.grad = old
    return restore


def _my_slice(fs, g, full):
    if fs._unit.no_shard:
        return full
    return full.narrow(0, group_rank(fs) * g.shard_numel, g.shard_numel)


@torch.no_grad()
def _write_back(fs):
    if fs._unit.no_shard:
        return  # the full buffer is the shard
    for g in fs._unit.groups:
        g.shard.detach().copy_(_my_slice(fs, g, g.full.detach()))
