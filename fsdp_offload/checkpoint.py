"""Checkpoints of a training run: atomic, resumable on other tier dirs, never gathering the state.

A checkpoint is a directory `step_<k>` of two torch.distributed.checkpoint checkpoints and a note:
  run.json      what it fits: model args, world size, optimizer layout; checked first
  model/        the model's shards and each rank's trainer state: a plain DCP checkpoint, which any
                DCP tool reads (dcp_to_torch_save, ...)
  optimizer/    the optimizer: an OffloadAdamW as a Stateful whose subgroups stream one at a time from
                the host cache and tiers (see optimizer_state.py)
It is written under `step_<k>.tmp` and renamed once every rank has finished, so a run killed while
saving leaves the previous checkpoint as the latest; a checkpoint being replaced or pruned is renamed
`step_<k>.old` before it is removed.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .optimizer_state import (
    CheckedFileSystemWriter, OffloadOptimizerState, StreamingLoadPlanner, StreamingSavePlanner, WeightsOnlyLoadPlanner,
)  # fmt: skip
from .config import is_whole, path_option
from .dcp_reader import CheckpointFileError, SafeFileSystemReader, read_dcp_metadata
from .dcp_reader import reading_failed as _reading_failed
from .optimizer import OffloadAdamW

RUN_FILE = "run.json"
_STEP_DIR = re.compile(r"^step_\d+$")  # a checkpoint, never a .tmp one being written
_OLD_DIR = re.compile(r"^step_\d+\.old$")  # one being removed


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: no checkpoints
    every: int = 0  # save every this many steps (0: only at the end)
    # "auto": the latest checkpoint in `dir` if there is one, else a fresh start (said in one line);
    # "required": the latest, refusing to start without one; "never": a fresh start; or the path of
    # one checkpoint (a step_* dir). true/false mean auto/never.
    resume: str | bool = "auto"
    keep: int = 2  # checkpoints kept; older ones are deleted
    io_threads: int = 2  # writers of optimizer subgroups per rank: each holds one subgroup in host memory at a time

    def __post_init__(self) -> None:
        if isinstance(self.resume, bool):
            self.resume = "auto" if self.resume else "never"
        self.resume = path_option(self.resume, "checkpoint.resume", what="auto, required, never or the path of a step_* dir")
        self.dir = path_option(self.dir, "checkpoint.dir", null="no checkpoints", what="a directory path")
        for name in ("every", "keep", "io_threads"):
            if not is_whole(getattr(self, name)):
                raise ValueError(f"checkpoint.{name}={getattr(self, name)!r} must be a whole number")
        if self.every < 0:
            raise ValueError(f"checkpoint.every={self.every} must be >= 0 (0: a checkpoint at the end only)")
        if self.every and not self.dir:
            raise ValueError(f"checkpoint.every={self.every} saves into checkpoint.dir, which is not set: give checkpoint.dir")
        if self.io_threads < 1:
            raise ValueError(f"checkpoint.io_threads={self.io_threads}: at least 1 writer is needed")
        if self.keep < 1:
            raise ValueError(
                f"checkpoint.keep={self.keep}: at least the checkpoint just written must be kept; give checkpoint.keep=1 "
                "or more, or checkpoint.dir=null for no checkpoints"
            )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _on_rank0(what: str, work: Callable[[], None]) -> None:
    """Runs `work` on rank 0 and tells every rank how it went, so that a failure there is an error on
    every rank rather than a hang of the others in their next collective. `what` names it for them."""
    error: BaseException | None = None
    if _rank() == 0:
        try:
            work()
        except BaseException as exc:  # the other ranks hear of it first
            error = exc
    if dist.is_initialized():
        status = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(status, src=0)
        if status[0] is not None and error is None:
            raise RuntimeError(
                f"{what} failed on rank 0: {status[0]}; fix checkpoint.dir (its space, its permissions) and resume: the "
                "checkpoints saved before are intact"
            )
    if error is not None:
        raise error


def _pack(obj: Any) -> bytes:
    """Per-rank state goes to DCP as opaque bytes under a rank-unique key (DCP would dedup
    equal keys across ranks as replicated). Tensors, containers and plain values only (what a
    weights_only load reads back)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    # weights_only: tensors, containers and plain values only; a checkpoint cannot run code on load
    return torch.load(io.BytesIO(data), weights_only=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_checkpoint(path: str) -> bool:
    """Whether `path` is one complete checkpoint (a step_* dir with both parts)."""
    return all(os.path.isfile(os.path.join(path, part, ".metadata")) for part in ("model", "optimizer"))


def resume_point(cfg: CheckpointConfig) -> tuple[str | None, str]:
    """The checkpoint a run starts from (None: fresh) and one line that says which, per
    `checkpoint.resume`; a clear error where that cannot be honoured."""
    if cfg.dir and is_checkpoint(cfg.dir):
        raise ValueError(
            f"checkpoint.dir={cfg.dir} is one checkpoint, not the dir of a run's checkpoints: give "
            f"checkpoint.dir={os.path.dirname(os.path.abspath(cfg.dir))}, or checkpoint.resume={cfg.dir} to start from it"
        )
    if cfg.resume == "never":
        return None, "checkpoint.resume=never: starting fresh"
    if cfg.resume not in ("auto", "required"):
        if not is_checkpoint(cfg.resume):
            raise ValueError(
                f"checkpoint.resume={cfg.resume}: not a complete checkpoint (it needs model/ and optimizer/ with their "
                ".metadata); give a step_* dir, or auto, required or never"
            )
        return cfg.resume, f"resuming from {cfg.resume}"
    latest = latest_checkpoint(cfg.dir)
    if latest is not None:
        return latest, f"resuming from {latest}"
    if cfg.resume == "required":
        where = "checkpoint.dir is not set" if not cfg.dir else f"checkpoint.dir={cfg.dir} holds no complete checkpoint"
        raise ValueError(f"checkpoint.resume=required, but {where}: start with checkpoint.resume=auto or never")
    return None, f"no checkpoint in checkpoint.dir={cfg.dir}: starting fresh" if cfg.dir else "starting fresh"


def latest_checkpoint(directory: str | None) -> str | None:
    """The newest checkpoint under `directory` (never a half-written .tmp one, nor one being removed).
    One that lacks a part (copied in part, an older layout) is still the newest: check_checkpoint
    refuses it, saying what is missing, rather than a run going on from an older one or from scratch."""
    if not directory or not os.path.isdir(directory):
        return None
    done = _step_dirs(directory)
    return done[-1] if done else None


def _step_dirs(directory: str) -> list[str]:
    """The step_* dirs in `directory`, oldest first (their names sort by step)."""
    return [os.path.join(directory, d) for d in sorted(os.listdir(directory)) if _STEP_DIR.match(d)]


def _move_aside(path: str) -> str:
    """Renames a checkpoint out of the way before it is removed, so that a run killed while removing
    it never leaves a step_* dir with a part's .metadata but not all its files."""
    os.replace(path, path + ".old")
    return path + ".old"


def save_checkpoint(
    directory: str,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    run: dict[str, Any],
    rank_state: dict[str, Any],
    keep: int = 2,
    io_threads: int = 2,
) -> str:
    """Saves model shards, optimizer state and `rank_state` (data position, RNG, ...) atomically.

    `run` is what the checkpoint must match on resume (model args, world size, ...). `io_threads`
    subgroups are read from the tiers and written at once (each thread writes its own file)."""
    final = os.path.join(directory, f"step_{step:08d}")
    tmp = final + ".tmp"

    def start() -> None:
        os.makedirs(directory, exist_ok=True)
        # the leftovers of a run killed while saving: a half-written step, half-removed old ones
        for leftover in [tmp] + [os.path.join(directory, d) for d in os.listdir(directory) if _OLD_DIR.match(d)]:
            shutil.rmtree(leftover, ignore_errors=True)
        os.makedirs(tmp, mode=0o700)

    def commit() -> None:
        with open(os.path.join(tmp, RUN_FILE), "w") as f:
            json.dump({**run, "step": step}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for d in (os.path.join(tmp, "model"), os.path.join(tmp, "optimizer"), tmp):
            _fsync_dir(d)  # DCP fsyncs its files, not their names
        # Saving a step again (a run resumed from an earlier one): the complete old one goes aside and
        # only then away, so there is always a complete copy of the step on disk.
        replaced = _move_aside(final) if os.path.exists(final) else None
        os.replace(tmp, final)
        _fsync_dir(directory)  # the rename itself survives a power loss
        others = [d for d in _step_dirs(directory) if d != final]
        gone = [_move_aside(d) for d in others[: max(0, len(others) - (keep - 1))]]  # the one just written stays
        for d in ([replaced] if replaced else []) + gone:
            shutil.rmtree(d, ignore_errors=True)

    _on_rank0(f"creating {tmp}", start)
    rank = _rank()
    dcp.save({"model": get_model_state_dict(model), f"rank{rank}": _pack(rank_state)}, checkpoint_id=os.path.join(tmp, "model"))
    optim = {"optimizer": _optimizer_state(model, optimizer)}
    writer = CheckedFileSystemWriter(os.path.join(tmp, "optimizer"), thread_count=io_threads)
    dcp.save(optim, storage_writer=writer, planner=StreamingSavePlanner())
    _barrier()
    _on_rank0(f"committing checkpoint {final}", commit)
    return final


def check_checkpoint(path: str, run: dict[str, Any]) -> int:
    """Raises a one-line error when the checkpoint at `path` was written by an incompatible run;
    returns its step."""
    for part in ("model", "optimizer"):
        if not os.path.isfile(os.path.join(path, part, ".metadata")):
            raise ValueError(
                f"checkpoint {path} has no {part}/.metadata: it was written by an older fsdp-offload (before "
                "checkpoints went through DCP as model/ and optimizer/) or copied in part; point checkpoint.dir "
                "elsewhere to start afresh"
            )
    try:
        with open(os.path.join(path, RUN_FILE)) as f:
            saved = json.load(f)
        int(saved["step"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(_unreadable(path, f"{RUN_FILE}: {exc!r}")) from exc
    for key, value in run.items():
        if saved.get(key) != value:
            raise ValueError(
                f"checkpoint {path} was written with {key}={saved.get(key)!r}, this run has {key}={value!r}: "
                f"resume with the same {key}, or point checkpoint.dir elsewhere to start afresh"
            )
    for part in ("model", "optimizer"):  # read here (never unpickling code), so that a garbled one is named
        try:
            read_dcp_metadata(os.path.join(path, part, ".metadata"))
        except CheckpointFileError as exc:
            raise ValueError(_unreadable(path, f"{part}/.metadata {exc.problem}")) from None
    return int(saved["step"])


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restores model shards and optimizer state; returns this rank's `rank_state`."""
    key = f"rank{_rank()}"
    state = {"model": get_model_state_dict(model), key: b""}
    _load(state, os.path.join(path, "model"), WeightsOnlyLoadPlanner())
    set_model_state_dict(model, state["model"])
    optim = {"optimizer": _optimizer_state(model, optimizer)}
    _load(optim, os.path.join(path, "optimizer"), StreamingLoadPlanner())
    if not isinstance(optimizer, OffloadAdamW):
        set_optimizer_state_dict(model, optimizer, optim["optimizer"])
    return _unpack(state[key])


def _load(state: dict[str, Any], path: str, planner: Any) -> None:
    """dcp.load, with a damaged or mismatched checkpoint (a ValueError on some rank, or a file of it cut
    short or garbled) raised as a one-line error named by its path, rather than DCP's gathered
    tracebacks; any other error (a tier that fails as subgroups go to it, a bug) as it is."""
    try:
        metadata = read_dcp_metadata(os.path.join(path, ".metadata"))  # here, so that a refusal is named once
    except CheckpointFileError as exc:
        raise ValueError(_unreadable(os.path.dirname(path), f"{os.path.basename(path)}/.metadata {exc.problem}")) from None
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path, metadata), planner=planner)
    except CheckpointException as exc:
        named = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointFileError)]
        if named:  # a path of the reader's, or a file name of the planner's (inside the part's dir)
            where = os.path.relpath(os.path.join(path, named[0].path), os.path.dirname(path))
            raise ValueError(_unreadable(os.path.dirname(path), f"{where} {named[0].problem}")) from None
        bad = [e for e, _ in exc.failures.values() if isinstance(e, ValueError)]
        if bad:
            raise ValueError(f"{path}: {bad[0]}") from exc
        unread = [e for e, _ in exc.failures.values() if _reading_failed(e, path)]
        if unread:
            raise ValueError(_unreadable(os.path.dirname(path), f"{os.path.basename(path)}/: {unread[0]!r}")) from exc
        raise


def _unreadable(path: str, what: str) -> str:
    """The error for a checkpoint that cannot be read, with the checkpoint to fall back to."""
    path = os.path.normpath(path)
    parent = os.path.dirname(path) or "."
    older = [os.path.normpath(d) for d in _step_dirs(parent) if os.path.basename(d) < os.path.basename(path)] if os.path.isdir(parent) else []
    instead = f"checkpoint.resume={older[-1]}" if older else "checkpoint.resume=never to start afresh"
    return (f"checkpoint {path} cannot be read ({what}): it may be damaged (an interrupted copy, a full disk); "
            f"restore it, or resume with {instead}")


def _optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """OffloadAdamW streams itself (a Stateful); a plain optimizer (offload=none) goes whole."""
    if isinstance(optimizer, OffloadAdamW):
        return OffloadOptimizerState(optimizer)
    return get_optimizer_state_dict(model, optimizer)
