"""What every test relies on, set here rather than taken from the caller's
environment:

- one intra-op thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)), in
  pytest's process and the pool's ranks;
- the CPU optimizers' loop choices in a file of this run's
  (FLATSHARD_OPTIM_TUNE_CACHE), never the user's cache;
- the ``dist_pool`` fixture: multi-rank tests on a pool of worker processes
  (dist_pool.py), whose ``run`` fails a job that does not end within its
  ``timeout``;
- a deadline for every test (deadline.py): its set-up, call and teardown
  get FLATSHARD_TEST_DEADLINE_S seconds (default 600; 0: no deadline, as
  under a debugger), a test marked ``@pytest.mark.deadline(SECONDS)`` the
  larger of the two. Past it the run ends (exit status 1) with the Python
  stack of every thread of pytest's process on its stderr.
"""
import os
import sys

# The tests' tolerances assume one intra-op thread (reductions split across
# threads round differently), so they set it themselves rather than rely on
# the caller's environment. Before torch is imported, so that OpenMP reads it;
# the pool's ranks are spawned with this environment.
os.environ["OMP_NUM_THREADS"] = "1"
# The CPU optimizers' loop choices go to a file of this session's (the pool's
# ranks too), never to the user's cache; tests that check the file set their own.
import tempfile  # noqa: E402
os.environ["FLATSHARD_OPTIM_TUNE_CACHE"] = os.path.join(
    tempfile.mkdtemp(prefix="flatshard-tune-"), "optim_tune.txt")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# pytest's default "prepend" import mode already puts tests/ on sys.path; make
# sure of it (e.g. under --import-mode=importlib), because the pool's worker
# processes import dist_pool and the test modules by these plain names.
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import deadline  # noqa: E402
from dist_pool import get_pool, shutdown_all  # noqa: E402


def pytest_configure(config):
    config.pluginmanager.register(deadline, "flatshard-test-deadline")


@pytest.fixture(scope="session")
def dist_pool():
    """``dist_pool(world_size)`` -> the session's DistPool; see dist_pool.py."""
    return get_pool


def pytest_sessionfinish(session, exitstatus):
    shutdown_all()
