"""Every command in docs/guide.md runs, and what it prints holds: the
planner's model-state prediction equals each rank's measured bytes, and the
stages shard what the guide says they shard."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from test_docs import one_launch_result, run_in_one_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "guide.md")
COMMANDS = [c.strip() for c in re.findall(r"```bash\n(.*?)```", open(GUIDE).read(), flags=re.S)]


# Short runs: the guide's figures do not depend on the step count.
SHORT = ["--steps", "2", "--seq", "32"]


def _job(cmd):
    """A guide command's torchrun -> (its name, [script, args...])."""
    argv = shlex.split(cmd)
    assert argv[:3] == ["torchrun", "--nproc-per-node", "2"], cmd  # the launch runs 2 ranks
    return cmd.split("--stage ")[-1].split()[0], argv[3:] + SHORT


@pytest.fixture(scope="module")
def torchrun_outputs(tmp_path_factory):
    """Every torchrun command of the guide, run by one torchrun launch
    (tests/snippet_runner.py: each command its own program on 2 ranks)."""
    d = tmp_path_factory.mktemp("guide")
    jobs = [_job(c) for c in COMMANDS if c.startswith("torchrun")]
    return d, run_in_one_launch(d, jobs)


def run(cmd, request):
    if cmd.startswith("torchrun"):
        d, proc = request.getfixturevalue("torchrun_outputs")
        return one_launch_result(d, proc, _job(cmd)[0])
    argv = shlex.split(cmd)
    assert argv[0] == "python", cmd
    argv = [sys.executable] + argv[1:] + SHORT
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def lines_of(out, rank):
    block = out.split(f"flatshard memory, rank {rank}:")[1].split("rank ")[0]
    return {m[0]: (int(m[1].replace(",", "")), int(m[2].replace(",", "")), m[3])
            for m in re.findall(r"^\s+(\w[\w ]*?)\s+([\d,]+)\s+([\d,]+)\s+(\w+)", block,
                                flags=re.M)}


# The first test sets up torchrun_outputs, whose launch has 600 s (test_docs.py):
# a deadline beyond it (conftest.py), so that the launch's own timeout speaks first.
@pytest.mark.deadline(900)
@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.split("--stage ")[-1] for c in COMMANDS])
def test_guide_command(cmd, request):
    out = run(cmd, request)
    assert "MISMATCH" not in out
    stage = cmd.split("--stage ")[-1].split()[0]
    if stage == "single":
        assert "collectives 0 B per step" in out
        return
    for rank in (0, 1):
        got = lines_of(out, rank)
        for k in ("params", "grads", "optim"):
            assert got[k][0] == got[k][1] and got[k][2] == "ok", (k, got[k])
    one = lines_of(out, 0)
    shard = one["params"][1]  # what the optimizer updates: the whole tensor under DDP
    if stage in ("ddp",):
        assert one["grads"][1] == shard and one["optim"][1] > 2 * shard
    if stage == "zero1":  # whole gradients, sharded optimizer state
        assert one["grads"][1] == 2 * shard and one["optim"][1] < 2 * one["grads"][1]
    if stage in ("zero2", "zero3", "bf16", "checkpointing", "cpu_offload"):
        assert one["grads"][1] == shard and one["optim"][1] > 2 * shard - 64
    if stage == "disk_offload":
        assert one["optim"][1] < 1024  # only the step counters stay in memory
