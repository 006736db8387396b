"""One rank's snapshot of one step, as the parts restore() reads (tensors,
then the record): from a complete slot of a segment on this host (SlotPart),
or received from a rank on another host that holds its buddy copy
(BufferPart)."""
import torch
import torch.distributed as dist

from .. import _C


def as_bytes(t):
    """t's storage as bytes (t contiguous)."""
    return t.reshape(-1).view(torch.uint8)


class SlotPart:
    def __init__(self, snap, slot, close=True):
        self.snap, self.slot, self._close = snap, slot, close
        self.nparts = snap.slots()[slot][2]

    @classmethod
    def open(cls, name, step):
        snap = _C.Snapshot(name, create=False)
        return cls(snap, [i for i, s in enumerate(snap.slots()) if s[0] and s[1] == step][0])

    def read_all(self, i):
        data = torch.empty(self.snap.part_bytes(self.slot, i), dtype=torch.uint8)
        self.snap.read(self.slot, i, data.data_ptr(), data.numel())
        return data

    def read_into(self, i, t):
        self.snap.read(self.slot, i, t.data_ptr(), t.numel() * t.element_size())

    def send(self, dst):
        """Every part to rank `dst` (BufferPart.recv there)."""
        data = [self.read_all(i) for i in range(self.nparts)]
        sizes = torch.tensor([d.numel() for d in data], dtype=torch.int64)
        dist.send(torch.tensor([self.nparts], dtype=torch.int64), dst)
        dist.send(sizes, dst)
        dist.send(torch.cat(data), dst)
        self.close()

    def close(self):
        if self._close:
            self.snap.close()


class BufferPart:
    def __init__(self, sizes, buf):
        self.sizes, self.buf = sizes, buf
        self.nparts = len(sizes)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    @classmethod
    def recv(cls, src):
        n = torch.empty(1, dtype=torch.int64)
        dist.recv(n, src)
        sizes = torch.empty(int(n), dtype=torch.int64)
        dist.recv(sizes, src)
        buf = torch.empty(int(sizes.sum()), dtype=torch.uint8)
        dist.recv(buf, src)
        return cls(sizes.tolist(), buf)

    def read_all(self, i):
        return self.buf[self.offsets[i]:self.offsets[i] + self.sizes[i]]

    def read_into(self, i, t):
        if t.numel() * t.element_size() != self.sizes[i]:
            raise ValueError(f"part {i} holds {self.sizes[i]} bytes, its tensor has "
                             f"{t.numel() * t.element_size()}")
        as_bytes(t).copy_(self.read_all(i))

    def close(self):
        pass
