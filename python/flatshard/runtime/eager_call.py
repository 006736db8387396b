"""The eager fast path of runtime/eager.py's hooks, in a file of its own.

eager.wrap() registers this file with Dynamo's skip list (trace_rules.add), as
torch's own disable wrapper is skipped for living in torch/_dynamo: Dynamo then
neither inlines nor compiles a function made here, and graph-breaks on it with
torch's "disable()d function" message (the function carries torch's marks).

Imports: nothing.
"""


def make(fn, disabled, set_eval_frame):
    """fn called directly where no frame evaluation is set (eager code); inside
    a compiled region, `disabled` (torch's disable wrapper of fn) is called.
    The frame evaluation is read by setting none, which is what it was in the
    eager case, and set back otherwise."""
    def call(*args, **kwargs):
        prior = set_eval_frame(None)
        if prior is None:
            return fn(*args, **kwargs)
        set_eval_frame(prior)
        return disabled(*args, **kwargs)
    return call
