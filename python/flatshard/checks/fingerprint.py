"""A tensor's fingerprint: the CRC-32C of its bytes (csrc/core/checksum.c),
for comparing what ranks hold without moving it. Equal bits give equal
fingerprints; a difference is missed with probability 2^-32."""
import torch

from .. import _C


def crc_of(t):
    """The CRC-32C of `t`'s values as they lie in memory, in row-major
    order. A device tensor is copied to the host first."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return 0
    raw = t.contiguous().view(-1).view(torch.uint8)
    return _C.crc32c(memoryview(raw.numpy()))


def crcs(named):
    """[(name, tensor)] -> [crc of each tensor]."""
    return [crc_of(t) for _, t in named]
