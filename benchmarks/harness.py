"""What the benchmark scripts share around their measurements: a free TCP port
for the ranks' rendezvous, and the CPU's name to print beside every figure.
Imported by the scripts as `harness` (their folder is first on sys.path when
run as `python3 benchmarks/<script>.py`)."""
import socket


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name():
    """The CPU's model name from /proc/cpuinfo ("unknown CPU" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f
                         if ln.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"
