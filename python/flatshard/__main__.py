"""flatshard's command line: `python -m flatshard COMMAND ...`, one subcommand
per tool (`consolidate` so far); each adds a parser and a function below."""
import argparse
import os
import sys


def _consolidate(args):
    from .consolidate import consolidate
    out = consolidate(args.in_dir, args.out_path, fmt=args.format, overwrite=args.force)
    print(f"flatshard: wrote {out} ({os.path.getsize(out):,} bytes)")


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
