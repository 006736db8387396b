"""A fully_shard group's gradients (GroupGrads, a part of fsdp2/param.py's
ParamGroup): the unsharded parameters' gradients torch hands over,
accumulated without gradient sync ([Note: accumulation dtype] in param.py)
and reduce-scattered by the engine group into the sharded parameters'
DTensor gradients ([Note: post-backward in C], csrc/hooks/grads.h).
"""
import torch

from ..tensors import dtype_code, to_plain
from . import tp


class GroupGrads:
    """The gradients of a ParamGroup (param.py)."""

    def has_unsharded_grads(self):
        """Whether this group has gradients to reduce at the end of backward
        (with reduce_unused, a gathered group always has: zeros)."""
        if self.unsharded is None:
            return False
        for p in self.unsharded:
            if p.grad is not None:
                return True
        for a in self.accumulated:
            if a is not None:
                return True
        return self.reduce_unused and self.c.is_unsharded and self.n_trainable() > 0

    def _grad(self, i):
        """Unsharded parameter i's gradient as the engine reads it: the
        local tensor of a DTensor parameter's (tp.py)."""
        g = self.unsharded[i].grad
        if g is None:
            return None
        if i in self.tp:
            g = tp.grad_local(g, self.tp[i])
        if type(g) is not torch.Tensor:  # a subclass (extension.py): its values, as torch
            g = to_plain(g)
        return g

    def _accumulate(self, i, add):
        """The engine adds (add) or casts unsharded gradient i into its
        reduce-dtype sum."""
        g = self._grad(i).contiguous()
        acc = self.accumulated[i]
        self.c.accumulate(g, dtype_code(g.dtype), acc, dtype_code(acc.dtype), g.numel(), add)
        self.unsharded[i].grad = None

    def accumulate_unsharded_grads(self):
        """Add this backward's gradients onto the reduce-dtype sums kept from
        earlier backwards without sync [Note: accumulation dtype]."""
        if self.accumulated.count(None) == len(self.accumulated):  # no sum kept
            return
        for i, p in enumerate(self.unsharded or ()):
            if self.accumulated[i] is not None and p.grad is not None:
                self._accumulate(i, True)

    def to_accumulated_grads(self):
        """No sync this time: keep gradients of another dtype than the
        reduce dtype as reduce-dtype sums [Note: accumulation dtype]."""
        sums = list(self.accumulated)
        for i, p in enumerate(self.unsharded or ()):
            if p.grad is not None and p.grad.dtype != self.reduce_dtype:
                g = self._grad(i)
                sums[i] = torch.empty(g.shape, dtype=self.reduce_dtype, device=g.device)
                self.accumulated = sums
                self._accumulate(i, False)

    def reduce_grads(self, defer=False, reshard=False, bucket=None):
        """One engine call: the unsharded gradients reduce-scattered (averaged
        over the data-parallel ranks, or divided by the set factor) into the
        sharded parameters' .grad (DTensors), added to what is there
        ([Note: post-backward in C], csrc/hooks/grads.h: the engine group
        finds the tensors; what is here are the special cases). defer:
        on a device Comm the caller's stream does not wait for the
        reduce-scatter; finish_reduce() (the root calls it before the next
        group's reduction and at the end of backward) waits and writes the
        result. reshard: free the unsharded buffer in the same engine call
        (the caller's reshard() then has only its views to drop). Returns
        whether one is left to finish.

        HSDP without the all-reduce (set_requires_all_reduce(False)): the
        engine adds the reduce-scatter output into its partial sum and no
        sharded gradient is written; the next reduction with it adds the sum
        before the all-reduce. A hook (set_all_reduce_hook): the engine holds
        the reduce output after the collectives, finish_reduce() runs the
        hook on it, then the engine writes [Note: reduce output] (shard_group.h).

        bucket (the root's runtime.bucket.ReduceBucket): on a host Comm a
        plain reduction joins it and runs when it is flushed (then False is
        returned: the bucket finishes it); one that cannot join goes after
        what the bucket holds."""
        joins = False
        partial = self.replicate_comm is not None and not self.all_reduce
        if bucket is not None:  # before reading .grad: a pending reduction of ours lands first
            if self.comm.device is None and self.replicate_comm is None and \
                    self.all_reduce_hook is None and self.world > 1:
                joins = bucket.admits(self, self.reduce_dtype)
            else:
                bucket.flush()
        deferred = defer and self.comm.device is not None
        free = reshard and not self.ext
        b = bucket.c if joins else None
        sums = self.accumulated.count(None) != len(self.accumulated)  # a sum kept
        grads = self._grad_sources() if sums or self.tp else None
        done = self.c.reduce_grads(grads, deferred, free, b)
        if done is None:  # a gradient of a subclass: its values
            done = self.c.reduce_grads(self._grad_sources(), deferred, free, b)
        if not done:  # no gradient at all: nothing touched
            return False
        if sums:
            self.accumulated = [None] * len(self.accumulated)
        if done == 1:
            return False
        self.reducing_hook = None if partial else self.all_reduce_hook
        if joins:
            bucket.joined(self, self.reduce_dtype)
            return False
        if deferred and self.c.reduce_pending:
            return True
        self.finish_reduce()
        return False

    def _grad_sources(self):
        """Each parameter's gradient where the engine group cannot read it
        from the unsharded parameter's .grad: the reduce-dtype sum kept
        without sync, a DTensor's local tensor, a subclass's values (None:
        no gradient)."""
        out = []
        for i, a in enumerate(self.accumulated):
            if a is None and self.unsharded is not None and self.unsharded[i] is not None:
                a = self._grad(i)
            out.append(a)
        return out

    def _reduce_output(self):
        """The held reduce output as a flat tensor of the reduce dtype over
        the engine's memory (which lives as long as the tensor)."""
        out = self.c.reduce_output
        if not isinstance(out, memoryview):  # a device group's uint8 tensor
            return out.view(self.reduce_dtype)
        if not out.nbytes:
            return torch.empty(0, dtype=self.reduce_dtype)
        return torch.frombuffer(out, dtype=self.reduce_dtype)

    def finish_reduce(self):
        """The second half of reduce_grads: the engine waits for a deferred
        reduce-scatter, the hook (if any) runs on the reduce output, and the
        engine writes the sharded gradients; the ones made new become the
        parameters' DTensor gradients, and then each written parameter's
        post-accumulate-grad hooks run, as torch's fully_shard runs them
        (the engine group: [Note: post-backward in C])."""
        hook, self.reducing_hook = self.reducing_hook, None
        if hook is not None and self.c.reduce_pending:
            try:
                self.c.wait_reduce()
                _run_hook(*hook, self._reduce_output())
            except BaseException:
                self.c.finish_reduce(False)
                raise
        self.c.finish_reduce()

    def drop_reduce(self):
        """A reduction given up before it ran (a bucket cancelled): nothing
        is set."""
        self.reducing_hook = None
        self.c.finish_reduce(False)


def _run_hook(hook, stream, reduce_output):
    """torch's all-reduce hook, on `stream` (a device's) when one was given:
    it waits for the caller's stream, which then waits for it."""
    if stream is None:
        hook(reduce_output)
        return
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        hook(reduce_output)
    current.wait_stream(stream)
