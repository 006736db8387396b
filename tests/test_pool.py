"""The host pool of unit-lifetime buffers (csrc/engine/pool.c, [Note: pooled
storage] in csrc/hooks/storage.c): blocks reused by size, a bounded cache,
memory handed back to the system, and units whose gathered buffers come
from it while views and autograd-saved tensors stay valid."""
import gc

import torch
import torch.distributed as dist

import flatshard
from flatshard import FSDP, ShardingStrategy, _C
from parity import batches, policy
from toy_models import build

PAGE = 4096


def _delta(before, after):
    return {k: after[k] - before[k] for k in before}


def test_pool_block_sizes_round_to_pages_and_hold_their_bytes():
    for n in [1, 3, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 7]:
        before = _C.pool_stats()
        s = _C.pool_storage(n)
        assert s.nbytes() == n and s.data_ptr() % PAGE == 0
        d = _delta(before, _C.pool_stats())
        assert d["live_bytes"] == -(-n // PAGE) * PAGE
        t = torch.empty(0, dtype=torch.uint8).set_(s)
        t.copy_(torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8))
        assert torch.equal(t, torch.arange(n).remainder(251).to(torch.uint8))
        del t, s
        assert _C.pool_stats()["live_bytes"] == before["live_bytes"]
    _C.pool_trim()


SMALL = 256 << 10  # FS_POOL_SMALL_BYTES: blocks up to this size have their own budget
SMALL_BUDGET = 4 << 20  # FS_POOL_SMALL_BUDGET


def test_pool_reuses_a_block_of_the_same_size_and_keeps_a_bounded_cache():
    _C.pool_trim()
    _C.pool_set_keep(2)
    big = SMALL + PAGE  # the smallest block the count of two applies to
    try:
        s = _C.pool_storage(big)
        ptr = s.data_ptr()
        del s  # back to the cache, resident
        before = _C.pool_stats()
        s = _C.pool_storage(big)
        d = _delta(before, _C.pool_stats())
        assert s.data_ptr() == ptr and d["reuses"] == 1 and d["maps"] == 0
        other = _C.pool_storage(big + 2 * PAGE)  # another size: a new mapping
        assert _delta(before, _C.pool_stats())["maps"] == 1
        blocks = [_C.pool_storage(big + 4 * PAGE) for _ in range(3)]
        before = _C.pool_stats()
        del s, other, blocks  # five large blocks back; the two freed last stay cached
        d = _delta(before, _C.pool_stats())
        assert d["unmaps"] == 3 and _C.pool_stats()["cached_bytes"] == 2 * (big + 4 * PAGE)
        _C.pool_set_keep(0)
        assert _C.pool_stats()["cached_bytes"] == 0
    finally:
        _C.pool_set_keep(2)


def test_pool_keeps_small_blocks_by_bytes_not_by_count():
    """A small unit's cycle (its gather and the reduction's two staging
    blocks) is served from the cache: three small blocks stay, beside the
    two large ones, until the small ones pass their byte budget."""
    _C.pool_trim()
    _C.pool_set_keep(2)
    try:
        cycle = [_C.pool_storage(n) for n in (4 * PAGE, 2 * PAGE, PAGE)]
        del cycle
        assert _C.pool_stats()["cached_bytes"] == 7 * PAGE
        before = _C.pool_stats()
        for _ in range(10):  # the next units of the same sizes: no mapping at all
            cycle = [_C.pool_storage(n) for n in (4 * PAGE, 2 * PAGE, PAGE)]
            del cycle
        d = _delta(before, _C.pool_stats())
        assert d["maps"] == 0 and d["unmaps"] == 0 and d["reuses"] == 30
        # past the budget, the small blocks freed longest ago go back
        many = [_C.pool_storage(SMALL) for _ in range(SMALL_BUDGET // SMALL + 2)]
        del many
        stats = _C.pool_stats()
        assert stats["cached_bytes"] <= SMALL_BUDGET
        assert stats["cached_bytes"] > SMALL_BUDGET - SMALL
        _C.pool_set_keep(0)  # keeps nothing, small or large
        assert _C.pool_stats()["cached_bytes"] == 0
    finally:
        _C.pool_set_keep(2)


def test_pool_trim_idle_waits_until_no_block_is_in_use():
    _C.pool_trim()
    held = _C.pool_storage(2 * PAGE)
    dropped = _C.pool_storage(3 * PAGE)
    del dropped
    assert _C.pool_trim(True) == 0  # one block still in use
    assert _C.pool_stats()["cached_bytes"] == 3 * PAGE
    del held
    assert _C.pool_trim(True) == 5 * PAGE
    assert _C.pool_stats()["cached_bytes"] == 0


def test_a_swapped_in_block_serves_views_made_before_it():
    # The mechanism the units rely on: views made while one block was live
    # see the next block swapped in, and the storage reads as resharded
    # (zero bytes) in between.
    full = torch.empty(1000)
    full.untyped_storage().resize_(0)
    before = _C.pool_stats()["live_bytes"]
    full.untyped_storage()._swap_data_ptr_(_C.pool_storage(4000))
    view = full[10:20]
    full.untyped_storage()._swap_data_ptr_(torch.UntypedStorage(0))
    assert full.untyped_storage().nbytes() == 0
    assert _C.pool_stats()["live_bytes"] == before
    full.untyped_storage()._swap_data_ptr_(_C.pool_storage(4000))
    full.copy_(torch.arange(1000.0))
    assert torch.equal(view, torch.arange(10.0, 20.0))
    full.untyped_storage()._swap_data_ptr_(torch.UntypedStorage(0))
    assert _C.pool_stats()["live_bytes"] == before


def _gathers_come_from_the_pool(strategy, mixed):
    rank, world = dist.get_rank(), dist.get_world_size()
    mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16) \
        if mixed else None
    fs = FSDP(build(nested=not mixed), sharding_strategy=ShardingStrategy[strategy],
              auto_wrap_policy=policy("nested" if not mixed else "fs_blocks"), mixed_precision=mp)
    units = [m._unit for m in fs.modules() if isinstance(m, FSDP)]
    seen = []

    def look(*_):
        for u in units:
            for g in u.groups:
                if g.compute.untyped_storage().nbytes():
                    seen.append(g.compute.untyped_storage().data_ptr() % PAGE == 0)
    hooks = [m.register_forward_hook(look) for m in fs.modules() if isinstance(m, FSDP)]
    gc.collect()  # the pool is the process's: what earlier cases left is let go first
    _C.pool_trim()
    before = _C.pool_stats()
    x, y = batches(1, 2, world, seed=5)[0]
    ((fs(x[2 * rank:2 * rank + 2]).float() - y[2 * rank:2 * rank + 2]) ** 2).mean().backward()
    after = _C.pool_stats()
    for h in hooks:
        h.remove()
    unsharded = flatshard.memory_stats(fs)["unsharded"]
    # the original parameters, flattened into the shards, keep no memory
    orig_freed = all(p.untyped_storage().nbytes() <= p.element_size()
                     for u in units for g in u.groups for p in g.params)
    # Blocks another live model in this process holds keep the cache (and
    # stay live): only this model's are accounted for then.
    cached = after["cached_bytes"] if before["live_bytes"] == 0 else 0
    return (all(seen) and bool(seen), after["maps"] > before["maps"],
            after["live_bytes"] - before["live_bytes"], cached, unsharded, orig_freed)


def test_units_gather_into_pool_blocks_and_give_them_back_after_backward(dist_pool):
    for strategy, mixed in [("FULL_SHARD", False), ("SHARD_GRAD_OP", False),
                            ("FULL_SHARD", True), ("NO_SHARD", True)]:
        for aligned, mapped, live, cached, unsharded, orig_freed in dist_pool(2).run(
                _gathers_come_from_the_pool, strategy, mixed):
            assert aligned and mapped, (strategy, mixed)
            assert orig_freed, (strategy, mixed)
            # every unit resharded: no block in use, none kept resident
            assert (live, cached, unsharded) == (0, 0, 0), (strategy, mixed)
