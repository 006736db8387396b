"""[Note: unused parameters] A group's post-backward runs once every
trainable parameter's gradient has arrived (csrc/hooks/shard_events.c). A
rank whose forward left some of a group's parameters unused (conditional
compute, an expert no token reached) never sees them all arrive, so its
group reduced only at the end of backward, after groups the other ranks
reduced later: the ranks' reduce-scatters went apart. torch's fully_shard
runs a group's post-backward when the module's backward reaches its inputs
instead. So a group with set_reduce_scatter_unused_params(True) has its
forward inputs watched (FSDPState._watch_inputs, as for frozen parameters),
and when the module's backward has reached them with some gradients arrived
and others not, it reduces then, zeros for the missing ones: at the same
point of backward as a rank whose gradients all arrived. A group without the
option pays nothing.

Imports: nothing of flatshard.
"""


def watched(group):
    """Whether the group's forward inputs are watched for this."""
    return group.reduce_unused


def module_backward_done(state):
    """The module's backward reached this forward's inputs (state.py's
    _Forward.inputs_done, after its own work): reduce a partly arrived group
    now, unless another forward of it is still being read."""
    g = state.group
    if g is not None and g.reduce_unused and state.requires_gradient_sync and \
            not state.reading and g.c.arrived:
        g.c.post_backward()
