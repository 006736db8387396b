"""Two hosts on one machine: two network namespaces joined by a veth pair
whose bandwidth `tc` limits, two ranks in each, torch's gloo process group
across them; FULL_SHARD and HSDP side by side on a link-bound model.

    sudo python3 benchmarks/netbed.py [--rates 1gbit,10gbit] [--delay-ms 0]
        [--configs FULL_SHARD,HSDP] [--backend auto[,torch]] [--quant off[,int8,int8+int4]]
        [--dim 512 --blocks 4 --batch 8 --steps 8] [--timeout 300]

Needs root, `ip` and `tc` (Debian's iproute2). What it touches, and only
that [Note: bed isolation]:
  * two namespaces named fsbed<pid>a / fsbed<pid>b, and a veth pair whose
    ends are created inside them (fsb<pid>a in a, fsb<pid>b in b): the
    host's own namespace never holds either end, so its interfaces, routes
    and addresses are not changed;
  * a /30 in 10.213.0.0/16 that no route or address of the host's
    namespace overlaps (checked), one address per end;
  * a tc qdisc on each end (tbf at the rate, under a netem delay with
    --delay-ms), so each direction is limited.
The namespaces hold nothing but `lo` (up) and their end of the pair, so a
rank can reach only the other namespace's address and its own: there is no
route to any other address. Every run is bounded (--timeout; a rank that
fails ends the others), and the namespaces (with the veth pair) are
deleted in `finally`, on SIGINT/SIGTERM/SIGHUP, and at the start of a later
run for beds whose pid is gone (a SIGKILLed run).

Ranks 0,1 run in namespace a (host "neta"), 2,3 in b ("netb"); MASTER_ADDR
is a's address. Each rank runs in its own UTS namespace with its host's
name, so flatshard's comm_backend="auto" sees two hosts: HSDP's shard group
(the two ranks of a host) uses the shm backend, every group that spans the
hosts (FULL_SHARD's, HSDP's replicate groups) the gloo process group, as
on a real cluster. --backend torch runs every group through gloo instead
(--backend auto,torch: both, side by side).

Printed per link rate and configuration: the median step time (the slowest
rank's, from a barrier to a barrier), the bytes that crossed the link per
step (both directions, the kernel's counters of the veth ends: collectives
and the step's two barriers), the link's share of the step ("link s": the
busier direction's bytes at the rate one TCP stream measured on the link
just before; a step near it is link-bound), the engine's own count where
flatshard reports one, and the loss of each step. --quant
int8 / int8+int4 need flatshard.CommQuant (quantized collectives).
"""
import argparse
import atexit
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PREFIX = "fsbed"            # namespace names: fsbed<pid>a, fsbed<pid>b
POOL = ipaddress.ip_network("10.213.0.0/16")
PORT = 29500                # inside namespace a: nothing else listens there
RATE = re.compile(r"^[0-9]+(\.[0-9]+)?(kbit|mbit|gbit)$")
QUANTS = ("off", "int8", "int8+int4")
STRATEGIES = ("FULL_SHARD", "HSDP")


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True,
                          timeout=30)


def bed_available():
    """'' when this process can make a bed, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2 / util-linux)"
    return ""


def used_networks():
    """Every IPv4 network the host's namespace routes or holds an address in."""
    nets = []
    routes = json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]")
    for r in routes:
        if r.get("dst") not in (None, "default"):
            nets.append(ipaddress.ip_network(r["dst"], strict=False))
    for link in json.loads(_ip("-j", "-4", "addr").stdout or "[]"):
        for a in link.get("addr_info", []):
            nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return nets


def free_subnet(pid):
    """A /30 of POOL that overlaps nothing the host uses (started from the pid,
    so beds of different runs differ)."""
    used = used_networks()
    subs = list(POOL.subnets(new_prefix=30))
    for i in range(len(subs)):
        net = subs[(pid + i) % len(subs)]
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError(f"netbed: every /30 of {POOL} overlaps a route or address of this host")


def rate_bytes(rate):
    """'1gbit' -> bytes per second."""
    n, unit = re.match(r"^([0-9.]+)([kmg])bit$", rate).groups()
    return float(n) * {"k": 1e3, "m": 1e6, "g": 1e9}[unit] / 8


def remove_stale():
    """Delete beds left by runs whose process is gone (SIGKILLed): only
    namespaces with this script's prefix and a pid that no longer exists."""
    out = _ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({PREFIX}(\d+)[ab])\b", out, re.M):
        if not os.path.exists(f"/proc/{name[1]}"):
            _ip("netns", "del", name[0], check=False)


class NetBed:
    """The two namespaces and their link, made on enter and removed on exit.
    [Note: bed isolation] in the module docstring says what it touches."""

    def __init__(self, rate="1gbit", delay_ms=0.0):
        self.pid = os.getpid()
        self.ns = [f"{PREFIX}{self.pid}a", f"{PREFIX}{self.pid}b"]
        self.ifname = [f"fsb{self.pid}a", f"fsb{self.pid}b"]
        self.hosts = ["neta", "netb"]
        self.rate, self.delay_ms = rate, delay_ms
        self.addr, self.net = [], None
        self.procs = []
        self._made = False

    # ---- make and remove
    def __enter__(self):
        self._old = {}
        if threading.current_thread() is threading.main_thread():  # where Python allows it
            self._old = {s: signal.signal(s, self._on_signal)
                         for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        atexit.register(self.close)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _on_signal(self, signum, frame):
        raise SystemExit(f"netbed: signal {signum}")  # unwinds through close()

    _live = set()  # the pids whose bed is up: the names are per process

    def _make(self):
        if self.pid in NetBed._live:  # its names are another live bed's: never delete them
            raise RuntimeError("netbed: this process already has a bed up; one at a time")
        NetBed._live.add(self.pid)
        self._owner = True
        remove_stale()
        net = free_subnet(self.pid)
        self.net = net
        hosts = list(net.hosts())
        self.addr = [str(hosts[0]), str(hosts[1])]
        self._made = True  # from here on close() deletes, whatever got made
        for ns in self.ns:
            _ip("netns", "add", ns)
        # Both ends are created inside their namespaces: never in the host's.
        _ip("link", "add", self.ifname[0], "netns", self.ns[0], "type", "veth",
            "peer", "name", self.ifname[1], "netns", self.ns[1])
        for ns, dev, addr in zip(self.ns, self.ifname, self.addr):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        self.set_link(self.rate, self.delay_ms)

    def set_link(self, rate, delay_ms=0.0):
        """Limit each direction to `rate` (tc syntax: 1gbit, 500mbit), with a
        netem delay of delay_ms on each end when > 0."""
        if not RATE.match(rate):
            raise ValueError(f"netbed: rate {rate!r}: expected a number and kbit/mbit/gbit")
        self.rate, self.delay_ms = rate, delay_ms
        # burst: 1 ms at the rate, at least two 64 KiB GSO packets
        burst = max(2 * 65536, int(rate_bytes(rate) / 1000))
        for ns, dev in zip(self.ns, self.ifname):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)  # none yet is fine
            tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "200ms"]
            if delay_ms > 0:
                self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                         "delay", f"{delay_ms}ms", "limit", "100000")
                self._tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
            else:
                self._tc(ns, "qdisc", "add", "dev", dev, "root", *tbf)

    @staticmethod
    def _tc(ns, *args):
        p = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)
        if p.returncode:
            hint = ""
            if "netem" in args and "unknown" in p.stderr.lower():
                hint = "; this kernel has no netem qdisc, so --delay-ms must be 0 here"
            raise RuntimeError(f"netbed: tc {' '.join(args)}: {p.stderr.strip()}{hint}")

    def close(self):
        """Kill what the bed started, delete its namespaces (and so the veth
        pair); safe to call twice. Restores the signal handlers."""
        self.kill()
        if self._made:
            for ns in self.ns:
                _ip("netns", "del", ns, check=False)
            self._made = False
        if getattr(self, "_owner", False):
            NetBed._live.discard(self.pid)
            self._owner = False
        for s, h in getattr(self, "_old", {}).items():
            signal.signal(s, h)
        self._old = {}

    def leftovers(self):
        """The namespaces and links of this bed that still exist (empty after close)."""
        names = set(re.findall(r"^(\S+)", _ip("netns", "list", check=False).stdout, re.M))
        links = _ip("-br", "link", check=False).stdout
        return sorted(n for n in self.ns if n in names) + \
            [d for d in self.ifname if re.search(rf"^{d}\b", links, re.M)]

    # ---- run
    def rank_env(self, rank, world=4):
        host = rank * 2 // world
        return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % (world // 2)),
                    LOCAL_WORLD_SIZE=str(world // 2), MASTER_ADDR=self.addr[0],
                    MASTER_PORT=str(PORT), NETBED_IFNAME=self.ifname[host],
                    NETBED_HOST=self.hosts[host], OMP_NUM_THREADS="1")

    def run(self, argv, world=4, timeout=300, env=None):
        """argv (a command) in `world` ranks, the first half in namespace a,
        each in its own UTS namespace. -> [(returncode, output)] by rank.
        Ends every rank when one fails or the timeout passes."""
        logs = []
        for rank in range(world):
            e = dict(os.environ, **(env or {}), **self.rank_env(rank, world))
            log = tempfile.TemporaryFile(mode="w+")
            cmd = ["ip", "netns", "exec", self.ns[rank * 2 // world], "unshare", "--uts",
                   "--", *argv]
            self.procs.append(subprocess.Popen(cmd, env=e, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))
            logs.append(log)
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            while True:
                codes = [p.poll() for p in self.procs]  # every rank's, each time
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.1)
        finally:
            self.kill()
        out = []
        for p, log in zip(self.procs, logs):
            log.seek(0)
            text = log.read()
            log.close()
            if timed_out and p.returncode != 0:
                text += f"\nnetbed: ended after the {timeout} s timeout"
            out.append((p.returncode, text))
        self.procs = []
        return out

    def kill(self):
        """SIGKILL every rank this bed started (each leads its own session),
        and wait for them."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


LINK_CHECK = """
import os, socket, sys, time
n, port = int(sys.argv[1]), int(sys.argv[2])
if os.environ["RANK"] == "0":
    srv = socket.create_server((os.environ["MASTER_ADDR"], port))
    conn, _ = srv.accept()
    got, start = 0, None
    while got < n:
        b = conn.recv(1 << 20)
        if not b:
            break
        start = start or time.perf_counter()
        got += len(b)
    print(f"MBPS {got / (time.perf_counter() - start) / 1e6:.1f}")
else:
    for _ in range(100):
        try:
            s = socket.create_connection((os.environ["MASTER_ADDR"], port))
            break
        except OSError:
            time.sleep(0.05)
    buf = bytes(1 << 20)
    for _ in range(n >> 20):
        s.sendall(buf)
    s.close()
"""


def link_check(bed, nbytes=48 << 20, timeout=60):
    """MB/s one TCP stream gets from namespace b to a (what tc lets through)."""
    outs = bed.run([sys.executable, "-c", LINK_CHECK, str(nbytes), str(PORT + 1)], world=2,
                   timeout=timeout)
    m = re.search(r"MBPS ([0-9.]+)", outs[0][1])
    if any(rc != 0 for rc, _ in outs) or not m:
        raise RuntimeError(f"netbed: the link check failed: {outs}")
    return float(m.group(1))


def job_spec(configs, quants, dim, blocks, batch, steps, seed=0, lr=0.05, backends=("auto",)):
    """What netbed_job.py trains: every (strategy, backend, quant), in turn."""
    return dict(configs=[dict(strategy=s, backend=b, quant=q) for s in configs
                         for b in backends for q in quants],
                dim=dim, blocks=blocks, batch=batch, steps=steps, seed=seed, lr=lr, world=4)


def run_job(bed, spec, timeout):
    """spec on the bed's four ranks -> the ranks' results, or an error naming
    the rank that failed, with its output."""
    with tempfile.TemporaryDirectory(prefix="netbed-") as tmp:
        path = os.path.join(tmp, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        os.chmod(tmp, 0o755)
        outs = bed.run([sys.executable, os.path.join(HERE, "netbed_job.py"), path, tmp],
                       timeout=timeout, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        bad = [(r, rc, text) for r, (rc, text) in enumerate(outs) if rc != 0]
        if bad:
            first = min(bad, key=lambda b: b[1] in (-9, None))  # a rank that failed itself
            raise RuntimeError(f"netbed: rank {first[0]} exited {first[1]}:\n{first[2][-4000:]}")
        results = []
        for r in range(4):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                results.append(json.load(f))
        return results


def summarize(results, warmup=1):
    """Rank results -> per configuration: median step s after `warmup`
    steps, link bytes per step (both hosts), engine counts, losses."""
    rows = []
    for i, cfg in enumerate(results[0]["configs"]):
        times = [max(r["configs"][i]["times"][s] for r in results)
                 for s in range(len(cfg["times"]))]
        link = [sum(r["configs"][i]["link_tx"][s] for r in results)
                for s in range(len(cfg["times"]))]
        busiest = [max(r["configs"][i]["link_tx"][s] for r in results)  # one direction
                   for s in range(len(cfg["times"]))]
        engine = {}
        for r in results:
            for k, v in r["configs"][i]["engine_sent"].items():
                engine[k] = engine.get(k, 0) + v
        rows.append(dict(strategy=cfg["strategy"], quant=cfg["quant"], backend=cfg["backend"],
                         backends=cfg["backends"],
                         step_s=statistics.median(times[warmup:] or times),
                         link_bytes=statistics.median(link[warmup:] or link),
                         busiest_bytes=statistics.median(busiest[warmup:] or busiest),
                         engine=engine, losses=cfg["losses"]))
    return rows


def _uptime():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--configs", default=",".join(STRATEGIES))
    ap.add_argument("--quant", default="off")
    ap.add_argument("--backend", default="auto",
                    help="comma list; auto: shm inside a host, gloo across; torch: gloo "
                    "everywhere")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    why = bed_available()
    if why:
        ap.error(f"the bed {why}")
    rates = [r for r in a.rates.split(",") if r]
    bad = [r for r in rates if not RATE.match(r)]
    if bad:
        ap.error(f"--rates: {bad}: expected e.g. 1gbit, 10gbit, 500mbit")
    configs = [c for c in a.configs.split(",") if c]
    if not configs or any(c not in STRATEGIES for c in configs):
        ap.error(f"--configs: expected a comma list of {', '.join(STRATEGIES)}")
    quants = [q for q in a.quant.split(",") if q]
    if not quants or any(q not in QUANTS for q in quants):
        ap.error(f"--quant: expected a comma list of {', '.join(QUANTS)}")
    if any(q != "off" for q in quants):
        import flatshard
        if not hasattr(flatshard, "CommQuant"):
            ap.error("--quant int8 / int8+int4 need flatshard.CommQuant (quantized "
                     "collectives), which this flatshard does not have; use --quant off")
    backends = [b for b in a.backend.split(",") if b]
    if not backends or any(b not in ("auto", "torch") for b in backends):
        ap.error("--backend: expected a comma list of auto, torch")
    sys.path.insert(0, HERE)
    from harness import cpu_name
    spec = job_spec(configs, quants, a.dim, a.blocks, a.batch, a.steps, backends=backends)
    params = a.blocks * (8 * a.dim ** 2 + 5 * a.dim) + a.dim ** 2 + a.dim
    print("command: python3 " + " ".join(shlex.quote(x) for x in sys.argv))
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; 4 ranks on 2 hosts (network namespaces), "
          f"gloo across; model {params:,} fp32 parameters "
          f"({a.blocks} blocks of dim {a.dim}), batch {a.batch} per rank, SGD+momentum, "
          f"{a.steps} steps (first not counted)")
    try:
        bed = measure(a, rates, spec)
    except RuntimeError as e:  # the bed is removed by then; its reason is the message
        sys.exit(str(e))
    left = bed.leftovers()
    if left:
        sys.exit(f"netbed: not removed: {left}")
    print("\nbed removed: no namespace or link of it remains")


def measure(a, rates, spec):
    """Every rate in turn on one bed: the link check, then the job; prints
    the tables. -> the (closed) bed."""
    with NetBed(rates[0], a.delay_ms) as bed:
        print(f"bed: {bed.ns[0]} {bed.addr[0]} <-> {bed.ns[1]} {bed.addr[1]}, "
              f"delay {a.delay_ms} ms each way")
        for rate in rates:
            bed.set_link(rate, a.delay_ms)
            mbps = link_check(bed)
            load0 = _uptime()
            rows = summarize(run_job(bed, spec, a.timeout))
            print(f"\n== link {rate}: one TCP stream measured {mbps:.0f} MB/s (limit "
                  f"{rate_bytes(rate) / 1e6:.0f}); load average {load0} before, {_uptime()} "
                  "after ==")
            base = rows[0]["step_s"]
            print("| config | comm_backend | quant | backends (shard, replicate) | median step s "
                  "| x first | link MB/step | link s/step | engine sent MB/step | losses |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                eng = ", ".join(f"{k} {v / a.steps / 1e6:.2f}" for k, v in r["engine"].items())
                print(f"| {r['strategy']} | {r['backend']} | {r['quant']} | "
                      f"{', '.join(map(str, r['backends']))} | "
                      f"{r['step_s']:.3f} | "
                      f"{r['step_s'] / base:.2f} | {r['link_bytes'] / 1e6:.1f} | "
                      f"{r['busiest_bytes'] / 1e6 / mbps:.3f} | {eng or '-'} | "
                      + " ".join(f"{x:.6f}" for x in r["losses"]) + " |")
    return bed


if __name__ == "__main__":
    main()
