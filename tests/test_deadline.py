"""The per-test deadline (deadline.py), run in a pytest of its own in a
temporary folder, registered by a conftest.py as tests/conftest.py does:
a test past its deadline ends the run with every thread's stack; tests
within theirs pass, each with a deadline of its own; the marker gives a
longer one; a fork inside a test leaves a child that exits; the multi-rank
pool's ranks end with a run that its deadline ends; a deadline that is not
a number of seconds stops the run before any test."""
import os
import signal
import subprocess
import sys
import time

import deadline

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

CONFTEST = """\
import deadline


def pytest_configure(config):
    config.pluginmanager.register(deadline, "flatshard-test-deadline")
"""

SLEEPS_PAST = """\
import threading
import time


def test_sleeps_past_the_deadline():
    threading.Thread(target=time.sleep, args=(300,), name="helper", daemon=True).start()
    time.sleep(300)
"""

# Each test is well within the run's 3 s deadline, all of them together are
# not: the run passes only if each test has a deadline of its own.
WITHIN = """\
import faulthandler
import os
import signal
import time

import pytest


@pytest.mark.parametrize("n", range(3))
def test_sleeps_within_its_deadline(n):
    time.sleep(1.2)


@pytest.mark.deadline(120)
def test_marked_long_sleeps_past_the_runs_deadline():
    time.sleep(3.5)


def test_a_forked_child_exits():
    pid = os.fork()
    if pid == 0:
        # What the interpreter's exit does in a child (and a deadline set or
        # cleared there): with the parent's timer inherited, it would wait
        # forever for a watchdog thread that the child does not have.
        faulthandler.cancel_dump_traceback_later()
        os._exit(0)
    for _ in range(40):  # 2 s at most, within the run's deadline
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
"""

# The pool's ranks start before any test (outside every deadline) and say
# who they are; then the one test hangs in a job the ranks are running (so
# that no rank reads its pipe, which would tell it the parent went away).
POOL_CONFTEST = CONFTEST + """
import os

from dist_pool import get_pool


def pytest_sessionstart(session):
    with open("pids.txt", "w") as f:
        f.write(" ".join(str(pid) for pid in get_pool(2).run(os.getpid)))
"""

HANGS = """\
import time

from dist_pool import get_pool


def test_hangs_in_a_job_of_the_ranks():
    get_pool(2).run(time.sleep, 300, timeout=300)
"""

RUN_TIMEOUT_S = 240  # this test's own bound on each pytest it starts (a pool's start-up)


def _pytest(tmp_path, test_code, deadline_s, conftest=CONFTEST):
    """pytest in a new process on one test file in tmp_path (its own rootdir
    and ini, no cache, its temporary files there too),
    FLATSHARD_TEST_DEADLINE_S=deadline_s -> the process."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_tiny.py").write_text(test_code)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"), PYTHONPATH=os.pathsep.join(
        [TESTS_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env[deadline.ENV] = str(deadline_s)
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):  # the caller's options are not its
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_tiny.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)


def test_a_test_past_its_deadline_ends_the_run_with_every_threads_stack(tmp_path):
    proc = _pytest(tmp_path, SLEEPS_PAST, 1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    # on pytest's own stderr although pytest captures the test's output
    assert "Timeout (0:00:01)!" in proc.stderr, out
    assert 'test_tiny.py", line 7 in test_sleeps_past_the_deadline' in proc.stderr, out
    assert proc.stderr.count("(most recent call first)") >= 2, out  # the helper thread too
    assert "passed" not in out, out


def test_tests_within_their_deadlines_pass(tmp_path):
    proc = _pytest(tmp_path, WITHIN, 3)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "5 passed" in proc.stdout, out
    assert "Timeout" not in out, out


def test_a_deadline_that_is_not_a_number_of_seconds_stops_the_run(tmp_path):
    for bad in ("soon", "-1", "inf", "nan"):
        proc = _pytest(tmp_path, WITHIN, bad)
        assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
        assert (f"{deadline.ENV}={bad!r}: expected a number of seconds, 0 or more"
                in proc.stderr), proc.stderr
        assert "passed" not in proc.stdout, proc.stdout


def _alive(pid):
    """Whether process pid runs (a zombie, which nobody may reap here, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_pools_ranks_end_with_a_run_past_its_deadline(tmp_path):
    pid_file = tmp_path / "pids.txt"
    try:
        proc = _pytest(tmp_path, HANGS, 2, conftest=POOL_CONFTEST)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "Timeout (0:00:02)!" in proc.stderr, out
        pids = [int(pid) for pid in pid_file.read_text().split()]
        assert len(pids) == 2, pids
        for _ in range(200):  # the kernel's SIGKILL as their parent ends; 10 s at most
            if not any(_alive(pid) for pid in pids):
                break
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids), pids
    finally:  # ranks that outlived the run are this test's to end
        for pid in (pid_file.read_text().split() if pid_file.exists() else []):
            if _alive(int(pid)):
                os.kill(int(pid), signal.SIGKILL)
