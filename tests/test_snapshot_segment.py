"""flatshard._C.Snapshot (csrc/engine/snapshot.c): one rank's double-buffered
segment in /dev/shm. Each check reads the segment's bytes back (or from
another process) and compares with the bytes written."""
import mmap
import os
import stat
import subprocess
import sys
import uuid

import pytest
import torch

from flatshard import _C


@pytest.fixture
def name():
    n = f"/flatshard-snaptest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    try:
        _C.snapshot_unlink(n)
    except FileNotFoundError:
        pass


def parts_of(tensors):
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]


def read_all(snap, slot, like):
    out = []
    for i, t in enumerate(like):
        got = torch.empty_like(t)
        snap.read(slot, i, got.data_ptr(), got.numel() * got.element_size())
        out.append(got)
    return out


def step_tensors(step, sizes=(0, 1, 63, 64, 65, 1031, 300_000)):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(n, generator=g) for n in sizes] + [
        torch.tensor(list(b"record %d" % step), dtype=torch.uint8)]


def test_write_read_back_in_two_slots(name):
    snap = _C.Snapshot(name)
    assert stat.S_IMODE(os.stat("/dev/shm" + name).st_mode) == 0o600
    assert snap.slots() == [(False, -1, 0, 0), (False, -1, 0, 0)]
    kept = {}
    for step in range(1, 5):
        kept[step] = step_tensors(step)
        snap.write(step, parts_of(kept[step]))
        snap.wait()
        assert not snap.busy()
        slots = snap.slots()
        # the newest two steps, one per slot, both complete
        assert sorted(s[1] for s in slots) == [max(step - 1, -1), step] if step > 1 else True
        for slot, (complete, s, nparts, _) in enumerate(slots):
            if s < 1:
                continue
            assert complete and nparts == len(kept[s])
            assert snap.verify(slot) == -1
            for want, got in zip(kept[s], read_all(snap, slot, kept[s])):
                assert torch.equal(want, got)
    snap.close()
    snap.close()


def test_a_copy_cut_short_leaves_the_other_slot_whole(name):
    snap = _C.Snapshot(name)
    a, b = step_tensors(1), step_tensors(2)
    snap.write(1, parts_of(a))
    snap.write(2, parts_of(b), stop_after=5000)  # as a crash inside the copy
    snap.wait()
    slots = snap.slots()
    done = [i for i, s in enumerate(slots) if s[0]]
    assert [slots[i][1] for i in done] == [1]
    cut = 1 - done[0]
    assert snap.verify(cut) == -2 and snap.part_bytes(cut, 0) == -1
    with pytest.raises(ValueError, match="not complete"):
        snap.read(cut, 0, a[0].data_ptr(), 0)
    # the next write goes to the incomplete slot, never over step 1
    snap.write(3, parts_of(step_tensors(3)))
    snap.wait()
    assert sorted(s[1] for s in snap.slots()) == [1, 3]


def test_a_changed_byte_is_named_by_part(name):
    snap = _C.Snapshot(name)
    t = step_tensors(7)
    snap.write(7, parts_of(t))
    snap.wait()
    slot = [i for i, s in enumerate(snap.slots()) if s[1] == 7][0]
    snap.close()
    # flip one byte of part 5 (1031 floats) straight in the segment's file
    with open("/dev/shm" + name, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        data = bytes(m)
        needle = t[5].numpy().tobytes()
        at = data.find(needle)
        assert at > 0
        m[at + 17] ^= 0x40
    snap = _C.Snapshot(name, create=False)
    assert snap.verify(slot) == 5
    assert snap.verify(1 - slot) == -2  # never written


def test_another_process_finds_the_segment(name):
    snap = _C.Snapshot(name)
    t = step_tensors(3)
    snap.write(3, parts_of(t))
    snap.wait()
    snap.close()
    code = ("import sys, torch; from flatshard import _C\n"
            "s = _C.Snapshot(sys.argv[1], create=False)\n"
            "slot = [i for i, x in enumerate(s.slots()) if x[0]][0]\n"
            "n = s.part_bytes(slot, 6); t = torch.empty(n, dtype=torch.uint8)\n"
            "s.read(slot, 6, t.data_ptr(), n); print(s.verify(slot), t.sum().item())\n")
    out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["-1", str(int(t[6].view(torch.uint8).sum()))]


def test_growth_keeps_the_other_slot_and_the_budget_refuses(name):
    snap = _C.Snapshot(name)
    small = [torch.arange(1000, dtype=torch.float32)]
    big = [torch.arange(200_000, dtype=torch.float32)]
    snap.write(1, parts_of(small))
    snap.write(2, parts_of(small))
    snap.write(3, parts_of(big))  # over step 1's slot: it grows
    snap.wait()
    by_step = {s[1]: i for i, s in enumerate(snap.slots())}
    assert set(by_step) == {2, 3}
    assert torch.equal(read_all(snap, by_step[2], small)[0], small[0])
    assert torch.equal(read_all(snap, by_step[3], big)[0], big[0])
    size = snap.segment_bytes()
    with pytest.raises(ValueError, match=r"over the budget of 1000000 bytes"):
        snap.write(4, parts_of(big * 2), budget=1_000_000)
    assert snap.segment_bytes() == size
    assert snap.slots()[by_step[3]][:2] == (True, 3)


def test_bad_arguments_are_named(name):
    with pytest.raises(FileNotFoundError, match="shm_open"):
        _C.Snapshot(name + "-absent", create=False)
    snap = _C.Snapshot(name)
    with pytest.raises(ValueError, match="slot=2"):
        snap.verify(2)
    with pytest.raises(TypeError, match=r"each part is \(data_ptr, nbytes\)"):
        snap.write(1, [(1,)])
    with pytest.raises(ValueError, match="part 0: -1 bytes"):
        snap.write(1, [(0, -1)])
    snap.close()
    with pytest.raises(ValueError, match="closed"):
        snap.slots()
    with open("/dev/shm" + name, "r+b") as f:
        f.write(b"not a snapshot!!")
    with pytest.raises(RuntimeError, match="not a flatshard snapshot store"):
        _C.Snapshot(name)
