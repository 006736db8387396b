"""The validation corpus: invalid configurations, each rejected before any
collective with a flatshard.ConfigError (a ValueError; also a TypeError for
wrong types) whose message names the argument and the value given.

The corpus runs on 2 ranks with every collective entry point replaced by a
tripwire, so a check that only fires after a collective fails its case; the
ranks then still agree on a real wrap and a training step, which they would
not if any case had left them out of step.

The same bad arguments on one rank only (what a rank-dependent code path
gives), every argument of FSDP, fully_shard and FSDPModule's methods: rank 0
passes each alone while rank 1 calls nothing, and each is refused at once,
before the ranks' wrap agreement (runtime/consistency.py) as well as before
any collective; only the cases that run the policy or param_init_fn on the
model, or read its parameters (PLANNED), are the agreement's to decide."""
import contextlib
import functools
import inspect
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
import torch.distributed.fsdp.wrap as twrap
import torch.nn as nn

import flatshard
import flatshard.fsdp.groups as fgroups
import flatshard.fsdp2.api as ffsdp2
import flatshard.fsdp2.mesh as fmesh
import flatshard.runtime.comm as fcomm
from flatshard import (FSDP, ConfigError, CustomPolicy, FSDPModule, ModuleWrapPolicy,
                       NotBuiltError, ShardingStrategy, fully_shard, register_fsdp_forward_method)
from flatshard.runtime import consistency
from test_diagnostics import assert_documented
from toy_models import Block, Net, build

V, T, N = ConfigError, TypeError, NotBuiltError  # expected: value, type, not-built errors


def _meta():
    with torch.device("meta"):
        return build()


def _int_param():
    model = build()
    model.blocks[0].count = nn.Parameter(torch.zeros(3, dtype=torch.int16), requires_grad=False)
    return model


def _shared():
    model = build()
    model.blocks[1].ff.lin.weight = model.blocks[0].ff.lin.weight
    return model


class _ForeignPolicy:
    """A `_run_policy` policy that selects a module outside the model."""

    def _run_policy(self, root, ignored_modules, root_kwargs):
        return {nn.Linear(2, 2): {}}


def _other_backend_group():
    """A group whose backend is not gloo (a gloo group registered under
    another name, since this machine has no second CPU backend)."""
    if not hasattr(_other_backend_group, "group"):
        try:
            dist.Backend.register_backend(
                "flatshard_test", lambda store, rank, size, timeout:
                dist.ProcessGroupGloo(store, rank, size, timeout), devices=["cpu"])
        except (RuntimeError, ValueError):
            pass  # registered by an earlier run in this worker
        _other_backend_group.group = dist.new_group(backend="flatshard_test")
    return _other_backend_group.group


def _blocks(res):
    return CustomPolicy(lambda m: res if isinstance(m, Block) else False)


# name -> (expected error, argument named, value shown, model builder, kwargs(model), env)
CASES = {
    "module_function": (T, "module", "function", lambda: (lambda x: x), None, None),
    "module_class": (T, "module", "Linear", lambda: nn.Linear, None, None),
    "module_none": (T, "module", "None", lambda: None, None, None),
    "strategy_str": (T, "sharding_strategy", "'FULL_SHARD'", build,
                     lambda m: dict(sharding_strategy="FULL_SHARD"), None),
    "strategy_int": (T, "sharding_strategy", "int 1", build,
                     lambda m: dict(sharding_strategy=1), None),
    "hybrid_hosts": (V, "LOCAL_WORLD_SIZE", "'3'", build,
                     lambda m: dict(sharding_strategy=tfsdp.ShardingStrategy.HYBRID_SHARD),
                     {"LOCAL_WORLD_SIZE": "3"}),
    "hybrid_one_group": (V, "process_group", "ProcessGroup", build,
                         lambda m: dict(sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2,
                                        process_group=dist.group.WORLD), None),
    "hybrid_bad_pair": (T, "process_group", "(None, None)", build,
                        lambda m: dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                                       process_group=(None, None)), None),
    "prefetch_int": (T, "backward_prefetch", "int 1", build,
                     lambda m: dict(backward_prefetch=1), None),
    "prefetch_str": (T, "backward_prefetch", "'BACKWARD_PRE'", build,
                     lambda m: dict(backward_prefetch="BACKWARD_PRE"), None),
    "mixed_precision_dtype_field": (V, "mixed_precision.param_dtype", "torch.int32", build,
                                    lambda m: dict(mixed_precision=tfsdp.MixedPrecision(
                                        param_dtype=torch.int32)), None),
    "mixed_precision_dtype": (T, "mixed_precision", "torch.bfloat16", build,
                              lambda m: dict(mixed_precision=torch.bfloat16), None),
    "offload_int": (T, "cpu_offload.offload_params", "int 1", build,
                    lambda m: dict(cpu_offload=tfsdp.CPUOffload(offload_params=1)), None),
    "offload_bool": (T, "cpu_offload", "bool True", build, lambda m: dict(cpu_offload=True),
                     None),
    "use_orig_params": (T, "use_orig_params", "'yes'", build,
                        lambda m: dict(use_orig_params="yes"), None),
    "forward_prefetch": (T, "forward_prefetch", "None", build,
                         lambda m: dict(forward_prefetch=None), None),
    "comm_quant": (T, "comm_quant", "'int8'", build, lambda m: dict(comm_quant="int8"), None),
    "limit_all_gathers": (T, "limit_all_gathers", "int 0", build,
                          lambda m: dict(limit_all_gathers=0), None),
    "sync_module_states": (T, "sync_module_states", "int 1", build,
                           lambda m: dict(sync_module_states=1), None),
    "sync_module_states_str": (T, "sync_module_states", "'yes'", build,
                               lambda m: dict(sync_module_states="yes"), None),
    # without a GPU: no CUDA device; with one: the module is still on the CPU
    "device_cuda": (V, "device_id", "cuda", build,
                    lambda m: dict(device_id=torch.device("cuda", 0)), None),
    "device_int": (V, "device_id", "device_id=0", build, lambda m: dict(device_id=0), None),
    "device_mps": (N, "device_id", "mps", build, lambda m: dict(device_id="mps"), None),
    "device_float": (T, "device_id", "3.5", build, lambda m: dict(device_id=3.5), None),
    "device_str": (V, "device_id", "'gpu-zero'", build, lambda m: dict(device_id="gpu-zero"),
                   None),
    "device_bool": (T, "device_id", "bool True", build, lambda m: dict(device_id=True), None),
    "policy_int": (T, "auto_wrap_policy", "42", build, lambda m: dict(auto_wrap_policy=42),
                   None),
    "policy_set": (T, "auto_wrap_policy", "Block", build,
                   lambda m: dict(auto_wrap_policy={Block}), None),
    "policy_class": (T, "auto_wrap_policy", "Block", build,
                     lambda m: dict(auto_wrap_policy=Block), None),
    "policy_signature": (T, "auto_wrap_policy", "lambda", build,
                         lambda m: dict(auto_wrap_policy=lambda module: True), None),
    "policy_partial": (T, "auto_wrap_policy", "transformer_layer_cls", build,
                       lambda m: dict(auto_wrap_policy=functools.partial(
                           twrap.transformer_auto_wrap_policy)), None),
    "policy_class_names": (T, "auto_wrap_policy", "'Block'", build,
                           lambda m: dict(auto_wrap_policy=twrap.ModuleWrapPolicy({"Block"})),
                           None),
    "policy_foreign_module": (V, "auto_wrap_policy", "_ForeignPolicy", build,
                              lambda m: dict(auto_wrap_policy=_ForeignPolicy()), None),
    "policy_raises": (V, "auto_wrap_policy", "AttributeError", build,
                      lambda m: dict(auto_wrap_policy=CustomPolicy(lambda mod: mod.no_such)),
                      None),
    "custom_result": (T, "auto_wrap_policy", "'yes'", build,
                      lambda m: dict(auto_wrap_policy=_blocks("yes")), None),
    "torch_custom_result": (V, "auto_wrap_policy", "returned 3", build,
                            lambda m: dict(auto_wrap_policy=twrap.CustomPolicy(lambda mod: 3)),
                            None),
    "custom_signature": (T, "auto_wrap_policy", "lambda_fn", build,
                         lambda m: dict(auto_wrap_policy=CustomPolicy(lambda a, b: True)), None),
    "custom_unknown_key": (V, "auto_wrap_policy", "use_orig_params", build,
                           lambda m: dict(auto_wrap_policy=_blocks({"use_orig_params": True})),
                           None),
    "custom_bad_value": (T, "sharding_strategy", "'ZeRO3'", build,
                         lambda m: dict(auto_wrap_policy=_blocks({"sharding_strategy": "ZeRO3"})),
                         None),
    "custom_root_options": (V, "auto_wrap_policy", "SHARD_GRAD_OP", build,
                            lambda m: dict(auto_wrap_policy=CustomPolicy(
                                lambda mod: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
                                if isinstance(mod, Net) else False)), None),
    "ignored_both": (V, "ignored_states", "[]", build,
                     lambda m: dict(ignored_modules=[], ignored_states=[]), None),
    "ignored_int": (T, "ignored_modules", "int 3", build, lambda m: dict(ignored_modules=[3]),
                    None),
    "ignored_str": (T, "ignored_modules", "'head'", build,
                    lambda m: dict(ignored_modules="head"), None),
    "ignored_not_a_list": (T, "ignored_modules", "Linear(in_features=7", build,
                           lambda m: dict(ignored_modules=m.head), None),
    "ignored_foreign": (V, "ignored_modules", "Linear(in_features=2", build,
                        lambda m: dict(ignored_modules=[nn.Linear(2, 2)]), None),
    "ignored_root": (V, "ignored_modules", "'Net'", build,
                     lambda m: dict(ignored_modules=[m]), None),
    "ignored_states_foreign": (V, "ignored_states", "shape (2,)", build,
                               lambda m: dict(ignored_states=[nn.Parameter(torch.zeros(2))]),
                               None),
    "ignored_states_int": (T, "ignored_states", "int 5", build,
                           lambda m: dict(ignored_states=[5]), None),
    "group_and_mesh": (V, "device_mesh", "object", build,
                       lambda m: dict(process_group=dist.group.WORLD, device_mesh=object()),
                       None),
    "mesh_type": (T, "device_mesh", "'mesh'", build, lambda m: dict(device_mesh="mesh"), None),
    "hsdp_tuple": (V, "process_group", "(None, None)", build,
                   lambda m: dict(process_group=(None, None)), None),
    "group_positional_enum": (T, "process_group", "ShardingStrategy.FULL_SHARD", build,
                              lambda m: dict(process_group=ShardingStrategy.FULL_SHARD), None),
    "group_str": (T, "process_group", "'world'", build,
                  lambda m: dict(process_group="world"), None),
    "group_backend": (V, "process_group", "flatshard_test", build,
                      lambda m: dict(process_group=_other_backend_group()), None),
    "meta_without_init": (V, "param_init_fn", "None", _meta, lambda m: {}, None),
    "init_not_callable": (T, "param_init_fn", "int 42", build,
                          lambda m: dict(param_init_fn=42), None),
    "init_str": (T, "param_init_fn", "'init'", build, lambda m: dict(param_init_fn="init"), None),
    "init_signature": (T, "param_init_fn", "lambda", _meta,
                       lambda m: dict(param_init_fn=lambda: None), None),
    "init_leaves_meta": (V, "param_init_fn", "meta device", _meta,
                         lambda m: dict(param_init_fn=lambda mod: None), None),
    "comm_backend": (V, "comm_backend", "'gloo'", build, lambda m: dict(comm_backend="gloo"),
                     None),
    "check_replicas_every": (V, "check_replicas_every", "-1", build,
                             lambda m: dict(check_replicas_every=-1), None),
    "comm_backend_nccl": (V, "comm_backend", "'nccl'", build,
                          lambda m: dict(comm_backend="nccl"), None),
    "comm_backend_type": (T, "comm_backend", "int 3", build, lambda m: dict(comm_backend=3),
                          None),
    "env_backend": (V, "FLATSHARD_COMM_BACKEND", "'bogus'", build, lambda m: {},
                    {"FLATSHARD_COMM_BACKEND": "bogus"}),
    "env_timeout": (V, "FLATSHARD_COMM_TIMEOUT", "'-1'", build, lambda m: {},
                    {"FLATSHARD_COMM_TIMEOUT": "-1"}),
    "env_timeout_text": (V, "FLATSHARD_COMM_TIMEOUT", "'soon'", build, lambda m: {},
                         {"FLATSHARD_COMM_TIMEOUT": "soon"}),
    "env_slot": (V, "FLATSHARD_SHM_SLOT_BYTES", "'12'", build, lambda m: {},
                 {"FLATSHARD_SHM_SLOT_BYTES": "12"}),
    "param_dtype": (T, "blocks.0.count", "torch.int16", _int_param, lambda m: {}, None),
    "shared_across_units": (V, "blocks.1.ff.lin.weight", "blocks.0.ff.lin.weight", _shared,
                            lambda m: dict(auto_wrap_policy=ModuleWrapPolicy({Block})), None),
}


@contextlib.contextmanager
def _env(values):
    saved = {k: os.environ.get(k) for k in values or {}}
    os.environ.update(values or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


COLLECTIVES = ["all_gather_into_tensor", "all_gather_single", "all_gather", "all_gather_object",
               "broadcast", "broadcast_object_list", "all_reduce", "reduce_scatter_tensor",
               "reduce_scatter_single", "barrier", "new_group"]


@contextlib.contextmanager
def _tripwire(agreement=False):
    """Every way flatshard reaches a collective raises instead (a cached
    Comm is reached through comm_for, so that is replaced too); with
    `agreement`, so does the wrap agreement."""
    def trip(*args, **kwargs):
        raise AssertionError("a collective was issued before the error")

    def trip_agreement(*args, **kwargs):
        raise AssertionError("the error came only inside the ranks' wrap agreement")
    saved = [(dist, n, getattr(dist, n), trip) for n in COLLECTIVES if hasattr(dist, n)]
    saved += [(mod, "comm_for", mod.comm_for, trip) for mod in (fcomm, fgroups, fmesh)]
    if agreement:
        saved.append((consistency, "agree", consistency.agree, trip_agreement))
    for mod, name, _, wire in saved:
        setattr(mod, name, wire)
    try:
        yield
    finally:
        for mod, name, fn, _ in saved:
            setattr(mod, name, fn)


# Cases whose message docs/troubleshooting.md quotes: guide entry -> case.
GUIDE = {"bad-type": "strategy_str", "not-built": "device_mps",
         "meta-without-init": "meta_without_init", "shared-parameter": "shared_across_units",
         "wrong-backend": "group_backend", "bad-timeout": "env_timeout"}


def _verdict(exc, arg, value, call):
    """(None if call() fails as it must, else what went wrong; the error)."""
    try:
        call()
    except ConfigError as e:
        msg = f"{type(e).__name__}: {e}"
        if not isinstance(e, exc) or not isinstance(e, (ValueError, TypeError)):
            return f"{type(e).__name__} is not a {exc.__name__}: {msg}", msg
        if arg not in msg or value not in msg:
            return f"does not name {arg!r} and {value!r}: {msg}", msg
        return None, msg
    except Exception as e:
        return f"raised {type(e).__name__}, not a ConfigError: {e}", None
    return "no error", None


def _check(name, agreement=False):
    """_verdict of FSDP on case `name`; with `agreement`, the wrap agreement
    is a tripwire too."""
    exc, arg, value, make, kwargs, env = CASES[name]
    model = make()
    kw = kwargs(model) if kwargs else {}
    with _env(env), _tripwire(agreement):
        return _verdict(exc, arg, value, lambda: FSDP(model, **kw))


def _corpus():
    _other_backend_group()  # made outside the tripwire: making a group is a collective
    results = {name: _check(name) for name in CASES}
    # The ranks are still in step: a real wrap agrees and trains.
    model = FSDP(build(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    model(torch.randn(2, 5)).sum().backward()
    failures = {name: why for name, (why, _) in results.items() if why is not None}
    return failures, {entry: results[case][1] for entry, case in GUIDE.items()}


def test_corpus_has_at_least_40_invalid_configurations():
    assert len(CASES) >= 40


def test_every_invalid_configuration_fails_before_any_collective(dist_pool):
    (failures0, messages), (failures1, _) = dist_pool(2).run(_corpus, timeout=60)
    assert failures0 == {} and failures1 == {}, (failures0, failures1)
    for entry, message in messages.items():  # what the troubleshooting guide quotes
        assert_documented(entry, message)


# Cases decided in the wrap agreement's plan: they run auto_wrap_policy or
# param_init_fn on the model, or check the parameters the policy's units
# hold, and the model may differ between ranks.
PLANNED = {"meta_without_init", "init_leaves_meta", "policy_foreign_module", "policy_raises",
           "custom_result", "torch_custom_result", "custom_unknown_key", "custom_bad_value",
           "custom_root_options", "param_dtype", "shared_across_units"}


def _pair():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


# fully_shard: name -> (expected error, argument named, value shown, call)
FULLY_SHARD_CASES = {
    "fs_module": (T, "module", "int 3", lambda: fully_shard(3)),
    "fs_module_empty": (V, "module", "[]", lambda: fully_shard([])),
    "fs_mesh": (T, "mesh", "'cpu'", lambda: fully_shard(_pair(), mesh="cpu")),
    "fs_reshard_type": (T, "reshard_after_forward", "'yes'",
                        lambda: fully_shard(_pair(), reshard_after_forward="yes")),
    "fs_reshard_divides": (V, "reshard_after_forward", "=3",
                           lambda: fully_shard(_pair(), reshard_after_forward=3)),
    "fs_placement_type": (T, "shard_placement_fn", "int 0",
                          lambda: fully_shard(_pair(), shard_placement_fn=0)),
    "fs_placement_result": (V, "shard_placement_fn", "Invalid shard_placement_fn",
                            lambda: fully_shard(_pair(), shard_placement_fn=lambda p: "rows")),
    "fs_mp_type": (T, "mp_policy", "torch.float16",
                   lambda: fully_shard(_pair(), mp_policy=torch.float16)),
    "fs_mp_dtype": (V, "mp_policy.param_dtype", "torch.int32",
                    lambda: fully_shard(_pair(), mp_policy=ffsdp2.MixedPrecisionPolicy(
                        param_dtype=torch.int32))),
    "fs_offload": (T, "offload_policy", "bool True",
                   lambda: fully_shard(_pair(), offload_policy=True)),
    "fs_ignored": (T, "ignored_params", "int 3",
                   lambda: fully_shard(_pair(), ignored_params=[3])),
    "fs_dp_mesh_dims": (T, "dp_mesh_dims", "'shard'",
                        lambda: fully_shard(_pair(), dp_mesh_dims="shard")),
}


# FSDPModule's methods, on a module both ranks sharded: name -> (expected
# error, method, argument named, value shown, call(module))
METHOD_CASES = {
    "unshard": (T, "unshard", "async_op", "'yes'", lambda m: m.unshard(async_op="yes")),
    "grad_sync": (T, "set_requires_gradient_sync", "requires_gradient_sync", "'no'",
                  lambda m: m.set_requires_gradient_sync("no")),
    "grad_sync_recurse": (T, "set_requires_gradient_sync", "recurse", "'yes'",
                          lambda m: m.set_requires_gradient_sync(False, recurse="yes")),
    "last_backward": (T, "set_is_last_backward", "is_last_backward", "int 1",
                      lambda m: m.set_is_last_backward(1)),
    "reshard_fwd": (T, "set_reshard_after_forward", "reshard_after_forward", "None",
                    lambda m: m.set_reshard_after_forward(None)),
    "reshard_fwd_divides": (V, "set_reshard_after_forward", "reshard_after_forward", "=3",
                            lambda m: m.set_reshard_after_forward(3)),
    "reshard_fwd_recurse": (T, "set_reshard_after_forward", "recurse", "'yes'",
                            lambda m: m.set_reshard_after_forward(True, recurse="yes")),
    "reshard_bwd": (T, "set_reshard_after_backward", "reshard_after_backward", "None",
                    lambda m: m.set_reshard_after_backward(None)),
    "reshard_bwd_recurse": (T, "set_reshard_after_backward", "recurse", "int 1",
                            lambda m: m.set_reshard_after_backward(True, recurse=1)),
    "forward_prefetch": (T, "set_modules_to_forward_prefetch", "modules", "Linear",
                         lambda m: m.set_modules_to_forward_prefetch([nn.Linear(2, 2)])),
    "backward_prefetch": (T, "set_modules_to_backward_prefetch", "modules", "'m'",
                          lambda m: m.set_modules_to_backward_prefetch("m")),
    "post_optim_event": (T, "set_post_optim_event", "event", "int 3",
                         lambda m: m.set_post_optim_event(3)),
    "divide_factor": (V, "set_gradient_divide_factor", "factor", "=0",
                      lambda m: m.set_gradient_divide_factor(0)),
    "divide_factor_type": (T, "set_gradient_divide_factor", "factor", "str '2'",
                           lambda m: m.set_gradient_divide_factor("2")),
    "unshard_in_backward": (T, "set_unshard_in_backward", "unshard_in_backward", "'no'",
                            lambda m: m.set_unshard_in_backward("no")),
    "all_reduce": (T, "set_requires_all_reduce", "requires_all_reduce", "None",
                   lambda m: m.set_requires_all_reduce(None)),
    "all_reduce_recurse": (T, "set_requires_all_reduce", "recurse", "'x'",
                           lambda m: m.set_requires_all_reduce(True, recurse="x")),
    "comm_quant": (T, "set_comm_quant", "quant", "'int8'", lambda m: m.set_comm_quant("int8")),
    "comm_quant_recurse": (T, "set_comm_quant", "recurse", "'yes'",
                           lambda m: m.set_comm_quant(None, recurse="yes")),
    "custom_all_gather": (T, "set_custom_all_gather", "comm", "int 3",
                          lambda m: m.set_custom_all_gather(3)),
    "custom_reduce_scatter": (T, "set_custom_reduce_scatter", "comm", "int 3",
                              lambda m: m.set_custom_reduce_scatter(3)),
    "all_reduce_hook": (T, "set_all_reduce_hook", "hook", "int 3",
                        lambda m: m.set_all_reduce_hook(3)),
    "all_reduce_hook_stream": (V, "set_all_reduce_hook", "stream", "CPU",
                               lambda m: m.set_all_reduce_hook(lambda t: None, stream=object())),
    "rs_divide_factor": (V, "set_reduce_scatter_divide_factor", "factor", "=-1",
                         lambda m: m.set_reduce_scatter_divide_factor(-1)),
    "force_sum": (T, "set_force_sum_reduction_for_comms", "enable", "'yes'",
                  lambda m: m.set_force_sum_reduction_for_comms("yes")),
    "unused_params": (T, "set_reduce_scatter_unused_params", "reduce_scatter_unused_params",
                      "int 1", lambda m: m.set_reduce_scatter_unused_params(1)),
    "unused_params_recurse": (T, "set_reduce_scatter_unused_params", "recurse", "'x'",
                              lambda m: m.set_reduce_scatter_unused_params(True, recurse="x")),
    "max_buffers": (V, "set_reduce_scatter_max_input_buffers", "max_input_buffers", "=0",
                    lambda m: m.set_reduce_scatter_max_input_buffers(0)),
    "max_buffers_type": (T, "set_reduce_scatter_max_input_buffers", "max_input_buffers",
                         "'2'", lambda m: m.set_reduce_scatter_max_input_buffers("2")),
    "max_buffers_recurse": (T, "set_reduce_scatter_max_input_buffers", "recurse", "'x'",
                            lambda m: m.set_reduce_scatter_max_input_buffers(2, recurse="x")),
    "separate_group": (T, "set_separate_reduce_scatter_group", "enable", "None",
                       lambda m: m.set_separate_reduce_scatter_group(None)),
    "separate_group_recurse": (T, "set_separate_reduce_scatter_group", "recurse", "'x'",
                               lambda m: m.set_separate_reduce_scatter_group(True, recurse="x")),
    "allocate_from_group": (T, "set_allocate_memory_from_process_group_for_comm", "enable",
                            "'x'",
                            lambda m: m.set_allocate_memory_from_process_group_for_comm("x")),
    "symm_mem": (V, "set_symm_mem_for_comm", "backend", "'GLOO'",
                 lambda m: m.set_symm_mem_for_comm("GLOO")),
    "forward_method": (V, "register_fsdp_forward_method", "method_name", "'nope'",
                       lambda m: register_fsdp_forward_method(m, "nope")),
}
# torch 2.15's methods, where the installed torch (and so flatshard) has them
if hasattr(FSDPModule, "finalize_backward"):
    METHOD_CASES.update({
        "manual_finalization": (T, "set_manual_backward_finalization", "enabled", "'yes'",
                                lambda m: m.set_manual_backward_finalization("yes")),
        "finalize_async": (T, "finalize_backward", "async_op", "int 1",
                           lambda m: m.finalize_backward(async_op=1)),
    })
if hasattr(FSDPModule, "set_keep_unsharded_storage"):
    METHOD_CASES.update({
        "keep_storage": (T, "set_keep_unsharded_storage", "keep", "None",
                         lambda m: m.set_keep_unsharded_storage(None)),
        "keep_storage_recurse": (T, "set_keep_unsharded_storage", "recurse", "'yes'",
                                 lambda m: m.set_keep_unsharded_storage(True, recurse="yes")),
    })


def _arguments(fn):
    return {n for n in inspect.signature(fn).parameters if n != "self"}


def test_one_rank_cases_name_every_argument():
    """Every argument of FSDP, fully_shard and FSDPModule's public methods
    has a case in the one-rank test (a module that is not an FSDPModule is
    register_fsdp_forward_method's no-op, as in torch)."""
    fsdp1 = {CASES[n][1] for n in CASES if n not in PLANNED}
    assert _arguments(FSDP.__init__) <= fsdp1, _arguments(FSDP.__init__) - fsdp1
    fsdp2 = {c[1] for c in FULLY_SHARD_CASES.values()}
    assert _arguments(fully_shard) <= fsdp2, _arguments(fully_shard) - fsdp2
    methods = {(c[1], c[2]) for c in METHOD_CASES.values()}
    wanted = {(name, a) for name, fn in vars(FSDPModule).items()
              if callable(fn) and not name.startswith("_") for a in _arguments(fn)}
    wanted |= {("register_fsdp_forward_method", "method_name")}
    assert wanted <= methods, wanted - methods


def _in_step(sharded):
    """Both ranks: a real wrap agrees and trains, and the module fully_shard
    sharded on both trains."""
    model = FSDP(build(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    model(torch.randn(2, 5)).sum().backward()
    sharded(torch.randn(3, 4)).sum().backward()
    return True


def _one_rank_refusals():
    """Rank 0 passes each bad argument while rank 1 calls nothing until the
    wrap that ends the run; rank 0's wrap agreement is a tripwire, and a
    failed agreement would wait far past the run's deadline for rank 1."""
    _other_backend_group()  # made by both ranks: making a group is a collective
    sharded = _pair()
    fully_shard(sharded[0])
    fully_shard(sharded)
    if dist.get_rank() != 0:
        return _in_step(sharded)
    leave, consistency._LEAVE_S = consistency._LEAVE_S, 3600.0
    failures = {}
    try:
        for name in CASES:
            if name not in PLANNED:
                why, _ = _check(name, agreement=True)
                if why is not None:
                    failures[name] = why
        with _tripwire(agreement=True), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # set_reduce_scatter_divide_factor
            for name, (exc, arg, value, call) in FULLY_SHARD_CASES.items():
                why, _ = _verdict(exc, arg, value, call)
                if why is not None:
                    failures[name] = why
            for name, (exc, _, arg, value, call) in METHOD_CASES.items():
                why, _ = _verdict(exc, arg, value, lambda: call(sharded))
                if why is not None:
                    failures[name] = why
    finally:
        consistency._LEAVE_S = leave
    # here, not after the wrap below: a case that changed the module instead
    # of raising would leave the ranks out of step there
    assert not failures, failures
    return _in_step(sharded)


def test_bad_arguments_on_one_rank_are_refused_at_once(dist_pool):
    # The deadline is far below the agreement's leave time set above: a case
    # that reached the agreement and failed there would wait it out.
    assert dist_pool(2).run(_one_rank_refusals, timeout=90) == [True, True]


def test_errors_are_value_and_type_errors():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(flatshard.ConfigTypeError, TypeError)
    assert issubclass(flatshard.ConfigTypeError, ConfigError)
    assert issubclass(NotBuiltError, ConfigError)
