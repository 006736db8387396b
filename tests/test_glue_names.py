"""The C side reads its own fields and torch's tensor API, never a Python
attribute of flatshard's by name: a name looked up from C is an interface
that no Python rename can see (it breaks silently, or raises far from the
cause). Every attribute, method or dict key that csrc/ looks up by a
literal name is read from the sources here and must be one of torch's or
Python's own; a lookup by a name that is not a literal fails too, since it
could be anything."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")

# What C may look up, and whose it is.
ALLOWED = {
    "add_note": "BaseException.add_note (Python 3.11+): a note on the error",
    "zero_": "torch.Tensor.zero_",
    "data_ptr": "torch.Tensor.data_ptr",
    "untyped_storage": "torch.Tensor.untyped_storage",
    "nbytes": "torch.UntypedStorage.nbytes",
    "resize_": "torch.UntypedStorage.resize_",
    "_swap_data_ptr_": "torch.UntypedStorage's data pointer swap (the pool's storages)",
    "_C": "torch._C",
    "_from_dlpack": "torch._C._from_dlpack",
    "from_dlpack": "torch.utils.dlpack.from_dlpack",
    "UntypedStorage": "torch.UntypedStorage",
    "requires_grad": "torch.Tensor.requires_grad",
    "_local_tensor": "torch DTensor's local tensor (torch's fully_shard reads it so too)",
    "grad": "torch.Tensor.grad",
    "dtype": "torch.Tensor.dtype",
    "shape": "torch.Tensor.shape",
    "is_contiguous": "torch.Tensor.is_contiguous",
    "contiguous": "torch.Tensor.contiguous",
    "new_empty": "torch.Tensor.new_empty",
    "_post_accumulate_grad_hooks": "torch.Tensor's post-accumulate-grad hooks (torch's "
                                   "fully_shard runs them on the sharded parameters)",
    "grad_fn": "torch.Tensor.grad_fn (a module output's node, for the pre-backward hook)",
    "register_prehook": "torch.autograd.graph.Node.register_prehook",
    "register_hook": "torch.Tensor.register_hook",
    "__enter__": "the context manager protocol (an event's profiler range, as `with` enters it)",
    "__exit__": "the context manager protocol (an event's profiler range, as `with` leaves it)",
}

# Keys that are values Python handed the C object, not names C chose: the
# module parameter names of a fully_shard group's registration (set_params,
# csrc/hooks/params.h), looked up in those modules' own _parameters dicts.
HANDED = {
    "p->keys[s]": "a registered parameter's name in its module (ShardGroup.set_params)",
    "dt": "a tensor's torch.dtype in the dtype-code table Python handed (ShardGroup.set_grads)",
}

# The calls that name an attribute, a method or a dict key; group 1 is what
# follows the object argument.
_LOOKUP = re.compile(
    r"\b(?:PyObject_(?:GetAttr|SetAttr|HasAttr|DelAttr|GetAttrString|SetAttrString|"
    r"HasAttrString|GetOptionalAttr|GetOptionalAttrString|CallMethod|CallMethodNoArgs|"
    r"CallMethodOneArg|CallMethodObjArgs|VectorcallMethod)|PyDict_GetItemString|"
    r"PyDict_GetItemWithError|PyDict_SetItemString|_PyObject_LookupAttr)\s*\(([^;]*)")
_NAME = re.compile(r'FS_NAME\(\s*\w+\s*,\s*"([^"]*)"\s*\)')


def _sources():
    for d, _, files in os.walk(CSRC):
        for f in files:
            if f.endswith((".c", ".h", ".cu", ".cuh")):
                path = os.path.join(d, f)
                with open(path, encoding="utf-8") as fh:
                    yield os.path.relpath(path, ROOT), fh.read()


def _lookups():
    """(file, line, name or None where it is not a literal) for each lookup."""
    out = []
    for rel, text in _sources():
        # names made once with FS_NAME(var, "text") and looked up through var
        for m in _NAME.finditer(text):
            out.append((rel, text.count("\n", 0, m.start()) + 1, m.group(1)))
        for m in _LOOKUP.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            call = m.group(0)
            if call.startswith(("PyObject_CallMethodObjArgs", "PyObject_VectorcallMethod")):
                args = m.group(1)
                lit = re.match(r'\s*[^,]*?,?\s*"([^"]*)"', args)
            else:  # (object, name, ...) or (dict, key, ...)
                lit = re.match(r'\s*[^,(]*(?:\([^)]*\))?[^,]*,\s*"([^"]*)"', m.group(1))
            if call.startswith("PyObject_VectorcallMethod"):
                lit = re.match(r'\s*"([^"]*)"', m.group(1))
            if lit:
                out.append((rel, line, lit.group(1)))
            elif re.match(r'\s*[^,]*,\s*([^,)]*)', m.group(1)).group(1).strip() in HANDED:
                continue
            else:  # through a variable: fine only where FS_NAME made it here
                var = re.match(r'\s*[^,]*,\s*(\w+)', m.group(1))
                if call.startswith("PyObject_VectorcallMethod"):
                    var = re.match(r'\s*(\w+)', m.group(1))
                name = var.group(1) if var else None
                made = name is not None and re.search(
                    r'FS_NAME\(\s*%s\s*,' % re.escape(name), text) is not None
                if not made:
                    out.append((rel, line, None))
    return out


def test_c_names_only_torch_and_python_attributes():
    found = _lookups()
    assert found, "no lookup found at all: the scan itself is broken"
    bad = [f"{f}:{line}: {name!r}" for f, line, name in found
           if name is not None and name not in ALLOWED]
    assert not bad, ("C looks up these names, which are not torch's or Python's (hand the C "
                     "object the value at the moment it changes instead):\n" + "\n".join(bad))


def test_c_looks_up_no_name_it_did_not_write_down():
    found = _lookups()
    loose = [f"{f}:{line}" for f, line, name in found if name is None]
    assert not loose, ("a lookup by a name that is neither a literal nor made with FS_NAME "
                       "here:\n" + "\n".join(loose))


def test_the_scan_sees_a_flatshard_name():
    """The scan is not vacuous: a lookup of one of flatshard's fields, in
    each form the sources use, is found and refused."""
    sample = ('PyObject *v = PyObject_GetAttrString(st, "engine_locals");\n'
              'FS_NAME(s_heads, "_heads");\n'
              'PyObject_CallMethod(c, "finish_reduce", NULL);\n')
    names = [m.group(1) for m in _NAME.finditer(sample)]
    for m in _LOOKUP.finditer(sample):
        lit = re.match(r'\s*[^,(]*(?:\([^)]*\))?[^,]*,\s*"([^"]*)"', m.group(1))
        names.append(lit.group(1))
    assert sorted(names) == ["_heads", "engine_locals", "finish_reduce"]
    assert not set(names) & set(ALLOWED)
