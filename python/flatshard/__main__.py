"""flatshard's command line: `python -m flatshard COMMAND ...`, one subcommand
per tool (`consolidate`, `doctor`, `plan`); each adds a parser and a function below."""
import argparse
import os
import sys


def _consolidate(args):
    from .consolidate import consolidate
    out = consolidate(args.in_dir, args.out_path, fmt=args.format, overwrite=args.force)
    print(f"flatshard: wrote {out} ({os.path.getsize(out):,} bytes)")


def doctor_report():
    """What this installation was built with and can run, one line each."""
    import platform

    import torch

    from . import __version__, _C
    from .cuda_nccl import describe as cuda_line
    try:
        from . import _C_cuda  # noqa: F401  (built only where nvcc was found)
        cuda_built = "yes"
    except ImportError:
        cuda_built = "no (none in this build)"
    shm = sys.platform.startswith("linux") and os.path.isdir("/dev/shm")
    nccl = "nccl (units on CUDA devices)" if cuda_built == "yes" else \
        "nccl (not built: no nvcc at install)"
    return [
        f"flatshard {__version__}",
        f"python {platform.python_version()}, torch {torch.__version__}",
        f"CPU SIMD: optimizers {_C.simd_level()}, reductions "
        f"{'avx2' if _C.simd_level() == 'avx512' else _C.simd_level()}",
        f"collective backends: torch (any process group), "
        f"shm ({'available' if shm else 'not available: needs Linux /dev/shm'}), {nccl}",
        f"CUDA kernels built: {cuda_built}; torch sees CUDA: {torch.cuda.is_available()}",
        cuda_line(),
    ]


def _doctor(args):
    print("\n".join(doctor_report()))


def _parser():
    from .consolidate import FORMATS
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
    from .plan_report import add_parser as add_plan
    add_plan(commands)
    return parser


def main(argv=None):
    from .errors import ConfigError
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ConfigError, OSError) as e:  # a bad argument or file: the message names it
        parser.exit(1, f"{parser.prog} {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
