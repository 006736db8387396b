"""flatshard's command line: `python -m flatshard COMMAND ...`, one subcommand
per tool (`consolidate`, `doctor`, `plan`, `run`, `snapshots`); each adds a parser and a
function below (the planner's lives in plan/cli.py). Above everything:
nothing imports this module."""
import argparse
import os
import platform
import runpy
import sys

import torch

from . import _C, __version__, optim, torch_facts
from .errors import ConfigError
from .plan.cli import add_parser as add_plan
from .runtime import cuda
from .runtime.cuda_nccl import describe as cuda_line
from .snapshots import list_segments, remove_segments
from .state.consolidate import FORMATS, consolidate
from .torch_switch import use_for_torch_fsdp


def _consolidate(args):
    out = consolidate(args.in_dir, args.out_path, fmt=args.format, overwrite=args.force)
    print(f"flatshard: wrote {out} ({os.path.getsize(out):,} bytes)")


_DOCTOR_STEPS_MAX = 500  # a class measured on its steps is decided in a few dozen


def optimizer_tuning_lines(log2=23):
    """Time the CPU optimizer loop's variants here, as the first steps of a
    2^log2-element class do (on scratch buffers before the first step for a
    class under 2^16 elements, else on the class's own steps: stepped here
    until it is decided), and say what won and by how much. The choices in
    memory are forgotten first and the cache file is not read or written:
    this measures now."""
    n = 1 << log2
    threads = torch.get_num_threads()
    p, g, m, v = (torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n))
    low = torch.zeros(n, dtype=torch.bfloat16)
    saved = _C.optim_tune_cache()
    _C.optim_tune_reset()
    _C.optim_tune_cache(None, __version__)
    try:
        steps = [(lambda c: lambda: _C.adam_step(
            p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0,
            c.data_ptr() if c is not None else 0, _C.BF16, n, lr=1e-3, step=1,
            threads=threads))(copy) for copy in (None, low)]
        steps.append(lambda: _C.sgd_step(p.data_ptr(), g.data_ptr(), m.data_ptr(), 0, _C.BF16,
                                         n, lr=1e-3, momentum=0.9, threads=threads))
        for k, step in enumerate(steps):
            for _ in range(_DOCTOR_STEPS_MAX):
                step()
                mine = [r for r in optim.tune_report() if r["size_log2"] == log2 and
                        r["tuned_numel"] == n]
                if len(mine) > k:
                    break
    finally:
        _C.optim_tune_reset()
        _C.optim_tune_cache(saved, __version__)
    return [f"CPU optimizer loop, measured now ({threads} threads; ns/element: the fastest "
            f"round in CPU time, the median round in wall-clock time for thread splits):"] + \
        ["  " + line.replace("AdamW/Adam", "AdamW").replace("bfloat16 copy", "bf16 copy")
         for line in optim.describe_tuning(mine)]


def doctor_report():
    """What this installation was built with and can run, one line each."""
    # _C_cuda is built only where nvcc was found
    cuda_built = "yes" if cuda.built() else "no (none in this build)"
    shm = sys.platform.startswith("linux") and os.path.isdir("/dev/shm")
    nccl = "nccl (units on CUDA devices)" if cuda_built == "yes" else \
        "nccl (not built: no nvcc at install)"
    return [
        f"flatshard {__version__}",
        f"python {platform.python_version()}, torch {torch.__version__}",
    ] + torch_facts.report() + [
        f"CPU SIMD: optimizers {_C.simd_level()}, reductions "
        f"{'avx2' if _C.simd_level() == 'avx512' else _C.simd_level()}",
        f"collective backends: torch (any process group), "
        f"shm ({'available' if shm else 'not available: needs Linux /dev/shm'}), {nccl}",
        f"CUDA kernels built: {cuda_built}; torch sees CUDA: {torch.cuda.is_available()}",
        cuda_line(),
    ] + optimizer_tuning_lines()


def _doctor(args):
    print("\n".join(doctor_report()))


def _run(args):
    """Switch torch's FSDP APIs to flatshard, then return what runs the
    program as `python SCRIPT ARGS` (or `python -m MODULE ARGS`) would: as
    __main__, with the argv it expects."""
    if not args.module and not os.path.isfile(args.target):
        raise ConfigError(f"flatshard: run: no such script {args.target!r} (for a module, "
                          f"give -m MODULE)")
    use_for_torch_fsdp()
    sys.argv = [args.target] + args.args

    def program():
        if args.module:
            runpy.run_module(args.target, run_name="__main__", alter_sys=True)
        else:  # the script's folder first on the path, as python SCRIPT has it
            sys.path[0] = os.path.dirname(os.path.abspath(args.target))
            runpy.run_path(args.target, run_name="__main__")
    return program


def _snapshots(args):
    """List (or remove) the snapshot segments on this host: what a job that
    crashed and was not restarted left in /dev/shm."""
    if args.action == "remove":
        if args.job is None and not args.all:
            raise ConfigError("snapshots remove: give --job JOB (or --all for every job's)")
        gone = remove_segments(args.job)
        print(f"flatshard: removed {len(gone)} snapshot segment(s)")
        for name in gone:
            print(f"  {name}")
        return
    segs = list_segments(args.job)
    if not segs:
        print("flatshard: no snapshot segments on this host")
    for s in segs:
        steps = "unreadable" if s["steps"] is None else (s["steps"] or "none complete")
        print(f"{s['name']}  job {s['job']}  rank {s['rank']}  {s['bytes']:,} bytes  "
              f"steps {steps}  uid {s['uid']}")


def _parser():
    parser = argparse.ArgumentParser(prog="python -m flatshard")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser(
        "consolidate", help="sharded checkpoint -> one .pt or .safetensors file of the model",
        description="Write the model in a sharded checkpoint (flatshard.save_checkpoint's "
        "directory, or a torch.distributed.checkpoint directory) as one file that the plain "
        "model's load_state_dict accepts. Runs in one process: no process group, no GPU, "
        "memory for about one tensor at a time. Optimizer state is left out.")
    p.add_argument("in_dir", help="the checkpoint directory")
    p.add_argument("out_path", help=f"the file to write; its suffix ({', '.join(FORMATS)}) "
                   "picks the format unless --format is given")
    p.add_argument("--format", choices=sorted(set(FORMATS.values())),
                   help="pt (torch.save, for torch.load) or safetensors")
    p.add_argument("--force", action="store_true", help="replace out_path if it exists")
    p.set_defaults(run=_consolidate)
    d = commands.add_parser("doctor", help="what flatshard was built with and can run here")
    d.set_defaults(run=_doctor)
    add_plan(commands)
    r = commands.add_parser(
        "run", help="run a training script with torch's FSDP APIs on flatshard",
        description="Run SCRIPT (or -m MODULE) with its ARGS as python would, after "
        "flatshard.use_for_torch_fsdp(): every torch.distributed.fsdp import in it, or in "
        "the framework it uses, gets flatshard's classes. Under torchrun each rank runs it: "
        "torchrun --nproc-per-node 2 -m flatshard run train.py ARGS.")
    r.add_argument("-m", dest="module", action="store_true",
                   help="TARGET is a module name, run as python -m runs it")
    r.add_argument("target", metavar="TARGET", help="the script (or, with -m, the module)")
    r.add_argument("args", nargs=argparse.REMAINDER, help="its arguments, as it expects them")
    r.set_defaults(run=_run)
    s = commands.add_parser(
        "snapshots", help="list or remove the snapshot segments on this host",
        description="flatshard.Snapshots keeps each rank's state in /dev/shm; a finished run "
        "removes its segments, a crashed job that is not restarted leaves them. `list` shows "
        "each segment's job, rank, size and the steps it holds; `remove --job JOB` (or "
        "--all) removes them.")
    s.add_argument("action", choices=["list", "remove"], nargs="?", default="list")
    s.add_argument("--job", help="only this job's segments (torchrun's run id, or the job= "
                   "name given to Snapshots)")
    s.add_argument("--all", action="store_true", help="remove: every job's segments")
    s.set_defaults(run=_snapshots)
    return parser


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        program = args.run(args)
    except (ConfigError, OSError) as e:  # a bad argument or file: the message names it
        parser.exit(1, f"{parser.prog} {args.command}: error: {e}\n")
    if program is not None:  # `run`: the program's own errors are its own, traceback and all
        program()


if __name__ == "__main__":
    sys.exit(main())
