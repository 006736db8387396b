"""flatshard/torch_facts.py: the facts are the installed torch's, read from
torch's own objects (checked here against torch directly), the version is
read only for the reduce-dtype rule, and what the doctor prints says which
rule is in force and which torch names flatshard lacks.

The rule itself is held against torch's fully_shard by the bf16 parity tests
(test_fully_shard_torch_checks.py and others), which fail under a torch whose
rule flatshard does not follow."""
import dataclasses
import inspect

import torch
import torch.distributed.fsdp as tfsdp

from flatshard import torch_facts


def test_facts_are_read_from_torchs_objects():
    assert torch_facts.fsdp_names() == set(tfsdp.__all__)
    assert torch_facts.mp_policy_fields() == tuple(
        f.name for f in dataclasses.fields(tfsdp.MixedPrecisionPolicy))
    assert "unshard" in torch_facts.fsdp_module_methods()
    assert all(hasattr(tfsdp.FSDPModule, n) for n in torch_facts.fsdp_module_methods())
    assert torch_facts.data_parallel_mesh_dims() is getattr(tfsdp, "DataParallelMeshDims", None)
    ag, rs = torch_facts.flat_collectives()
    assert callable(ag) and callable(rs)


def test_the_reduce_dtype_rule_follows_the_release():
    release = torch_facts._release
    assert release("2.13.0+cpu") == (2, 13) and release("2.15.0+cu132") == (2, 15)
    assert release("2.16.0a0+git1234") == (2, 16) and release("3.0.1") == (3, 0)
    rule = torch_facts.reduce_dtype_rule()
    assert rule in torch_facts.REDUCE_DTYPE_RULES
    assert rule == ("grad_dtype" if release(torch.__version__) >= (2, 15) else "param_dtype")


def test_the_accumulate_range_goes_with_torchs_accumulate_method():
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    opens = "FSDP::post_backward_accumulate" in inspect.getsource(_fsdp_param_group)
    assert torch_facts.post_backward_accumulate_range() == opens == \
        hasattr(_fsdp_param.FSDPParam, "accumulate_unsharded_grad_if_needed")


def test_pending_lists_only_what_this_torch_has():
    assert set(torch_facts.pending()) <= set(torch_facts.PENDING)
    for where, name in torch_facts.pending():
        if where == "torch.distributed.fsdp":
            assert hasattr(tfsdp, name)
        elif where == "FSDPModule":
            assert hasattr(tfsdp.FSDPModule, name)
        elif where == "MixedPrecisionPolicy":
            assert name in torch_facts.mp_policy_fields()
        else:
            assert where == "rule" and name.endswith(torch_facts.reduce_dtype_rule())


def test_report_says_the_rule_and_what_is_pending():
    lines = torch_facts.report()
    assert lines[0].startswith(f"torch {torch.__version__}: fully_shard with reduce_dtype=None")
    assert f"(rule {torch_facts.reduce_dtype_rule()!r})" in lines[0]
    names = [n for w, n in torch_facts.pending() if w != "rule"]
    assert all(n in lines[2] for n in names) and (names or lines[2].endswith(": none"))


def test_versioned_names_follow_torch_and_nothing_is_pending():
    """torch 2.15's FSDP2 names are flatshard's exactly where this torch has
    them; nothing torch has is pending any more (2.13 to 2.15)."""
    import flatshard
    assert torch_facts.pending() == []
    have = torch_facts.provided()
    assert have == [(w, n) for w, n in torch_facts.VERSIONED if torch_facts.torch_has(w, n)]
    for where, name in torch_facts.VERSIONED:
        theirs = {"torch.distributed.fsdp": tfsdp, "FSDPModule": tfsdp.FSDPModule}.get(where)
        if theirs is None:
            assert (name in torch_facts.mp_policy_fields()) == ((where, name) in have)
            continue
        assert hasattr(theirs, name) == ((where, name) in have)
        ours = flatshard if where == "torch.distributed.fsdp" else flatshard.FSDPModule
        assert hasattr(ours, name) == ((where, name) in have), name
    line = torch_facts.report()[3]
    for where, name in torch_facts.VERSIONED:
        shown = name if where == "torch.distributed.fsdp" else f"{where}.{name}"
        state = "present" if (where, name) in have else "absent"
        assert f"{shown} ({state})" in line
