"""torch's module paths under flatshard: a script moved by replacing
`torch.distributed.fsdp` with `flatshard` in its imports keeps working.

Every `from torch.distributed.fsdp... import ...` and
`import torch.distributed.fsdp...` line in README.md, docs/*.md and
examples/*.py is found by scanning those files, rewritten, and executed;
each name it imports must be flatshard's own object where flatshard has one
(its top-level name) and torch's very object where flatshard has none. Then
the same rule over every public name of each of torch's module paths, read
from the torch installed at run time."""
import glob
import importlib
import os
import re
import types

import pytest

import flatshard
from flatshard import torch_facts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) \
    + sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))
PREFIX = "torch.distributed.fsdp"

# from X import a, b as c | from X import (a,\n b) | import X [as y]
_FROM = re.compile(r"^[ \t]*from[ \t]+(torch\.distributed\.fsdp[\w.]*)[ \t]+import[ \t]+"
                   r"(\([^)]*\)|[^\n#]*)", re.M)
_IMPORT = re.compile(r"^[ \t]*import[ \t]+(torch\.distributed\.fsdp[\w.]*)", re.M)


def _import_lines():
    """(file, module, [imported names]) for every import of torch's FSDP paths."""
    out = []
    for path in FILES:
        text = open(path).read()
        rel = os.path.relpath(path, ROOT)
        for m in _FROM.finditer(text):
            names = [n.strip().split(" as ")[0].strip()
                     for n in m.group(2).strip("()").replace("\n", " ").split(",")]
            out.append((rel, m.group(1), [n for n in names if n]))
        out += [(rel, m.group(1), []) for m in _IMPORT.finditer(text)]
    return out


LINES = _import_lines()


def _ours(path):
    return "flatshard" + path[len(PREFIX):]


# torch's names flatshard does not provide yet (torch_facts.PENDING; reported
# by tests/test_public_names.py): wherever torch has them, not asked for here.
PENDING = {n for w, n in torch_facts.pending() if w == "torch.distributed.fsdp"}


def _check_name(torch_module, our_module, name):
    """What is wrong with `name` at our_module (None: nothing)."""
    if not hasattr(our_module, name):
        if name in PENDING:
            return None
        return f"{our_module.__name__}.{name}: missing"
    got, theirs = getattr(our_module, name), getattr(torch_module, name)
    top = getattr(flatshard, name, None)  # (flatshard.wrap is also a module: not a name)
    want = theirs if top is None or isinstance(top, types.ModuleType) else top
    if got is not want:
        whose = "flatshard's" if want is not theirs else "torch's"
        return f"{our_module.__name__}.{name} is {got!r}, not {whose} {want!r}"
    return None


def test_the_scan_finds_the_imports():
    # The README, the FSDP2 guide and both example scripts import from torch's paths.
    files = {f for f, _, _ in LINES}
    assert {"README.md", "docs/fsdp2.md", os.path.join("examples", "fsdp1_script.py")} <= files
    assert any(names for _, _, names in LINES)


@pytest.mark.parametrize("where,path,names", LINES,
                         ids=[f"{f}:{p}:{','.join(n)}" for f, p, n in LINES])
def test_import_line_works_with_the_prefix_replaced(where, path, names):
    line = f"from {_ours(path)} import {', '.join(names)}" if names else f"import {_ours(path)}"
    scope = {}
    exec(line, scope)  # the rewritten line itself, as the moved script runs it
    ours, theirs = importlib.import_module(_ours(path)), importlib.import_module(path)
    assert [why for why in (_check_name(theirs, ours, n) for n in names) if why] == []
    for n in names:
        assert scope[n] is getattr(ours, n)


# torch's public paths under torch.distributed.fsdp, and the names there that
# describe torch's own implementation (its bookkeeping types and class
# registry, helper types it imports): flatshard does not offer those.
PATHS = ["torch.distributed.fsdp.api", "torch.distributed.fsdp.wrap",
         "torch.distributed.fsdp.fully_sharded_data_parallel",
         "torch.distributed.fsdp.sharded_grad_scaler", "torch.distributed.fsdp._fully_shard",
         "torch.distributed.fsdp._fully_shard._fully_shard",
         "torch.distributed.fsdp._fully_shard._fsdp_api"]
TORCH_INTERNAL = {"TrainingState", "HandleTrainingState", "FlatParamHandle", "ActivationWrapper",
                  "DeviceMesh", "ProcessGroup", "get_cls_to_fsdp_cls",
                  "disable_fsdp_module_new_init", "contract", "AllGather", "ReduceScatter",
                  "FSDPMeshInfo", "FSDPState", "Comm"}


def _public_names(module):
    names = set(getattr(module, "__all__", ()))
    for n, v in vars(module).items():
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and \
                (getattr(v, "__module__", None) or "").startswith("torch.distributed"):
            names.add(n)
    return sorted(names - TORCH_INTERNAL)


@pytest.mark.parametrize("path", PATHS)
def test_every_public_name_of_torchs_path(path):
    theirs = importlib.import_module(path)
    ours = importlib.import_module(_ours(path))
    names = _public_names(theirs)
    assert names  # the enumeration found something to check
    assert [why for why in (_check_name(theirs, ours, n) for n in names) if why] == []
    if hasattr(theirs, "__all__"):  # `from ... import *` brings the same names
        assert sorted(ours.__all__) == sorted(set(theirs.__all__) - TORCH_INTERNAL - PENDING)


def test_the_paths_do_not_shadow_top_level_names():
    # Importing every path leaves flatshard's top-level functions in place
    # (a submodule named like a function would replace it on the package).
    before = {n: getattr(flatshard, n) for n in flatshard.__all__}
    for path in PATHS:
        importlib.import_module(_ours(path))
    assert {n: getattr(flatshard, n) for n in flatshard.__all__} == before
    assert isinstance(flatshard.fully_shard, types.FunctionType)
