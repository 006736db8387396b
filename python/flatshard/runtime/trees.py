"""The tensors inside a module's inputs and outputs, as torch's FSDP finds
them: in tensors, lists, tuples, named tuples, dicts and dataclass objects,
nested (sets and other iterables are not entered, as torch's pytree does not
enter them). A dataclass is what torch.utils._pytree does not enter and
torch's FSDP does: a module returning one gets its pre-backward hook and its
output cast all the same.

Imports: torch only.
"""
import copy
import dataclasses

import torch

_MAX_DEPTH = 100  # deeper is a cycle (an object holding itself)


def _is_dataclass_object(x):
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _is_namedtuple(x):
    return isinstance(x, tuple) and hasattr(x, "_fields")


# The walks are module-level functions, not closures: a closure that calls
# itself is a reference cycle (function <-> cell), and this one would hold the
# tensors found, and through them the autograd graph of a whole forward, until
# the cyclic garbage collector happens to run (measured: 50 MB more resident
# between steps on a GPT-2 test model).


def grad_tensors(tree):
    """The tensors in `tree` that require grad, in traversal order."""
    if type(tree) is torch.Tensor:  # the common case, at no cost
        return [tree] if tree.requires_grad else []
    out = []
    _collect(tree, out, 0)
    return out


def hook_before_backward(tree, hook):
    """hook(grad) where backward reaches the tensors in `tree` that require
    grad (a unit's outputs): on each one's grad_fn (a node's pre-hook, torch's
    C call; registered once on a node that makes several outputs), or on the
    tensor where it has none (a leaf). The same moment as a tensor hook: the
    node runs once all its outputs' gradients have arrived; fewer Python
    steps (Tensor.register_hook makes the tensor's hook dict first)."""
    nodes = []
    for t in grad_tensors(tree):
        node = t.grad_fn
        if node is None:
            t.register_hook(hook)
        elif node not in nodes:
            node.register_prehook(hook)
            nodes.append(node)


def _collect(x, out, depth):
    if depth > _MAX_DEPTH:
        raise RuntimeError("flatshard: a module's output nests deeper than "
                           f"{_MAX_DEPTH} levels; is it a cycle?")
    if torch.is_tensor(x):
        if x.requires_grad:
            out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect(v, out, depth + 1)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, out, depth + 1)
    elif _is_dataclass_object(x):
        for f in dataclasses.fields(x):
            _collect(getattr(x, f.name), out, depth + 1)


def cast_floating(tree, dtype):
    """`tree` with its floating-point tensors of another dtype cast to `dtype`
    (mixed precision's input and output casts)."""
    def cast(t):
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
    return map_tensors(cast, tree)


def map_tensors(fn, tree):
    """`tree` with every tensor t replaced by fn(t): containers rebuilt
    (a named tuple as its own type, a dataclass object as a shallow copy
    with its fields replaced, also a frozen one), anything else kept."""
    return _map(fn, tree, 0)


def _map(fn, x, depth):
    if depth > _MAX_DEPTH:
        raise RuntimeError("flatshard: a module's input or output nests deeper than "
                           f"{_MAX_DEPTH} levels; is it a cycle?")
    if torch.is_tensor(x):
        return fn(x)
    if _is_namedtuple(x):
        return type(x)(*(_map(fn, v, depth + 1) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_map(fn, v, depth + 1) for v in x)
    if isinstance(x, dict):
        out = copy.copy(x)  # keeps an OrderedDict's (or other dict's) type
        for k, v in x.items():
            out[k] = _map(fn, v, depth + 1)
        return out
    if _is_dataclass_object(x):
        out = copy.copy(x)
        for f in dataclasses.fields(x):
            object.__setattr__(out, f.name, _map(fn, getattr(x, f.name), depth + 1))
        return out
    return x
