"""flatshard._C.crc32c against a bitwise CRC-32C written here from the
definition (RFC 3720: reflected polynomial 0x82F63B78, ~0 in and out), and
the standard check value of "123456789"."""
import os
import random

import torch

from flatshard import _C


def crc32c_bitwise(data, crc=0):
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_check_value_of_the_standard():
    assert _C.crc32c(b"123456789") == 0xE3069283 == crc32c_bitwise(b"123456789")


def test_every_alignment_and_length_matches_the_definition():
    rng = random.Random(7)
    data = bytes(rng.getrandbits(8) for _ in range(300))
    for start in range(9):
        for length in (0, 1, 7, 8, 9, 15, 16, 17, 63, 200):
            part = data[start:start + length]
            want = crc32c_bitwise(part)
            assert _C.crc32c(part) == want
            assert _C.crc32c(part, reference=True) == want


def test_continued_equals_whole_and_large_buffers_agree_with_the_table():
    data = os.urandom(1 << 20)
    head = _C.crc32c(data[:4097])
    assert _C.crc32c(data[4097:], crc=head) == _C.crc32c(data)
    assert _C.crc32c(data) == _C.crc32c(data, reference=True)


def test_a_tensors_bytes_and_one_flipped_bit():
    t = torch.randn(1000, dtype=torch.float32)
    view = memoryview(t.numpy()).cast("B")
    before = _C.crc32c(view)
    assert before == crc32c_bitwise(bytes(view))
    t.view(torch.int32)[123] ^= 1
    assert _C.crc32c(memoryview(t.numpy()).cast("B")) != before
