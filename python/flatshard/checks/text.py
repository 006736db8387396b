"""What every check's message shares: the rank that speaks, the list of
names it shows, and where the guide explains it."""
import torch.distributed as dist

SHOWN = 3  # names listed before "and N more"


def this_rank():
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def ranks(rs):
    return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"


def names(items):
    """The first SHOWN names, then how many more."""
    items = list(items)
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def guide(entry, env, mean=None):
    """The closing sentence: the guide's entry, and the variable that turns
    the check off (with when a user may mean what it found)."""
    off = f"{env}=0 turns this check off" + (f" ({mean})" if mean else "")
    return f"See docs/troubleshooting.md, \"{entry}\"; {off}."
