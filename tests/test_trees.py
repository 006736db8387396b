"""runtime/trees.py's hook_before_backward, which both wrappers use for their
pre-backward: the hook runs where a tensor hook on the same outputs runs
(torch's own way, which it replaces), before backward reaches the module's
own nodes; once per node rather than once per tensor; on a leaf output, as a
tensor hook. Checked against plain tensor hooks on the same graphs."""
import torch

from flatshard.runtime.trees import grad_tensors, hook_before_backward


def _events(outputs_of, use_ours):
    """(order of the hook and of the product's backward, the hooks' count
    expected, w.grad) for the outputs outputs_of(h, w) of h = x @ w."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    log = []

    def hook(grad):
        log.append("hook")

    def reached_product(g):  # backward has reached the product x @ w
        log.append("product")
        return g

    h = x @ w
    h.register_hook(reached_product)
    outs = grad_tensors(outputs_of(h, w))
    if use_ours:
        hook_before_backward(outs, hook)
        nodes = {id(t.grad_fn) if t.grad_fn is not None else id(t) for t in outs}
    else:
        for t in outs:
            t.register_hook(hook)
        nodes = outs
    sum(t.sum() for t in outs).backward()
    return log, len(nodes), w.grad


CASES = {
    "one output": lambda h, w: torch.relu(h),
    "two outputs of one node": lambda h, w: tuple(torch.tanh(h).split(2, dim=1)),
    "outputs of two nodes": lambda h, w: (torch.relu(h), h * 2),
    "a leaf among them": lambda h, w: (torch.relu(h), w),
}


def test_runs_where_a_tensor_hook_runs_once_per_node():
    for name, outputs_of in CASES.items():
        ours, n_ours, g_ours = _events(outputs_of, True)
        theirs, n_theirs, g_theirs = _events(outputs_of, False)
        assert ours.count("hook") == n_ours and theirs.count("hook") == n_theirs, name
        # the same place in backward: the first hook, against the product's
        assert ours.index("hook") == theirs.index("hook"), (name, ours, theirs)
        if name != "a leaf among them":  # before the module's own nodes
            assert ours[-1] == "product", (name, ours)
        assert torch.equal(g_ours, g_theirs), name
    assert _events(CASES["two outputs of one node"], True)[1] == 1
