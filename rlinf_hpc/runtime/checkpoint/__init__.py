"""Checkpoint-restart: what a step-boundary checkpoint holds, how it is written (two-phase,
hashed, safetensors + JSON, never pickle), where checkpoints live, and the coordinator's manager
that decides when to save and resumes a run exactly.

Layout of one checkpoint (``CHECKPOINT_DIR/step-00000040/``)::

    manifest.json                      step, reason, world layout, config + hash, file hashes
    coordinator.json / .safetensors    the flow's state, pipelines' adaptive state, RNG of rank 0
    actor-g0.json / .safetensors       one pair per (component, group rank): worker state + RNG

A directory without ``manifest.json`` (``step-N.tmp/``) is a save in progress or a crashed one.
"""

from rlinf_hpc.runtime.checkpoint.files import BackgroundWrite, file_name, read_state, write_state
from rlinf_hpc.runtime.checkpoint.state import capture_rng, host_copy, host_view, restore_rng

__all__ = [
    "BackgroundWrite",
    "capture_rng",
    "file_name",
    "host_copy",
    "host_view",
    "read_state",
    "restore_rng",
    "write_state",
]
