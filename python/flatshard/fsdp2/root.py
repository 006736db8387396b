"""The root of a fully_shard tree: what its state decides at lazy init and
does at the end of each backward, for every state under it.

  decide(root)          lazy init's tree, as torch's first forward decides it
                        (torch's refusals first: check_root), then the
                        checks and names the tree's states need
  gather_ahead(...)     the states gathered in one state's all-gather
  end_of_backward(root) the end-of-backward callback: every state's
                        post-backward finished, the bucket flushed, the
                        reduction in flight landed

The root is an FSDPState (state.py) whose is_root is True; its runtime.root.Root
(`tree`) holds what both wrappers' roots keep (order, bucket, in flight).
Each state's own events are state.py's; the FSDP1 wrapper's root is
fsdp/root.py's.

Imports: runtime's root, observe; errors; checks (the unsynced-step
check); noop's checks; finalize.py. Nothing of state.py (which imports this
module): the states are reached through the root's.
"""
from .. import checks
from ..errors import ConfigError, RootError
from ..noop import reshard_root as noop_reshard, wrap_policy as noop_wrap
from ..runtime import observe
from ..runtime.root import Root
from . import finalize

STATE_ATTR = "_flatshard_fsdp2_state"


def state_of(module):
    """The FSDPState fully_shard gave `module`, or None."""
    return module.__dict__.get(STATE_ATTR)


def decide(root, claimable):
    """`root` becomes the root and claims every state in its modules' trees
    (FSDPState.lazy_init says when, and what claimable means)."""
    if not claimable:
        check_root(root)
    for m in (m for top in root.modules for m in top.modules()):  # as torch, read here
        st = state_of(m)
        if st is not None and st.group is not None:
            st.group.check_grad_dtypes()
        if st is not None and st is not root and st.manual_finalization:
            raise finalize.not_on_root("set_manual_backward_finalization")
    root.is_root, root.root, root.states = True, root, []
    for m in (m for top in root.modules for m in top.modules()):
        st = state_of(m)
        if st is None or st in root.states or (claimable and st.decided):
            continue
        if st is not root:
            st.is_root, st.root, st.states = False, root, None
        st.decided = not claimable
        root.states.append(st)
    comm = next((st.group.comm for st in root.states if st.group is not None), None)
    root.tree = Root(comm, root._finalize)
    for st in root.states:
        if st.reshard_after_forward_arg is None:  # True, except for the root
            st.reshard_after_forward = st is not root
    check_no_shared_params(root)
    init_fqns(root)
    decide_plain(root)
    noop_reshard.tree(root)
    noop_wrap.fully_shard(root)


def check_root(root):
    """torch's refusals at lazy init, its words after flatshard's: a
    RootError, which is torch's RuntimeError."""
    if len(root.modules) > 1:
        names = ", ".join(type(m).__name__ for m in root.modules)
        raise RootError(
            f"flatshard: the first forward (or _lazy_init) ran through a module of one "
            f"fully_shard call given {len(root.modules)} modules ({names}) with no "
            "fully_shard module above them, which would make that group the root; a root "
            "is one module: apply fully_shard to a module holding them all (the model) "
            f"too.\nFSDP requires a single root module but got {tuple(root.modules)}")
    top = root.modules[0]
    for name, m in top.named_modules():
        st = state_of(m)
        if st is not None and st is not root and st.decided:
            raise RootError(
                f"flatshard: fully_shard module {name} was lazily initialized already, in "
                "the tree of an FSDP module whose first forward (or _lazy_init) ran before "
                f"this root's ({type(top).__name__}); a tree is decided once: run the "
                "first forward through the root module, then any submodule alone."
                f"\nFSDP state has already been lazily initialized for {name}\nFSDP "
                "requires running forward through the root module first")


def decide_plain(root):
    """Which states' events may take the C plain path at all:
    not the root, in a tree of host Comms without gather-ahead, with no
    cast ([Note: one sequence per event]); each assignment hands the
    state's events' options (hand_options)."""
    host = all(st.group is None or st.group.comm.device is None for st in root.states)
    tree_ok = host and not root.tree.ahead
    for st in root.states:
        mp = st.mp
        st.lean = tree_ok and st is not root and st.group is not None and \
            mp.output_dtype is None and not (mp.cast_forward_inputs and
                                             mp.param_dtype is not None)


def init_fqns(root):
    """Each state's module names in the root's tree, joined as torch's
    fully_shard labels its profiler ranges ("" for the root), and its
    group's parameters' names there (each one's first place in
    named_parameters(), as torch names them)."""
    names = {}
    for top in root.modules:
        for name, m in top.named_modules():
            names.setdefault(m, name)
    for st in root.states:
        mine = {id(m) for m in st.modules}
        st.fqn = ", ".join(n for m, n in names.items() if id(m) in mine)
        st.label = f" ({st.fqn})" if st.fqn else ""
        if st.group is not None:  # the ledger's and the errors' name: the module path
            st.group.rename(st.fqn or "<root>")
            prefixes = ((names.get(m, ""), attr) for (m, attr), *_ in st.group.aliases)
            st.param_fqns = [f"{n}.{attr}" if n else attr for n, attr in prefixes]


def check_no_shared_params(root):
    """A parameter tied between modules given to separate fully_shard
    calls became two groups' parameters: refused at the first forward
    with torch's ValueError and words, naming the second one found."""
    prefixes = {}
    for top in root.modules:
        for name, m in top.named_modules():
            prefixes.setdefault(m, name + "." if name else "")
    seen = set()
    for st in root.states:
        g = st.group
        if g is None:
            continue
        for uid, aliases in zip(g.uids, g.aliases):
            if uid in seen:
                m, attr = aliases[0]
                fqn = prefixes.get(m, "") + attr
                raise ConfigError(
                    f"flatshard: Parameter '{fqn}' is shared with a parameter already "
                    "managed by another FSDP group. For shared/tied parameters, use "
                    "fully_shard([module_a, module_b]) to place them in the same FSDP "
                    "group.")
            seen.add(uid)

def gather_ahead(root, st, step):
    """The states gathered in st's all-gather where the user
    set no prefetch list: those that ran after it in the last forward
    (step 1) or before it (-1, backward), within the budget
    (runtime/ahead.py). A state without parameters is passed over."""
    g = st.group
    if g is None:
        return ()

    def cost(o):
        h = o.group
        if h is None:
            return 0
        if h.comm is not g.comm or h.is_unsharded or h.ext or h.post_chunk is not None:
            return None
        return h.full_alloc * h.compute_dtype.itemsize
    return root.tree.gather_ahead(st, step, cost)


def end_of_backward(root):
    """Once the autograd engine is done with this backward (the root's
    _finalize)."""
    with observe.span("FSDP::root_post_backward_callback"):
        root.tree.final_queued = False
        checks.backward_ended(root.states or [root])  # sync left off (checks/unsynced.py)
        if root.manual_finalization:  # finalize_backward lands it
            finalize.end_of_backward(root)
            return
        for st in root.states or [root]:
            g = st.group  # (one whose plain events left nothing: passed over)
            if g is None or not g.c.idle or st.reading or st.reshard_due or \
                    g.post_chunk is not None:
                st._end_backward()
        root.tree.bucket.flush()
        root.finish_reducing()  # every sharded gradient is in place when backward returns
        root.tree.reduced = False
