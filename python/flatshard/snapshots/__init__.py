"""Snapshots of every rank's state in shared memory: restart under torchrun
with no step lost (core.py), the segments' names and clean-up (names.py),
what a snapshot holds (record.py)."""
from .core import Snapshots, SnapshotError
from .names import list_segments, remove_segments

__all__ = ["Snapshots", "SnapshotError", "list_segments", "remove_segments"]
