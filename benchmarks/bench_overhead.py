"""Per-unit cost: 64 tiny units, each unit's hooks and collectives against its compute.

    python3 benchmarks/bench_overhead.py [--steps 50] [--warmup 5] [--units 64]
        [--impl unwrapped,hooks-only,fsdp1,fully_shard,...] [--backend shm|torch]
        [--breakdown]

The model is `units` blocks of relu(Linear(32, 32)(x)) + x, batch 8,
float32. Two ranks on one host (BENCH_WORLD in the environment changes it; a
gloo process group; flatshard on its default shared-memory backend, or with
--backend torch on the gloo group as torch's own FSDP is), one thread each.
Every impl runs in the same processes, forward + backward only (no
optimizer: the point is what wrapping adds around each unit), each step
starting at a barrier and counted as the slower rank's time. The impls take
turns step by step (each round builds them all afresh): this machine's speed
drifts by up to 2x over seconds, which would otherwise fall on whichever
impl ran then. "unwrapped" is the same model with no sharding at all; the
others wrap every block and the root: "fsdp1" is
flatshard.FullyShardedDataParallel (FULL_SHARD, one unit per block),
"fully_shard" is flatshard.fully_shard on each block and the root (both with
the backend's default FLATSHARD_REDUCE_BUCKET_BYTES and
FLATSHARD_GATHER_AHEAD_BYTES: 1 MiB on torch, none on shm, unless the
command's environment sets them), "-nobucket" the same with every group
reducing on its own, "-noahead" with every unit gathering on its own,
"torch-fully_shard" is torch's own. "+prefetch": torch's explicit prefetch
lists in buckets of eight blocks (block 0, 8, ... prefetches the next seven
in forward, 63, 55, ... the seven before in backward); flatshard gathers
each bucket in one all-gather on a host Comm, torch issues one per block.
"hooks-only" is the unwrapped model with the torch hooks a per-unit wrapper
needs, each doing the least it can: a forward pre-hook and a forward hook on
every block that swap its parameters in and out (as fully_shard registers
its unsharded and sharded parameters), a hook where backward reaches each
block's output (the pre-backward, as both wrappers hook it:
runtime/trees.hook_before_backward) and a post-accumulate-grad hook on each
parameter that drops the gradient (the post-backward): what torch's hook
machinery costs by itself, with no collective and no sharding, the floor
under any hook-based wrapper. "fsdp1-floor" is "fsdp1" with each unit's hook
bodies cut down to what no implementation of these hooks can skip: the
engine's call per hook event (its gather, free and reduce-scatter), the
parameter views and their registration, the hook on the unit's output, and
the new gradient shard; no bookkeeping, no prefetch, no checks (valid only
for this model and the default options: a measurement, not a mode). What it
costs above "hooks-only" is the engine and torch's view ops; what "fsdp1"
costs above it is all the Python a hook body would save by being written in
C. "fully_shard-floor" is the same for "fully_shard": each block's hooks
removed and replaced by the engine's calls (gather, free, and one
reduce-scatter that also frees once every parameter's gradient has arrived),
the parameters registered in and out, the hook on the block's output, one
gradient per parameter and the DTensor over it; no state, prefetch, order,
bucket, profiler ranges or checks (valid only for this model and this flow,
gradients dropped every step). --breakdown adds fully_shard's engine calls
timed inside the steps and alone, both ranks in step. Their difference is
not only waiting at the collectives for the other rank: a call between
pieces of torch's work runs with its code and data cold, which one rank
shows by itself (benchmarks/bench_meet.py times the collectives alone).
Printed: the median and spread of the step time and the ratio to
"unwrapped"; and the first loss of each, which must agree (same seed, same
math).
"""
import argparse
import datetime
import os
import random
import time

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, inherited by the ranks

import torch
import torch.distributed as dist
import torch.nn as nn
from harness import cpu_name, impl_list, print_table, run_ranks  # noqa: E402
from flatshard.runtime.trees import hook_before_backward  # noqa: E402

WORLD = int(os.environ.get("BENCH_WORLD", "2"))
IMPLS = ("unwrapped", "hooks-only", "fsdp1", "fsdp1-floor", "fsdp1-nobucket",
         "fsdp1-noahead", "fully_shard", "fully_shard-floor",
         "fully_shard-nobucket", "fully_shard-noahead", "fully_shard+prefetch",
         "torch-fully_shard", "torch-fully_shard+prefetch")
AHEAD = os.environ.get("FLATSHARD_GATHER_AHEAD_BYTES")  # None: the backend's default
BUCKET_ENV = os.environ.get("FLATSHARD_REDUCE_BUCKET_BYTES")  # likewise
BUCKET = 8  # +prefetch: every BUCKET-th block prefetches the next BUCKET - 1


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


class Tiny(nn.Module):
    def __init__(self, units, d=32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(units))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _drop_grad(p):
    p.grad = None


def _hooks_only(model):
    """Hooks that do nothing but swap parameters and drop gradients."""
    for b in model.blocks:
        params = b.lin._parameters
        resting = dict(params)
        active = {k: nn.Parameter(v.detach().clone()) for k, v in resting.items()}
        for p in active.values():
            p.register_post_accumulate_grad_hook(_drop_grad)

        def pre(module, args, kwargs, params=params, active=active):
            params.update(active)

        def post(module, args, out, params=params, resting=resting):
            params.update(resting)
            hook_before_backward(out, _noop)
        b.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
        b.register_forward_hook(post)
    return model


def _noop(grad):
    return None


def _floor_hooks(model):
    """fsdp1-floor: the FSDP1 wrapper's hook bodies on every unit replaced
    (on the instances) by the least they must do (see the module's doc)."""
    from flatshard import _C
    from flatshard.fsdp.unit import fsdp_units
    from flatshard.runtime import eager
    from flatshard.runtime.grad_hooks import run_hooks
    grad_on = _C.FLAG_GRAD_ENABLED

    for m in fsdp_units(model):
        u = m._unit

        def pre_forward(u=u):
            u.c.event(_C.EV_PRE_FORWARD, grad_on, -1, None, None, False, False, None, None)
            for g in u.groups:
                views = g.unsharded_views()
                for d, attr, i in g.targets:
                    d[attr] = views[i]

        def pre_backward(grad, u=u):
            u.root.queue_final()
            u.c.event(_C.EV_PRE_BACKWARD, 0, -1, None, None, False, False, None, None)

        def post_forward(out, u=u, pre_backward=eager.wrap(pre_backward)):
            u.c.event(_C.EV_POST_FORWARD, grad_on, -1, None, None, False, False, None, None)
            hook_before_backward(out, pre_backward)
            return out

        def post_backward(gi, full, u=u):
            g = u.groups[gi]
            grad, full.grad = full.grad, None
            out = g.new_shard()
            u.c.event(_C.EV_POST_BACKWARD, 0, gi, grad, out, False, False, None, None)
            g.shard.grad = out

        def fsdp_pre(args, kwargs, m=m, u=u):
            root = m._root_state or m._lazy_init()
            if root.owner is m:
                root.begin_forward()
            m._unit.pre_forward()
            return args, kwargs

        def fsdp_post(out, m=m):
            out = m._unit.post_forward(out)
            if m._root_state.owner is m:
                m._root_state.end_forward()
            return out
        u.pre_forward, u.post_forward = pre_forward, post_forward
        # the flat buffers' hooks (the engine unit's) call post_backward, never
        # their plain path
        u.c.set_events(u, type(u)._gather_backward, type(u)._backward_views,
                       lambda self, gi, full, f=post_backward: f(gi, full), type(u)._plain_failed,
                       run_hooks, torch.empty_like, torch.Tensor)
        u.hand_plain = lambda c=u.c: setattr(c, "plain", 0)
        m._pre_forward, m._post_forward = eager.wrap(fsdp_pre), eager.wrap(fsdp_post)
    return model


def _fully_shard_floor(model):
    """fully_shard-floor: flatshard.fully_shard's hooks on every block
    replaced (removed from the modules, new ones registered) by the least
    they must do (see the module's doc)."""
    from flatshard.fsdp2.state import state_of
    from flatshard.runtime import eager

    for m in [model, *model.blocks]:
        for h in state_of(m).handles:
            h.remove()
    for b in model.blocks:
        g = state_of(b).group
        g.unshard()  # the unsharded parameters, made once
        g.reshard()
        c, unsharded, sharded = g.c, g.unsharded, g.sharded
        slots = [(m._parameters, attr, i) for i, al in enumerate(g.aliases) for m, attr in al]
        n, arrived = len(unsharded), [0]

        def pre_backward(grad, c=c):
            c.unshard(False)

        def pre(module, args, kwargs, c=c, slots=slots, unsharded=unsharded):
            c.unshard(False)
            for d, attr, i in slots:
                d[attr] = unsharded[i]

        def post(module, args, out, c=c, slots=slots, sharded=sharded,
                 pre_backward=eager.wrap(pre_backward)):
            for d, attr, i in slots:
                d[attr] = sharded[i]
            c.reshard()
            hook_before_backward(out, pre_backward)

        def post_backward(param, c=c, n=n, arrived=arrived):
            arrived[0] += 1
            if arrived[0] < n:
                return
            arrived[0] = 0
            c.reduce_grads(None, False, True, None)  # reduce and reshard, gradients set
        post_backward = eager.wrap(post_backward)
        for p in unsharded:
            p.register_post_accumulate_grad_hook(post_backward)
        b.register_forward_pre_hook(eager.wrap(pre), prepend=True, with_kwargs=True)
        b.register_forward_hook(eager.wrap(post))
    return model


def build(impl, units):
    torch.manual_seed(0)
    model = Tiny(units)
    if impl == "hooks-only":
        return _hooks_only(model)
    if impl.startswith("fsdp1"):
        import flatshard
        from flatshard import ModuleWrapPolicy
        model = flatshard.FullyShardedDataParallel(model,
                                                   auto_wrap_policy=ModuleWrapPolicy({Block}))
        return _floor_hooks(model) if impl == "fsdp1-floor" else model
    if impl.startswith(("fully_shard", "torch-fully_shard")):
        if impl.startswith("fully_shard"):
            from flatshard import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (WORLD,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if impl.endswith("+prefetch"):
            _bucket_prefetch(list(model.blocks))
        if impl == "fully_shard-floor":
            return _fully_shard_floor(model)
    return model


def _bucket_prefetch(blocks):
    """torch's explicit prefetch lists in buckets: in forward, blocks 0, 8,
    16, ... prefetch the next seven; in backward, 63, 55, ... the seven
    before. flatshard gathers each bucket in one all-gather on the host;
    torch issues one all-gather per block."""
    for i in range(0, len(blocks), BUCKET):
        blocks[i].set_modules_to_forward_prefetch(blocks[i + 1:i + BUCKET])
    rev = blocks[::-1]
    for i in range(0, len(rev), BUCKET):
        rev[i].set_modules_to_backward_prefetch(rev[i + 1:i + BUCKET])


def _set_env(impl):
    """The budgets an impl runs with, read at the root's first forward (its
    lazy init)."""
    for name, off, given in (("FLATSHARD_REDUCE_BUCKET_BYTES", "-nobucket", BUCKET_ENV),
                             ("FLATSHARD_GATHER_AHEAD_BYTES", "-noahead", AHEAD)):
        if impl.endswith(off):
            os.environ[name] = "0"
        elif given is None:  # the backend's default
            os.environ.pop(name, None)
        else:  # as the command was given it
            os.environ[name] = given


def one_step(model, x):
    """One forward + backward from a barrier; (the slower rank's ms, loss)."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = model(x).square().mean()
    loss.backward()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    for p in model.parameters():
        p.grad = None
    return dt.item() * 1e3, loss.item()


def run_round(impls, rank, args, res, seed):
    """Every impl built and warmed up, then timed step by step in turn: each
    step runs every impl once, in a new random order (the same on every rank),
    so that a slow spell of the machine (they last seconds here) and what the
    impl before left behind (caches, spinning threads) hit every impl alike.
    Adds {"times", "first"} or {"error"} per impl to `res`."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1 + rank))
    models = {}
    for impl in impls:
        try:
            _set_env(impl)
            model = build(impl, args.units)
            first = one_step(model, x)[1]
            for _ in range(args.warmup - 1):
                one_step(model, x)
        except Exception as e:  # one failing impl does not end the run
            res.setdefault(impl, {"error": f"{type(e).__name__}: {e}"})
            continue
        models[impl] = model
        res.setdefault(impl, {"times": [], "first": first})
    order = list(models)
    shuffle = random.Random(seed)  # the same orders on every rank
    for _ in range(args.steps):
        shuffle.shuffle(order)
        for impl in order:
            res[impl]["times"].append(one_step(models[impl], x)[0])
    models.clear()


class _Timed:
    """An engine group whose unshard and reduce calls add their wall time
    to `timers` (name -> [seconds, calls]); everything else passes through."""

    def __init__(self, c, timers):
        object.__setattr__(self, "_c", c)
        object.__setattr__(self, "_timers", timers)

    def __getattr__(self, name):
        return getattr(self._c, name)

    def __setattr__(self, name, value):
        setattr(self._c, name, value)

    def _timed(self, name, fn, *args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            slot = self._timers[name]
            slot[0] += time.perf_counter() - t
            slot[1] += 1

    def unshard(self, *args, **kwargs):
        return self._timed("unshard", self._c.unshard, *args, **kwargs)

    def reduce_grads(self, *args, **kwargs):
        return self._timed("reduce", self._c.reduce_grads, *args, **kwargs)


def breakdown(rank, args):
    """fully_shard's engine calls (the unshard with its all-gather, the
    reduction with its reduce-scatter) timed one by one inside the training
    steps, then the same calls of one group alone in a loop, both ranks in
    step. Inside the steps a call runs cold, between torch's work, and
    waits at the barrier for the later rank. Returns us per call."""
    from flatshard.fsdp2.state import state_of
    # each group's reduction on its own: a bucketed one has no collective of
    # its own to time (and the bucket's flush takes the engine objects)
    os.environ["FLATSHARD_REDUCE_BUCKET_BYTES"] = "0"
    model = build("fully_shard", args.units)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1 + rank))

    def step():
        model(x).square().mean().backward()
        for p in model.parameters():
            p.grad = None
    step()  # lazy init: the groups exist from here on
    timers = {"unshard": [0.0, 0], "reduce": [0.0, 0]}
    groups = [state_of(b).group for b in model.blocks]
    for g in groups:
        g.c = _Timed(g.c, timers)
    for _ in range(args.warmup):
        step()
    for slot in timers.values():
        slot[:] = [0.0, 0]
    dist.barrier()
    for _ in range(args.steps):
        step()
    got = {f"{k} in the step": v[0] / v[1] * 1e6 for k, v in timers.items()}
    c = groups[0].c._c
    grads = [torch.randn(up.shape) for up in groups[0].unsharded]
    n = 50 * args.steps
    alone = {"unshard": 0.0, "reduce": 0.0}
    dist.barrier()
    for _ in range(n):
        t = time.perf_counter()
        c.unshard(False)
        alone["unshard"] += time.perf_counter() - t
        c.reshard()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(n):
        c.reduce_grads(grads, False, False, None)
    alone["reduce"] = time.perf_counter() - t
    got.update({f"{k} alone": v / n * 1e6 for k, v in alone.items()})
    del model
    return got


def worker(rank, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        res = {}
        for r in range(args.rounds):  # fresh models each round
            run_round(args.impl, rank, args, res, seed=r)
        if args.breakdown:
            res["breakdown"] = breakdown(rank, args)
        if rank == 0:
            out.put(res)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="rounds, each with every impl built afresh")
    p.add_argument("--units", type=int, default=64)
    p.add_argument("--impl", default=",".join(IMPLS))
    p.add_argument("--backend", choices=("shm", "torch"), default="shm",
                   help="flatshard's collective backend (torch: the gloo process group)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time fully_shard's engine calls inside the steps and alone")
    args = p.parse_args()
    args.impl = impl_list(p, args, IMPLS)
    os.environ["FLATSHARD_COMM_BACKEND"] = args.backend  # inherited by the ranks
    res = run_ranks(worker, WORLD, args)
    cpu = cpu_name()
    print(f"# {cpu}; torch {torch.__version__}; {WORLD} ranks, 1 thread each; "
          f"flatshard on its {args.backend} backend; "
          f"{args.units} units of Linear(32, 32), batch 8, forward + backward")
    print(f"# {args.rounds} rounds x {args.steps} timed steps per impl, the impls taking turns "
          "step by step")
    print_table(res, args.impl)
    b = res.get("breakdown")
    if b:
        print("# fully_shard's engine calls, us per call (rank 0): "
              + ", ".join(f"{k} {v:.2f}" for k, v in b.items()))
        wait = 2 * (b["unshard in the step"] - b["unshard alone"]) + \
            b["reduce in the step"] - b["reduce alone"]
        print(f"# in the step less alone: about {wait:.1f} us a unit (two unshards and one "
              "reduction; run cold between torch's work, and waiting for the other rank)")


if __name__ == "__main__":
    main()
