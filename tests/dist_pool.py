"""Persistent pools of CPU/gloo worker processes for multi-rank tests.

Spawning a process and importing torch costs seconds, and the test machine has
two cores, so each world size gets one pool of ranks that is started on first
use and reused by every test of the session::

    def _allreduce(x):                      # module level, so ranks can import it
        t = torch.tensor([x + dist.get_rank()])
        dist.all_reduce(t)
        return t.item()

    def test_allreduce(dist_pool):
        assert dist_pool(2).run(_allreduce, 1) == [3, 3]

``run`` sends ``(fn.__module__, fn.__qualname__, args, kwargs)`` to every rank;
each rank imports the module by name (``tests/`` is on its ``sys.path``), calls
the function with the default process group initialised and sends back the
result. Any failure -- an exception, a rank that dies, a rank that does not
answer within ``timeout`` -- raises ``AssertionError`` with every rank's story
and kills the pool, since its process group may be desynchronised; the next
``run`` starts a fresh one.

Each rank's stdout and stderr (C-level writes included) go to a log file; after
each ``run`` the parent copies what is new to its own stdout, prefixed with
``[rank N]``, so pytest shows it with the test that produced it. A failed
``run`` puts it in the error message instead, with a Python stack dump of every
rank that did not answer.
"""

import faulthandler
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
STARTUP_TIMEOUT = 120.0  # spawn + import torch + rendezvous, all ranks on 2 cores
# Once one rank has failed, the others usually wait in a collective for it
# forever; give them this long to report failures of their own, then give up.
GRACE_AFTER_FAILURE = 1.0
SHUTDOWN_TIMEOUT = 10.0

_ctx = multiprocessing.get_context("spawn")


# --------------------------------------------------------------------- worker --

def _log_path(workdir, rank):
    return os.path.join(workdir, f"rank{rank}.log")


def _die_with_parent():
    """Have the kernel SIGKILL this rank if pytest dies, even mid-collective."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _call(payload):
    """Runs one job; returns the pickled ("ok", result) or ("error", traceback)."""
    try:
        module_name, qualname, args, kwargs = pickle.loads(payload)
        fn = importlib.import_module(module_name)
        for attr in qualname.split("."):
            fn = getattr(fn, attr)
        # Pickling inside the try: an unpicklable result is this rank's error.
        return pickle.dumps(("ok", fn(*args, **kwargs)))
    except BaseException:  # pytest.fail/skip raise BaseException subclasses
        return pickle.dumps(("error", traceback.format_exc()))


def _worker_main(rank, world_size, workdir, conn):
    # Own process group, so that killing the pool also kills anything this rank
    # started (killpg), and a Ctrl-C aimed at pytest leaves cleanup to pytest.
    os.setpgrp()
    _die_with_parent()
    # Must happen before torch is imported; this module deliberately does not
    # import torch at top level, because spawn imports it to find this function.
    os.environ["OMP_NUM_THREADS"] = "1"
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    # Inherited fds 1 and 2 would point wherever pytest's capture pointed when
    # the pool started, so that later tests' output would be lost.
    log = os.open(_log_path(workdir, rank), os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True)  # a hung rank's prints still show
    # On SIGUSR1 (sent by the parent when this rank does not answer) dump the
    # Python stack to stderr; the C-level handler works even inside gloo.
    faulthandler.register(signal.SIGUSR1)

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # only allowed before any inter-op work started
            pass
        # A FileStore in the pool's private temp dir: no port to pick, and no
        # collision between pools of different sizes or successive restarts.
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store",
                                rank=rank, world_size=world_size)
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ok", None)))  # ready

    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:  # parent went away without saying goodbye
            break
        if payload == b"":  # shutdown request
            break
        reply = _call(payload)
        sys.stdout.flush()  # the parent reads the log once it has the reply
        sys.stderr.flush()
        conn.send_bytes(reply)
    dist.destroy_process_group()


# ----------------------------------------------------------------------- pool --

class DistPool:
    """``world_size`` ranks in worker processes, started on first ``run``."""

    def __init__(self, world_size):
        self.world_size = world_size
        self._procs = []  # index = rank
        self._conns = []
        self._workdir = None
        self._log_offsets = []  # how much of each rank's log has been shown

    def run(self, fn, *args, timeout=120, **kwargs):
        """Calls ``fn(*args, **kwargs)`` on every rank; returns results by rank.

        ``timeout`` counts from when all ranks have received the job, so a
        first call does not pay for the pool's startup.
        """
        if "<locals>" in fn.__qualname__ or fn.__module__ == "__main__":
            raise ValueError(f"{fn.__qualname__} must be a module-level function "
                             "of an importable module, so that ranks can import it")
        # Plain pickle, not multiprocessing's: torch registers a reducer there
        # that would pass tensors through shared memory and file descriptors.
        payload = pickle.dumps((fn.__module__, fn.__qualname__, args, kwargs))
        self._ensure_started()
        try:
            for conn in self._conns:
                try:
                    conn.send_bytes(payload)
                except OSError:  # rank died while idle; _collect reports it
                    pass
            return self._collect(f"{fn.__module__}.{fn.__qualname__}", timeout)
        except BaseException:  # also on Ctrl-C: never leave ranks mid-job
            self.kill()
            raise

    def pids(self):
        """The ranks' process ids, by rank (empty while the pool is down)."""
        return [p.pid for p in self._procs]

    def _ensure_started(self):
        if self._procs and all(p.is_alive() for p in self._procs):
            return
        self.kill()  # a rank died while idle: start over
        self._workdir = tempfile.mkdtemp(prefix=f"dist_pool{self.world_size}-")
        self._log_offsets = [0] * self.world_size
        for rank in range(self.world_size):
            open(_log_path(self._workdir, rank), "wb").close()
            parent_end, child_end = _ctx.Pipe()
            proc = _ctx.Process(target=_worker_main, name=f"dist_pool{self.world_size}-rank{rank}",
                                args=(rank, self.world_size, self._workdir, child_end),
                                # multiprocessing's atexit then kills ranks even if
                                # shutdown_all is never called; the price is that
                                # ranks cannot start multiprocessing children.
                                daemon=True)
            proc.start()
            child_end.close()  # so that a dead rank reads as EOF on parent_end
            self._procs.append(proc)
            self._conns.append(parent_end)
        try:
            self._collect("pool startup", STARTUP_TIMEOUT)
        except BaseException:
            self.kill()
            raise

    def _collect(self, what, timeout):
        """Waits for one reply per rank; returns the results by rank.

        Raises AssertionError on any failure. A rank that dies is noticed at
        once (its pipe reads EOF) rather than at the timeout.
        """
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        results = [None] * self.world_size
        errors = {}
        while pending:
            ready = multiprocessing.connection.wait(
                list(pending.values()), max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank in [r for r, conn in pending.items() if conn in ready]:
                try:
                    status, value = pickle.loads(pending.pop(rank).recv_bytes())
                except (EOFError, OSError):
                    self._procs[rank].join(timeout=5)
                    errors[rank] = f"died with exit code {self._procs[rank].exitcode}"
                except Exception:
                    errors[rank] = "sent a result that does not unpickle:\n" + traceback.format_exc()
                else:
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors[rank] = "raised:\n" + value
            if errors:
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE)
        if not errors and not pending:
            sys.stdout.write(self._new_output())
            return results
        lines = [f"dist_pool(world_size={self.world_size}): {what} failed"]
        for rank in sorted(errors):
            lines.append(f"--- rank {rank} {errors[rank]}")
        if pending:
            why = (f"within {GRACE_AFTER_FAILURE}s of another rank's failure" if errors
                   else f"within the {timeout}s timeout")
            lines.append(f"--- ranks {sorted(pending)} did not answer {why}; "
                         "their stacks are at the end of their output")
            self._dump_stacks(sorted(pending))
        lines.append("--- output of the ranks:\n" + (self._new_output() or "(none)"))
        raise AssertionError("\n".join(lines))

    def _new_output(self):
        """What the ranks wrote since the last call, each line prefixed by its rank."""
        lines = []
        for rank in range(self.world_size):
            with open(_log_path(self._workdir, rank), "rb") as f:
                f.seek(self._log_offsets[rank])
                data = f.read()
            self._log_offsets[rank] += len(data)
            lines += [f"[rank {rank}] {line}\n"
                      for line in data.decode(errors="replace").splitlines()]
        return "".join(lines)

    def _dump_stacks(self, ranks):
        """Makes hung ranks append their Python stacks to their logs."""
        sizes = {rank: os.path.getsize(_log_path(self._workdir, rank)) for rank in ranks}
        for rank in ranks:
            os.kill(self._procs[rank].pid, signal.SIGUSR1)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(
                os.path.getsize(_log_path(self._workdir, rank)) == size
                for rank, size in sizes.items()):
            time.sleep(0.01)
        time.sleep(0.1)  # let the dumps that have started finish

    def kill(self):
        """SIGKILLs every rank and whatever it started; the pool restarts on next run."""
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                proc.kill()  # exited, or not yet in its own process group
        self._reap()

    def shutdown(self):
        """Asks ranks to destroy their process group and exit; kills stragglers."""
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def _reap(self):
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


_pools = {}


def write_report(path, msg):
    """From a rank whose peer is made to die: the pool reports the death, not
    this rank's return value, so the result goes through a file."""
    with open(path, "w") as f:
        f.write(msg)


def read_report(path, wait_s=10.0):
    """The message written by write_report; the rank may still be writing
    when the pool gives up on its dead peer (a bounded wait: a report that
    never comes fails the test)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not (os.path.exists(path) and os.path.getsize(path)):
        time.sleep(0.1)
    with open(path) as f:
        return f.read()


def get_pool(world_size):
    """The session's pool for ``world_size`` (its processes start on first run)."""
    if world_size not in _pools:
        _pools[world_size] = DistPool(world_size)
    return _pools[world_size]


def shutdown_all():
    for pool in _pools.values():
        pool.shutdown()
    _pools.clear()
