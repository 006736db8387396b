"""torch's contract for the modules fully_shard is given and the classes it
makes of them, where flatshard's fully_shard keeps it (tests beside torch's
own fully_shard: tests/test_fully_shard_torch_contract.py):

  FSDP<Cls>(...)       builds a plain Cls: constructing the class of a
                       sharded module makes a module with no FSDP state, so
                       slicing a sharded nn.Sequential (model[:2]) gives a
                       plain Sequential of the same children, as torch's
                       FSDPModule.__new__ does
  copy.deepcopy        refused with an AssertionError (torch's text): the
                       copy would share the original's sharded storage and
                       collectives
  applied twice        fully_shard on a module it was already applied to:
                       an AssertionError with torch's text
  containers           nn.ModuleList / nn.ModuleDict without a forward of
                       their own: a ValueError with torch's text (their
                       children run their own forwards, so no hook of the
                       container would ever gather)

The errors are ConfigAssertionError / ConfigError: flatshard's own
exception types, the built-in ones torch raises too, with torch's words at
the end of flatshard's.

Imports: torch and the leaves (errors).
"""
import torch.nn as nn

from ..errors import ConfigAssertionError, bad_value

_DEEPCOPY = "FSDP does not support deepcopy. Please use state dict for serialization."


def class_namespace(cls):
    """The namespace of FSDP<cls>, the class fully_shard gives modules of
    class `cls`: __new__ builds a plain `cls`, __deepcopy__ refuses."""

    def __new__(klass, *args, **kwargs):
        self = cls.__new__(cls, *args, **kwargs)
        self.__init__(*args, **kwargs)  # not an FSDP<cls>: Python will not call it
        return self

    def __deepcopy__(self, memo):
        raise ConfigAssertionError(
            f"flatshard: copy.deepcopy of {type(self).__name__}, a module fully_shard was "
            "applied to, is not supported: the copy would share its sharded parameters and "
            "collectives. Deep-copy the module before fully_shard, or load its state_dict into "
            f"a new one ({_DEEPCOPY})")
    return {"__new__": __new__, "__deepcopy__": __deepcopy__}


def applied_twice(module):
    """The error for fully_shard on a module it was already applied to."""
    return ConfigAssertionError(
        f"flatshard: module={type(module).__name__} is not allowed; fully_shard was already "
        "applied to it. Each distinct composable distributed API can only be applied to a "
        f"module once. fully_shard has already been applied to the following module:\n{module}")


def check_container(module):
    """Refuse an nn.ModuleList or nn.ModuleDict without a forward of its own."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and \
            type(module).forward is nn.Module.forward:
        raise bad_value("module", type(module).__name__, "its forward never runs, so no "
                        "hook of it would gather (fully_shard does not support containers "
                        f"that do not implement forward: {module})",
                        "apply fully_shard to each module inside it, or to list(container) "
                        "for one group of them all")
