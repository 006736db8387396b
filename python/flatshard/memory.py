"""Live memory per rank, measured from torch's own storages (not from
flatshard's bookkeeping), so tests and benchmarks can hold the sharding
against what is really allocated."""
import torch


def _storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def memory_stats(model, optimizer=None):
    """Bytes this rank holds, by role:

    params     storages of the parameters the optimizer sees (the shards)
    unsharded  full (gathered) buffers live right now: 0 after reshard
    grads      gradient storages, including unreduced full gradients
    optim      optimizer state tensors
    """
    from .fsdp import FullyShardedDataParallel
    fulls, pending = [], []
    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel):
            for g in m._unit.groups:
                if g.full.untyped_storage().data_ptr() != g.shard.untyped_storage().data_ptr():
                    fulls.append(g.full)
                if g.lp is not None:
                    fulls.append(g.lp)
                pending.append(g.compute.grad)
    params = list(model.parameters())
    out = {
        "params": _storage_bytes(params),
        "unsharded": _storage_bytes(fulls),
        "grads": _storage_bytes([p.grad for p in params] + pending),
        "optim": 0,
    }
    if optimizer is not None:
        out["optim"] = _storage_bytes(v for st in optimizer.state.values()
                                      for v in st.values() if torch.is_tensor(v))
    return out
