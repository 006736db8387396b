"""reshard_after_forward=False given to the root's fully_shard only. The
root is not resharded after forward anyway (None means True for every
module but the root), so it changes nothing, while the FSDP modules inside,
left at None, still reshard after forward: a script that meant the whole
model to keep its parameters between forward and backward (ZeRO-2) runs
ZeRO-3 without a word.

  tree(root)   at lazy init, over the root's states

Imports: this package.
"""
from . import class_name, say


def tree(root):
    inner = [st for st in root.states if st is not root]
    if root.reshard_after_forward_arg is not False or not inner or \
            any(st.reshard_after_forward_arg is not None for st in inner):
        return
    say("reshard_root", f"reshard_after_forward=False was given to the root's fully_shard "
        f"({class_name(root.modules[0])}) only: the root is never resharded after forward "
        f"anyway, and the {len(inner)} fully_shard module(s) inside keep the default (True), so "
        "every one of them is still resharded after forward. Pass reshard_after_forward=False "
        "to each fully_shard call, or call root.set_reshard_after_forward(False) (it recurses)")
