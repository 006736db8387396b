"""Every environment variable flatshard reads, with its default and effect.

This table is the documentation (docs/reference.md is generated from it) and
tests/test_reference.py checks that every FLATSHARD_* name in the sources is
here, so a new variable cannot go undocumented. Arguments always win over the
environment; a malformed value is a ConfigError naming the variable.
"""

ENV = {
    "FLATSHARD_COMM_BACKEND": (
        "auto",
        "Collective backend when the wrapper's `comm_backend` argument is not given: 'auto' "
        "(shared memory when every rank of the group is on this host, else the process "
        "group), 'shm', 'torch' or 'nccl'."),
    "FLATSHARD_COMM_TIMEOUT": (
        "300",
        "Seconds any rank waits in a collective (and in the wrap-time agreement) before it "
        "reports which rank did not arrive and where that rank was, and raises."),
    "FLATSHARD_SHM_SLOT_BYTES": (
        "8388608",
        "Bytes of staging each rank owns in the shared-memory segment (two halves; larger "
        "transfers go in chunks of half a slot). At least 4096."),
}
