"""Exact losses of the benchmark models through both APIs and every strategy.

    python3 benchmarks/bench_bits.py [PORT] > new.txt
    PYTHONPATH=/path/to/older/checkout/python python3 benchmarks/bench_bits.py > old.txt
    diff old.txt new.txt

Two ranks (gloo group; flatshard on its default backend), one thread each,
three AdamW steps of each model in benchmarks/models.py, wrapped by the FSDP1
wrapper under FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, SHARD_OPTIM, HYBRID_SHARD
and FULL_SHARD with bf16 mixed precision, and by fully_shard (fp32 and bf16).
Each loss is printed as float.hex, so two builds can be compared bit for bit:
a refactoring of the engine must leave every line unchanged.
"""
import os
import sys

os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from models import MODELS  # noqa: E402

CASES = [("fsdp1", s) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIM", "HYBRID_SHARD")] + \
        [("fsdp1-bf16", "FULL_SHARD"), ("fully_shard", None), ("fully_shard-bf16", None)]

def run(rank, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import flatshard
    from flatshard import ModuleWrapPolicy, MixedPrecision, ShardingStrategy, fully_shard, MixedPrecisionPolicy
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    for mname, spec in MODELS.items():
        sp = spec()
        for api, strat in CASES:
            torch.manual_seed(0)
            model = sp["build"]()
            if api.startswith("fsdp1"):
                kw = {}
                if api.endswith("bf16"):
                    kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                if strat == "HYBRID_SHARD":
                    kw["device_mesh"] = init_device_mesh("cpu", (1, 2), mesh_dim_names=("r", "s"))
                model = flatshard.FSDP(model, auto_wrap_policy=ModuleWrapPolicy({sp["unit_cls"]}),
                                       sharding_strategy=ShardingStrategy[strat], **kw)
            else:
                mesh = init_device_mesh("cpu", (2,))
                mpp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if api.endswith("bf16") else MixedPrecisionPolicy()
                for m in model.modules():
                    if isinstance(m, sp["unit_cls"]):
                        fully_shard(m, mesh=mesh, mp_policy=mpp)
                fully_shard(model, mesh=mesh, mp_policy=mpp)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x, y = sp["make_batch"](rank)
            ls = []
            for _ in range(3):
                opt.zero_grad()
                loss = sp["loss_fn"](model(x), y)
                loss.backward()
                opt.step()
                ls.append(loss.item().hex())
            out[f"{mname}/{api}/{strat}"] = ls
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()

if __name__ == "__main__":
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 29611
    ps = [ctx.Process(target=run, args=(r, port, q)) for r in range(2)]
    [p.start() for p in ps]; res = q.get(timeout=900); [p.join() for p in ps]
    for k, v in res.items():
        print(k, " ".join(v))
