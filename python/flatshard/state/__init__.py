"""Files someone else may have written: one consolidated file from a sharded
checkpoint, without a process group (consolidate.py), a checkpoint's
manifest of its files' sizes and CRC-32Cs, checked before any is read
(manifest.py), and the rules for reading checkpoint files (safe_load.py:
plain data and known types only, every path inside its directory). The
FSDP1 wrapper's state dicts and checkpoints that write those files are
fsdp/'s (state_dict.py, optim_state.py, checkpoint.py).

Imports: errors and _C (the CRC) only; nothing of fsdp/, fsdp2/, plan/ or
optim/ (optim/ and fsdp/ use safe_load.py and manifest.py).
"""
