"""Quantized collectives (flatshard.CommQuant): the loss held, the bytes
sent per step, and the block size.

    python3 benchmarks/bench_quant.py [--steps 300] [--api fsdp1,fully_shard] [--backend torch] [--rounds 3]
    python3 benchmarks/bench_quant.py --blocks

Training: two ranks (gloo group, flatshard's default backend: shm), one
thread each, the small transformer LM of tests/quant_lm.py on its fixed
synthetic corpus, AdamW, the same seed: unquantized, int8 gathers, and
int8 gathers + int4 gradients, one after the other in one run; prints the
first and final losses side by side with their differences, and the bytes
the engine counted over the last step (memory_stats' sent_gather /
sent_reduce) with their ratios to the unquantized run.

--blocks: for each block size, the bytes a payload moves per float32 value
(the ratio to 4 bytes) and the round-trip error of int8 and int4 on
Gaussian data (relative RMS), and the quantize + dequantize time of 4M
values (scalar and AVX2, taking turns), for choosing CommQuant's default.
"""
import argparse
import os
import subprocess
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # quant_lm: the model

import torch  # noqa: E402

import harness  # noqa: E402

CASES = [("off", None), ("int8 gathers", dict(weights="int8")),
         ("int8 + int4 grads", dict(weights="int8", grads="int4"))]


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def worker(rank, port, apis, steps, backend, rounds, out):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import flatshard
    import quant_lm
    res = {}
    for _ in range(rounds):  # the cases take turns; each keeps its fastest round
        for api in apis:
            for name, kw in CASES:
                q = flatshard.CommQuant(**kw) if kw else None
                dist.barrier()
                t = time.perf_counter()
                losses, g, r = quant_lm.train(api, q, steps, backend=backend)
                t = (time.perf_counter() - t) / steps
                best = min(t, res[(api, name)][4]) if (api, name) in res else t
                res[(api, name)] = (losses[0], losses[-1], g, r, best)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def train(args):
    apis = args.api.split(",")
    print(f"# CPU: {harness.cpu_name()}")
    print(f"# before: {uptime()}")
    t = time.time()
    res = harness.run_ranks(worker, 2, apis, args.steps, args.backend, args.rounds)
    print(f"# after:  {uptime()}  ({time.time() - t:.0f} s)")
    print(f"# {args.steps} steps, 2 ranks, backend {args.backend or 'default (shm)'}; bytes: "
          "this rank's last step, counted by the engine; ms: wall time per step (wrap "
          "included), the fastest of --rounds rounds, the cases taking turns")
    print(f"{'api':<12} {'case':<18} {'first':>8} {'final':>8} {'vs off':>8} "
          f"{'gather B':>10} {'ratio':>6} {'reduce B':>10} {'ratio':>6} {'ms':>7} {'x off':>6}")
    for api in apis:
        _, off, g0, r0, t0 = res[(api, "off")]
        for name, _ in CASES:
            first, final, g, r, t = res[(api, name)]
            print(f"{api:<12} {name:<18} {first:8.4f} {final:8.4f} "
                  f"{100 * (final - off) / off:+7.2f}% {g:10d} {g / g0:6.3f} {r:10d} "
                  f"{r / r0:6.3f} {1e3 * t:7.2f} {t / t0:6.2f}")


def blocks():
    from flatshard import _C
    from flatshard.tensors import dtype_code
    n = 1 << 22
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    simds = ["scalar"] + (["avx2"] if _C.simd_level() != "scalar" else [])
    print(f"# CPU: {harness.cpu_name()}")
    print(f"# {uptime()}")
    print(f"{'block':>6} {'int8 B/4B':>9} {'int8 err':>9} {'int4 B/4B':>9} {'int4 err':>9} "
          + " ".join(f"{s + ' ms':>10}" for s in simds))
    for block in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        row = [f"{block:6d}"]
        times = {s: [] for s in simds}
        for bits in (8, 4):
            nb = _C.quant_payload_bytes(n, bits, block)
            p = torch.zeros(nb, dtype=torch.uint8)
            y = torch.empty(n)
            _C.quantize(p.data_ptr(), x.data_ptr(), 0, n, bits, block)
            _C.dequantize(y.data_ptr(), 0, p.data_ptr(), n, bits, block, False)
            err = ((y - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()
            row += [f"{nb / (4 * n):9.4f}", f"{err:9.5f}"]
            if bits == 8:
                for _ in range(3):  # the instruction sets take turns
                    for s in simds:
                        t = time.perf_counter()
                        _C.quantize(p.data_ptr(), x.data_ptr(), dtype_code(x.dtype), n, 8, block, s)
                        _C.dequantize(y.data_ptr(), 0, p.data_ptr(), n, 8, block, False, s)
                        times[s].append(time.perf_counter() - t)
        row += [f"{1e3 * min(times[s]):10.2f}" for s in simds]
        print(" ".join(row))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--api", default="fsdp1,fully_shard")
    ap.add_argument("--backend", default=None, help="comm_backend: shm or torch (gloo)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--blocks", action="store_true")
    args = ap.parse_args()
    blocks() if args.blocks else train(args)


if __name__ == "__main__":
    main()
