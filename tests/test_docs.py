"""Docs cannot drift: every python block in README.md and docs/*.md runs here
(under torchrun on 2 ranks when it uses torch.distributed: one launch for
all of them, each its own program), the README opens with exactly two
commands, and the demo they run works.

A block (python or bash) whose first line is `# needs: NAME[, NAME]` is the
code of a framework the test extras do not install (docs/frameworks.md): it
runs where every NAME imports, and is reported as skipped, naming it,
elsewhere."""
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def blocks(path, lang):
    text = open(path).read()
    return re.findall(r"```" + lang + r"\n(.*?)```", text, flags=re.S)


# reference.md is generated (signatures, not programs); test_reference.py
# checks it against the code.
SNIPPETS = [(os.path.relpath(p, ROOT), i, code) for p in DOCS if not p.endswith("reference.md")
            for i, code in enumerate(blocks(p, "python"))]


def needed(code):
    """The package names a block's `# needs:` first line names."""
    first = code.lstrip("\n").split("\n", 1)[0]
    m = re.fullmatch(r"#\s*needs:\s*(.+)", first.strip())
    return [name.strip() for name in m.group(1).split(",")] if m else []


def needs(code):
    """Skip unless the packages the block's `# needs:` line names import."""
    for name in needed(code):
        pytest.importorskip(name, reason=f"the block needs {name}, not installed")


def torchrun(args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2"] + args, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# (a block whose framework is not installed is skipped, not launched)
DISTRIBUTED = [s for s in SNIPPETS if "torch.distributed" in s[2] and
               all(importlib.util.find_spec(n) is not None for n in needed(s[2]))]


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory):
    """Every snippet that uses torch.distributed, run on 2 ranks by one
    torchrun launch (tests/snippet_runner.py: one forked program per
    snippet): -> (the folder of their logs and exit statuses, the launch)."""
    d = tmp_path_factory.mktemp("snippets")
    jobs = []
    for k, (_, _, code) in enumerate(DISTRIBUTED):
        script = d / f"snippet{k}.py"
        script.write_text(code)
        jobs.append((f"snippet{k}", [str(script)]))
    return d, run_in_one_launch(d, jobs)


def run_in_one_launch(d, jobs, timeout=600):
    """jobs: [(name, [script, args...])] run by tests/snippet_runner.py under
    one torchrun launch on 2 ranks; their logs and statuses land in `d`."""
    spec = d / "jobs.json"
    spec.write_text(json.dumps({"out": str(d), "jobs": jobs}))
    return torchrun([os.path.join(ROOT, "tests", "snippet_runner.py"), str(spec)],
                    timeout=timeout)


def one_launch_result(d, proc, name):
    """(rank 0's output + rank 1's) of job `name`; asserts both exited 0."""
    out = []
    for rank in range(2):
        rc, log = (d / f"{name}.rank{rank}.{ext}" for ext in ("rc", "log"))
        assert rc.exists(), f"rank {rank} never ran {name}:\n{proc.stdout}{proc.stderr}"
        assert rc.read_text() == "0", f"rank {rank}: {rc.read_text()}\n{log.read_text()}"
        out.append(log.read_text())
    return "".join(out)


# The first distributed one sets up distributed_runs, whose launch has 600 s: a
# deadline beyond it (conftest.py), so that the launch's own timeout speaks first.
@pytest.mark.deadline(900)
@pytest.mark.parametrize("path,index,code", SNIPPETS,
                         ids=[f"{p}[{i}]" for p, i, _ in SNIPPETS])
def test_snippet_runs(path, index, code, tmp_path, request):
    needs(code)
    if "torch.distributed" not in code:
        script = tmp_path / "snippet.py"
        script.write_text(code)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    d, proc = request.getfixturevalue("distributed_runs")
    one_launch_result(d, proc, f"snippet{DISTRIBUTED.index((path, index, code))}")


def test_readme_opens_with_two_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    head = text.split("## ")[0]
    cmds = blocks_in(head, "bash")
    assert len(cmds) == 2
    assert "torchrun" in cmds[0] and "examples/train_small.py" in cmds[0]
    assert "pytest" in cmds[1]
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "python3 -m pytest -q tests" in ci and '".[test]"' in ci


def blocks_in(text, lang):
    return [b.strip() for b in re.findall(r"```" + lang + r"\n(.*?)```", text, flags=re.S)]


def test_demo_trains_and_reports():
    proc = torchrun([os.path.join("examples", "train_small.py"), "--steps", "4", "--seq", "16"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert "tokens/s" in out
    rows = re.findall(r"^\s+(\d)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+0\s+([\d,]+)\s+([\d,]+)$",
                      out, flags=re.M)
    assert [r[0] for r in rows] == ["0", "1"]  # both ranks, nothing left unsharded
    for r in rows:  # resident memory beside the logical bytes, within its peak
        resident, peak = (int(x.replace(",", "")) for x in r[4:])
        assert 0 < resident <= peak


def shell_commands():
    """Every command in README.md and docs/*.md, except the README's two
    install-and-run commands (the demo test above and CI run those) and the
    guide's (tests/test_guide.py runs them and checks their output)."""
    out = []
    for path in DOCS:
        if path.endswith("guide.md"):
            continue
        cmds = blocks_in(open(path).read(), "bash")
        if path.endswith("README.md"):
            cmds = cmds[2:]
        out += [(os.path.relpath(path, ROOT), c) for c in cmds]
    return out


COMMANDS = shell_commands()


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A real sharded checkpoint, for commands that take CKPT_DIR."""
    d = tmp_path_factory.mktemp("ckpt")
    proc = torchrun([os.path.join("examples", "train_gpt.py"), "--steps", "1", "--seq", "8",
                     "--batch", "2", "--ckpt-every", "1", "--ckpt-dir", str(d)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return d


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[f"{p}:{c.split()[2] if len(c.split()) > 2 else c}"
                                                    for p, c in COMMANDS])
def test_command_runs(path, cmd, tmp_path, request):
    needs(cmd)
    if "CKPT_DIR" in cmd:
        cmd = cmd.replace("CKPT_DIR", str(request.getfixturevalue("ckpt_dir")))
    for name in ("examples", "benchmarks"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")  # commands may write there
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # python and torchrun are this interpreter's (the leg under test)
    script = "set -e\n" + re.sub(
        r"(^|[;&|(]\s*)(python3?|torchrun)(?=\s)",
        lambda m: m.group(1) + sys.executable + (" -m torch.distributed.run"
                                                 if m.group(2) == "torchrun" else ""),
        cmd, flags=re.M)
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
