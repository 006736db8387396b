"""Runs several scripts under one torchrun launch, each as its own program.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/snippet_runner.py JOBS.json

JOBS.json: {"out": OUT_DIR, "jobs": [[name, [script, arg, ...]], ...]}.

Each rank imports torch and flatshard once, then forks one child per script,
in order; the children of all ranks run the script as `__main__` (argv, cwd,
sys.path[0] and environment as `torchrun script` gives them, but for the
store) and meet in their own process group: the script's
init_process_group rendezvouses on a fresh store that rank 0's child hosts,
on a port rank 0 publishes through torchrun's store, so no state passes from
one script to the next; each child exits as the script's process would. A
launch and its imports cost seconds per script on 2 cores; a fork costs
milliseconds.

Writes OUT_DIR/<name>.rank<r>.log (the child's stdout and stderr) and
OUT_DIR/<name>.rank<r>.rc: the exit status, "timeout" (killed past
SCRIPT_TIMEOUT_S) or "signal N"."""
import datetime
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback

import torch  # noqa: F401  (imported once here: what the fork saves)
import torch.distributed as dist

import flatshard  # noqa: F401

SCRIPT_TIMEOUT_S = 240.0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(argv, port, log):
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 hosts this script's store
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script` has it
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    # the child exits as the script's own process would (atexit handlers,
    # interpreter teardown with the script's process group threads)
    sys.exit(code)


def _wait(pid, deadline):
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return f"signal {os.WTERMSIG(status)}"
            return str(os.WEXITSTATUS(status))
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.02)


def main(spec):
    with open(spec) as f:
        spec = json.load(f)
    out_dir = spec["out"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=datetime.timedelta(seconds=60))
    for i, (name, argv) in enumerate(spec["jobs"]):
        key = f"snippet_runner/{i}/port"
        if rank == 0:
            store.set(key, str(_free_port()))
        port = int(store.get(key))
        stem = os.path.join(out_dir, name)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, port, f"{stem}.rank{rank}.log")
        rc = _wait(pid, time.monotonic() + SCRIPT_TIMEOUT_S)
        with open(f"{stem}.rank{rank}.rc", "w") as f:
            f.write(rc)


if __name__ == "__main__":
    main(sys.argv[1])
