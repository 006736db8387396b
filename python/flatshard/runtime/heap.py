"""The C library's heap on the host, handed back to the system at chosen points.

[Note: heap trim] What backward frees on the host (activations, each unit's
unsharded gradient) came from torch's allocator, that is the C library's
heap, which keeps it, while requests as large as a unit's gradient are
mapped anew beside it: the process grows by what the heap holds free. After
a unit's gradient is reduced the free pages are handed back (_C.heap_trim)
once 64 MiB of units have been freed since the last trim, when the unit
that ran first in forward is done (only the root's work is left, with its
large gradients), at the end of backward, and after each optimizer step
(whose temporaries the heap would keep between steps). Not after every unit:
a trim costs a walk of the heap, and the pages it hands back are faulted in
again by the next unit.
"""
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import _C


class HeapTrim:
    """The trims that are Python's (the optimizer-step hook, the end of
    backward); the count of what units freed, and its trim, are the C
    side's (the engine unit counts its freed bytes after a reshard in
    backward: Unit.released)."""

    def __init__(self):
        self._step_hook = None

    @property
    def pending(self):
        """Bytes freed by units since the last trim."""
        return _C.heap_pending()

    @staticmethod
    def trim():
        _C.heap_trim()

    def watch_steps(self):
        """Trim after every optimizer step from now on (torch's global step
        post-hook, installed once per process by the first host unit)."""
        if self._step_hook is None:
            self._step_hook = register_optimizer_step_post_hook(
                lambda optimizer, args, kwargs: self.trim())


HEAP = HeapTrim()
