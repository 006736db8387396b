"""A deadline for every test, so that a hang fails the run with every
thread's stack instead of running into CI's limit (a pytest plugin;
conftest.py registers it, and test_deadline.py runs it in a pytest of its
own).

Each test's set-up, call and teardown together get
``FLATSHARD_TEST_DEADLINE_S`` seconds (default 600; ``0`` turns deadlines
off, as for a debugger session). A known-long test asks for more with
``@pytest.mark.deadline(SECONDS)``: it gets the larger of the two. Past
it, faulthandler's watchdog thread, which needs neither the GIL nor the
main thread's cooperation, writes the Python stack of every thread to the
stderr pytest started with (not to its capture, whose contents would be
lost) under a ``Timeout (H:MM:SS)!`` line, and ends the process with exit
status 1. It ends no other process: the multi-rank pool's ranks end with
pytest's process (dist_pool.py; test_deadline.py checks it), other
children a test starts need bounded waits of their own.

faulthandler has one such timer per process: pytest's own
``faulthandler_timeout`` setting, if set, would replace it. A child made by
``os.fork`` must not inherit an armed timer (its exit would wait forever
for the watchdog thread, which does not exist in the child), so the timer
is stopped before every fork and set again in the parent, for what is left
of the test's deadline.
"""

import faulthandler
import math
import os
import time

import pytest

ENV = "FLATSHARD_TEST_DEADLINE_S"
DEFAULT_S = 600.0

_stderr_fd = None  # a copy of the stderr pytest started with
_until = None  # the running test's deadline, time.monotonic()'s, while armed


def _seconds(raw, what):
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise pytest.UsageError(f"{what}: expected a number of seconds, 0 or more; "
                                f"got {raw!r}")
    return value


def default_s():
    """Every test's deadline in seconds (0: none), from the environment."""
    raw = os.environ.get(ENV, "")
    return DEFAULT_S if raw == "" else _seconds(raw, f"{ENV}={raw!r}")


def deadline_s(item):
    """This test's deadline in seconds (0: none)."""
    base = default_s()
    marker = item.get_closest_marker("deadline")
    if not base or marker is None:
        return base
    if len(marker.args) != 1 or marker.kwargs:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.deadline takes one argument, "
                                "the test's deadline in seconds")
    return max(base, _seconds(marker.args[0], f"{item.nodeid}: @pytest.mark.deadline"))


def _arm(seconds):
    faulthandler.dump_traceback_later(seconds, exit=True, file=_stderr_fd)


def _before_fork():
    if _until is not None:
        faulthandler.cancel_dump_traceback_later()


def _after_fork_in_parent():
    if _until is not None:
        _arm(max(_until - time.monotonic(), 0.01))


def _after_fork_in_child():
    global _until
    _until = None


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def pytest_configure(config):
    global _stderr_fd
    config.addinivalue_line(
        "markers", "deadline(seconds): this test's deadline, when longer than "
                   f"{ENV} (default {DEFAULT_S:.0f} s)")
    default_s()  # a bad value stops the run here, before any test
    # pytest_configure runs with pytest's capture suspended: fd 2 is the
    # stderr pytest was started with (pytest's faulthandler plugin relies on
    # the same).
    if _stderr_fd is None:
        _stderr_fd = os.dup(2)


def pytest_collection_modifyitems(session, config, items):
    for item in items:  # a malformed marker stops the run here, before any test
        deadline_s(item)


def pytest_unconfigure(config):
    global _stderr_fd
    if _stderr_fd is not None:
        os.close(_stderr_fd)
        _stderr_fd = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _until
    seconds = deadline_s(item)
    if seconds:
        _until = time.monotonic() + seconds
        _arm(seconds)
    try:
        yield
    finally:
        if seconds:
            _until = None
            faulthandler.cancel_dump_traceback_later()
