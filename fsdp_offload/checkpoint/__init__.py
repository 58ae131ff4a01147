"""Checkpoints of a training run: atomic, checked part by part, one writer per dir, resumable on
other tier dirs, never gathering the state, never running code from what they read.

A checkpoint is a directory `step_<k>` of two torch.distributed.checkpoint checkpoints and two notes:
  run.json       what it fits: model args, world size, optimizer layout; checked first
  model/         the model's shards and each rank's trainer state: a plain DCP checkpoint, which any
                 DCP tool reads (dcp_to_torch_save, ...)
  optimizer/     the optimizer: an OffloadAdamW as a Stateful whose subgroups stream one at a time from
                 the host cache and tiers (see optimizer_state.py)
  manifest.json  written last: every part with its step and digest, every entry's CRC32 (manifest.py)
It is written under `step_<k>.tmp`, fsynced file by file and dir by dir, and renamed once every rank
has finished (files.py), so a run killed while saving leaves the previous checkpoint as the latest; a
checkpoint being replaced or pruned is renamed `step_<k>.old` before it is removed. A run holds
`<dir>/.lock` of its checkpoint dir and of its output dir (dir_lock.py). DCP's .metadata is read
through a restricted unpickler (dcp_reader.py), entries as tensors and plain values only
(optimizer_state.WeightsOnlyLoadPlanner).
"""

from .config import CheckpointConfig
from .dir_lock import RunDirBusy, RunDirLock, hold_run_dirs, release_run_dirs
from .files import FileOps
from .manifest import MANIFEST
from .run import (
    RUN_FILE, check_checkpoint, is_checkpoint, latest_checkpoint, load_checkpoint,
    resume_point, save_checkpoint,
)  # fmt: skip

__all__ = [
    "CheckpointConfig", "FileOps", "MANIFEST", "RUN_FILE", "RunDirBusy", "RunDirLock", "check_checkpoint", "hold_run_dirs",
    "is_checkpoint", "latest_checkpoint", "load_checkpoint", "release_run_dirs", "resume_point", "save_checkpoint",
]  # fmt: skip
