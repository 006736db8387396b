"""The hooks torch.compile leaves to run eagerly, as torch's fully_shard does.

flatshard's hooks call the C engine (unshard, reshard, reduce) and change the
modules' parameters: nothing a Dynamo graph can hold. torch's FSDP2 marks its
hooks with torch._dynamo.disable, so Dynamo breaks the graph where a module's
hook is called (in torch's nn.Module code) and runs the hook as plain Python;
the modules' own forwards are still compiled. flatshard's hook entry points do
the same through this file:

  @hook                  marks a method: Dynamo runs it, and all it calls,
                         eagerly.
  @hook(recursive=False) Dynamo skips the method's own frame but compiles the
                         frames it calls: the FSDP1 wrapper's forward, whose
                         wrapped module is the user's code to compile.
  install(cls)           replaces the marked methods of cls (and its bases)
                         by their disabled versions, once. Called when the
                         first object that registers hooks is built, before
                         any compile can see it: importing torch._dynamo
                         costs about a second, which `import flatshard` does
                         not pay. The class then holds plain functions, which
                         Dynamo reads without tracing anything of flatshard
                         (a descriptor's __get__ would be traced).
  wrap(fn)               fn disabled, for hooks made as closures.

wrap() builds each disabled function once; torch's fully_shard builds one at
every call of a hook instead. torch's disabled function switches the frame
evaluation off and on around every call, a microsecond or more in eager mode,
where there is nothing to switch: a fully_shard unit runs five hooks a step.
So wrap() returns a flatshard._C.EagerCall (csrc/glue/py_eager.c) that carries
the same marks for Dynamo (it graph-breaks on it alike) and asks the frame
evaluation once: where none is set (plain eager code) it calls the hook
directly; inside a compiled region it goes through torch's disabled function.
It is C, so the check adds no Python frame to the hook's call (a Python
closure doing the same added one to every hook event; that closure's cost
against torch's disabled function is in benchmarks/results/overhead.md,
"Cheaper hook calls, and fully_shard's own floor"); it binds as a method, as
a function does.

The reason given to Dynamo is shown in its graph-break log; like torch's, it
names the hooks, not the library. Where torch has no Dynamo (an import
failure), nothing is replaced.

Imports: torch only (torch._dynamo lazily, torch 2.11 to 2.13) and _C;
nothing of fsdp/ or fsdp2/.
"""
import functools

from .. import _C

REASON = "FSDP hooks run eagerly: they unshard, reshard and reduce parameters"
_MARK = "_flatshard_eager_recursive"  # on a marked method: its `recursive`
_installed = set()                   # classes whose marked methods are replaced


def hook(fn=None, *, recursive=True):
    """Mark a method for install(): `@hook` or `@hook(recursive=False)`."""
    def mark(f):
        setattr(f, _MARK, recursive)
        return f
    return mark if fn is None else mark(fn)


def wrap(fn, recursive=True):
    """fn, which torch.compile runs eagerly (recursive: also what it calls)."""
    try:
        import torch._dynamo
    except ImportError:  # a torch without Dynamo compiles nothing
        return fn
    try:
        disabled = torch._dynamo.disable(fn, recursive=recursive, reason=REASON)
    except TypeError:  # a torch whose disable takes no reason
        disabled = torch._dynamo.disable(fn, recursive=recursive)
    return _eager_first(fn, disabled) if recursive else disabled


# torch's disabled function's marks, which Dynamo reads off the function
# object (inspect.getattr_static) to graph-break on it
_MARKS = ("_torchdynamo_disable", "_torchdynamo_disable_msg",
          "_torchdynamo_disable_recursive")


def _eager_first(fn, disabled):
    """disabled, with plain eager calls made directly (_C.EagerCall); torch's
    own where this torch lacks what that needs."""
    try:
        from torch._C._dynamo.eval_frame import set_eval_frame
    except ImportError:
        return disabled
    if not all(hasattr(disabled, m) for m in _MARKS):
        return disabled  # a torch that marks otherwise
    call = _C.EagerCall(fn, disabled, set_eval_frame)
    functools.update_wrapper(call, fn)
    for m in _MARKS:
        setattr(call, m, getattr(disabled, m))
    call._torchdynamo_orig_callable = fn
    call._torchdynamo_wrapper_id = id(call)
    return call


def install(cls):
    """Replace the methods of cls and its bases marked with @hook by their
    disabled versions (once per class)."""
    for klass in cls.__mro__:
        if klass in _installed:
            continue
        for name, fn in list(vars(klass).items()):
            recursive = getattr(fn, _MARK, None)
            if recursive is not None and not getattr(fn, "_torchdynamo_disable", False):
                setattr(klass, name, wrap(fn, recursive))
        _installed.add(klass)
