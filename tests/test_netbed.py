"""The two-host bed (benchmarks/netbed.py): FULL_SHARD and HSDP on four ranks
in two network namespaces over a throttled veth pair train as plain torch
does in one process on the whole batch (the reference), HSDP's shard
groups use shm inside a host and gloo across; the bed leaves no namespace
or link behind, after a job, after a rank that fails, and after a SIGTERM;
inside it no route leads anywhere but the other namespace. Needs root and
iproute2; skipped otherwise."""
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(os.path.dirname(HERE), "benchmarks")
sys.path.insert(0, BENCH)

import netbed  # noqa: E402
import netbed_job  # noqa: E402

pytestmark = pytest.mark.skipif(bool(netbed.bed_available()),
                                reason=f"the bed {netbed.bed_available()}")
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
RTOL = 1e-5  # only the order of floating-point sums differs


def _reference(spec):
    """Plain torch, one process, the global batch: each step's loss."""
    model = netbed_job.build(spec)
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)
    losses = []
    for x, y in netbed_job.batches(spec):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_full_shard_and_hsdp_train_as_one_process_and_leave_nothing():
    spec = netbed.job_spec(["FULL_SHARD", "HSDP"], ["off"], dim=24, blocks=3, batch=3, steps=3,
                           backends=("auto", "torch"))
    with netbed.NetBed("200mbit") as bed:
        routes = subprocess.run(["ip", "-n", bed.ns[0], "-4", "route", "show", "table", "all"],
                                capture_output=True, text=True, check=True).stdout
        results = netbed.run_job(bed, spec, timeout=120)
    assert bed.leftovers() == [] and bed.ns[0] not in _namespaces()
    # Inside: routes to the bed's /30 and to loopback only, no default route.
    for ln in routes.splitlines():
        words = ln.split()
        dst = words[1] if words[0] in ("local", "broadcast") else words[0]
        assert dst != "default", routes
        net = ipaddress.ip_network(dst, strict=False)
        assert net.subnet_of(bed.net) or net.subnet_of(LOOPBACK), routes
    want = _reference(spec)
    rows = netbed.summarize(results)
    assert [(r["strategy"], r["backend"]) for r in rows] == [
        ("FULL_SHARD", "auto"), ("FULL_SHARD", "torch"), ("HSDP", "auto"), ("HSDP", "torch")]
    for r in rows:
        torch.testing.assert_close(r["losses"], want, rtol=RTOL, atol=0)
        assert r["link_bytes"] > 0  # the collectives crossed the link
    # "auto" sees two hosts: one group over both is gloo's; HSDP shards inside a
    # host over shm and replicates across over gloo
    assert [r["backends"] for r in rows] == [["torch", None], ["torch", None], ["shm", "torch"],
                                             ["torch", "torch"]]
    assert {r["host"] for r in results[:2]} == {"neta"}
    assert {r["host"] for r in results[2:]} == {"netb"}


def test_a_failing_rank_ends_the_job_and_the_bed_is_removed():
    code = ("import os, sys, time\n"
            "sys.exit(3) if os.environ['RANK'] == '2' else time.sleep(600)")
    with netbed.NetBed("100mbit") as bed:
        outs = bed.run([sys.executable, "-c", code], timeout=300)
    assert outs[2][0] == 3
    # the others were ended when rank 2 failed, not at the timeout
    for r, (rc, text) in enumerate(outs):
        if r != 2:
            assert rc == -signal.SIGKILL and "timeout" not in text, (r, rc, text)
    assert bed.leftovers() == []


def test_the_timeout_ends_every_rank():
    with netbed.NetBed("100mbit") as bed:
        outs = bed.run([sys.executable, "-c", "import time; time.sleep(600)"], timeout=2)
    assert all(rc == -signal.SIGKILL and "after the 2 s timeout" in text for rc, text in outs)
    assert bed.leftovers() == []


def test_delay_is_set_or_refused_by_name():
    try:
        bed = netbed.NetBed("100mbit", delay_ms=5)
        with bed:
            shown = subprocess.run(["tc", "-n", bed.ns[0], "qdisc", "show"], capture_output=True,
                                   text=True, check=True).stdout
            assert "delay 5ms" in shown and "rate 100Mbit" in shown, shown
    except RuntimeError as e:
        assert "no netem qdisc, so --delay-ms must be 0" in str(e)
    assert bed.leftovers() == []


def test_sigterm_removes_the_bed():
    script = ("import sys, time\n"
              f"sys.path.insert(0, {BENCH!r})\n"
              "import netbed\n"
              "with netbed.NetBed('100mbit') as bed:\n"
              "    print('up', flush=True)\n"
              "    bed.run([sys.executable, '-c', 'import time; time.sleep(60)'], timeout=60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        mine = f"{netbed.PREFIX}{proc.pid}"
        assert f"{mine}a" in _namespaces()
        time.sleep(0.5)  # the ranks started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not re.search(rf"^{mine}[ab]\b", _namespaces(), re.M)


def test_one_bed_per_process_and_the_first_survives():
    with netbed.NetBed("100mbit") as bed:
        with pytest.raises(RuntimeError, match="already has a bed up"):
            with netbed.NetBed("100mbit"):
                pass
        assert bed.ns[0] in _namespaces()  # the refused one deleted nothing of it
    assert bed.leftovers() == []


def test_bad_rate_is_refused_by_name():
    with netbed.NetBed("100mbit") as bed:
        with pytest.raises(ValueError, match="rate '1 gigabit'"):
            bed.set_link("1 gigabit")
    assert bed.leftovers() == []


def test_quant_needs_comm_quant_or_says_so():
    import flatshard
    if hasattr(flatshard, "CommQuant"):
        pytest.skip("flatshard.CommQuant exists: --quant runs")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "netbed.py"), "--quant",
                           "off,int8"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--quant int8 / int8+int4 need flatshard.CommQuant" in proc.stderr
    assert "bed:" not in proc.stdout  # refused before a bed was made
