"""Saving, checking and loading a training run's checkpoints (the layout: checkpoint/__init__.py)."""

from __future__ import annotations

import difflib
import functools
import io
import json
import logging
import os
import pickle
import re
import shutil
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

from ..dcp_reader import CheckpointFileError, SafeFileSystemReader, read_dcp_metadata
from ..dcp_reader import reading_failed as _reading_failed
from ..entry_digests import DigestingFileSystemWriter
from ..job_errors import JobError, os_error_line
from ..optimizer import OffloadAdamW
from ..optimizer_state import (
    OffloadOptimizerState, StreamingLoadPlanner, StreamingSavePlanner, WeightsOnlyLoadPlanner,
)  # fmt: skip
from .config import CheckpointConfig
from .files import FileOps, commit_dir
from .manifest import PARTS, check_manifest, write_manifest

RUN_FILE = "run.json"
log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_\d+$")  # a checkpoint, never a .tmp one being written
_OLD_DIR = re.compile(r"^step_\d+\.old$")  # one being removed
_TMP_DIR = re.compile(r"^step_\d+\.tmp$")  # one being written


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _on_rank0(what: str, work: Callable[[], None], directory: str) -> None:
    """Runs `work` on rank 0 and tells every rank how it went, so that a failure there is an error on
    every rank rather than a hang of the others in their next collective; rank 0 alone says it (a
    JobError), naming the path, checkpoint.dir and the fix. `what` names the work."""
    error: BaseException | None = None
    if _rank() == 0:
        try:
            work()
        except OSError as exc:
            error = JobError(f"{what}: {os_error_line(exc, {'checkpoint.dir': directory})}; the checkpoints saved before are intact")
            error.__cause__ = exc
        except BaseException as exc:  # the other ranks hear of it first
            error = exc
    if dist.is_initialized():
        status = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(status, src=0)
        if status[0] is not None and error is None:
            raise JobError(f"{what} failed on rank 0 ({status[0]}): rank 0 says how to fix it")
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


def is_checkpoint(path: str) -> bool:
    """Whether `path` is one complete checkpoint (a step_* dir with both parts)."""
    return all(os.path.isfile(os.path.join(path, part, ".metadata")) for part in ("model", "optimizer"))


def resume_point(cfg: CheckpointConfig) -> tuple[str | None, str]:
    """The checkpoint a run starts from (None: fresh) and one line that says which, per
    `checkpoint.resume`; a clear error where that cannot be honoured (a JobError: every rank reads the
    same dir, and rank 0 says it for the job)."""
    if cfg.dir and is_checkpoint(cfg.dir):
        raise JobError(
            f"checkpoint.dir={cfg.dir} is one checkpoint, not the dir of a run's checkpoints: give "
            f"checkpoint.dir={os.path.dirname(os.path.abspath(cfg.dir))}, or checkpoint.resume={cfg.dir} to start from it"
        )
    if cfg.resume == "never":
        return None, "checkpoint.resume=never: starting fresh"
    if cfg.resume not in ("auto", "required"):
        if not is_checkpoint(cfg.resume):
            mode = difflib.get_close_matches(str(cfg.resume), ["auto", "required", "never"], n=1)
            there = _step_dirs(cfg.dir)[-3:] if cfg.dir and os.path.isdir(cfg.dir) else []
            what = ("not a complete checkpoint (it needs model/ and optimizer/ with their .metadata)" if os.path.exists(cfg.resume)
                    else "no such dir (a run keeps checkpoint.keep of its newest: an older one is removed)")  # fmt: skip
            raise JobError(
                f"checkpoint.resume={cfg.resume}: {what}; give a step_* dir, or auto, required or never"
                + (f"; did you mean checkpoint.resume={mode[0]}?" if mode else "")
                + (f"; the newest in checkpoint.dir={cfg.dir}: {', '.join(there)}" if there else "")
            )
        return cfg.resume, f"resuming from {cfg.resume}"
    latest = latest_checkpoint(cfg.dir)
    if latest is not None:
        return latest, f"resuming from {latest}"
    if cfg.resume == "required":
        where = "checkpoint.dir is not set" if not cfg.dir else f"checkpoint.dir={cfg.dir} holds no complete checkpoint"
        raise JobError(f"checkpoint.resume=required, but {where}: start with checkpoint.resume=auto or never")
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


def _supersede_newer(directory: str, step: int) -> list[str]:
    """Renames the checkpoints in `directory` newer than `step` to `<name>.superseded` and returns their
    new paths. A run saving step k while a newer one is there re-does steps another run went past (it
    resumed from an older checkpoint): left in place, the keep policy would delete this run's saves
    before them, and a later checkpoint.resume=auto would go back to the other run. Kept, not deleted:
    they are the user's to remove."""
    moved = []
    for path in _step_dirs(directory):
        if int(os.path.basename(path)[len("step_"):]) > step:
            target, n = path + ".superseded", 1
            while os.path.exists(target):  # superseded before, by another rewind
                target, n = f"{path}.superseded{n}", n + 1
            os.replace(path, target)
            moved.append(target)
    return moved


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
    ops: FileOps | None = None,
) -> str:
    """Saves model shards, optimizer state and `rank_state` (data position, RNG, ...) atomically.

    `run` is what the checkpoint must match on resume (model args, world size, ...). `io_threads`
    subgroups are read from the tiers and written at once (each thread writes its own file). `ops`
    makes the commit's fsyncs and renames (a test records them)."""
    ops = ops or FileOps()
    final = os.path.join(directory, f"step_{step:08d}")
    tmp = final + ".tmp"

    def start() -> None:
        os.makedirs(directory, exist_ok=True)
        # the leftovers of a run killed while saving (this run holds the dir's lock: no other writes it): half-written
        # steps, of any step, and half-removed old ones
        for leftover in [os.path.join(directory, d) for d in os.listdir(directory) if _TMP_DIR.match(d) or _OLD_DIR.match(d)]:
            shutil.rmtree(leftover, ignore_errors=True)
        os.makedirs(tmp, mode=0o700)

    _on_rank0(f"creating {tmp}", start, directory)
    digests: dict[str, dict[str, int]] = {}
    self_checked: dict[str, list[str]] = {}
    try:
        writers = {"model": DigestingFileSystemWriter(os.path.join(tmp, "model")),
                   "optimizer": DigestingFileSystemWriter(os.path.join(tmp, "optimizer"), thread_count=io_threads)}  # fmt: skip
        model_state = {"model": get_model_state_dict(model), f"rank{_rank()}": _pack(rank_state)}
        dcp.save(model_state, storage_writer=writers["model"])
        dcp.save({"optimizer": _optimizer_state(model, optimizer)}, storage_writer=writers["optimizer"], planner=StreamingSavePlanner())
        for part, writer in writers.items():
            digests[part], self_checked[part] = writer.digests, sorted(writer.self_checked)
    except CheckpointException as exc:  # a full, read-only or vanished checkpoint.dir: one line, on rank 0
        _raise_interrupt(exc)
        _on_rank0(f"saving checkpoint {final}", functools.partial(_raise_os_error, exc, tmp), directory)
        raise
    if dist.is_initialized():  # every rank's entries, for the manifest
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (digests, self_checked))
        digests = {part: {k: v for d, _ in gathered for k, v in d[part].items()} for part in PARTS}
        self_checked = {part: sorted(k for _, s in gathered for k in s[part]) for part in PARTS}

    def commit() -> None:
        ops.write_file(os.path.join(tmp, RUN_FILE), json.dumps({**run, "step": step}, indent=1).encode())
        write_manifest(tmp, step, RUN_FILE, digests, self_checked, ops)  # refuses when a part is missing or short
        # Saving a step again (a run resumed from an earlier one): the complete old one goes aside and
        # only then away, so there is always a complete copy of the step on disk.
        replaced = _move_aside(final) if os.path.exists(final) else None
        superseded = _supersede_newer(directory, step)
        if superseded:
            log.warning("checkpoint %s: the newer ones in checkpoint.dir=%s are from a run that went further than this "
                        "one (which started from an older step, or afresh); moved aside, kept, so that "
                        "checkpoint.resume=auto starts from this run's: %s (remove them when no longer needed)",
                        final, directory, ", ".join(superseded))  # fmt: skip
        commit_dir(tmp, final, ops)  # every file and dir fsynced, renamed, the rename fsynced
        others = [d for d in _step_dirs(directory) if d != final]
        gone = [_move_aside(d) for d in others[: max(0, len(others) - (keep - 1))]]  # the one just written stays
        for d in ([replaced] if replaced else []) + gone:
            shutil.rmtree(d, ignore_errors=True)

    _barrier()
    _on_rank0(f"committing checkpoint {final}", commit, directory)
    return final


def _raise_interrupt(exc: CheckpointException) -> None:
    """Raises the Ctrl-C or the SIGTERM's SystemExit (train.py's) that DCP wrapped with the ranks' failures,
    on every rank alike (each is told of every rank's): the run ends as it was told to, not as a failed save."""
    stop = next((e for e, _ in exc.failures.values() if isinstance(e, (SystemExit, KeyboardInterrupt))), None)
    if stop is not None:
        raise stop from None


def _raise_os_error(exc: CheckpointException, tmp: str) -> None:
    """On rank 0, after a save failed: frees what the half-written checkpoint took and raises the
    first OSError of any rank (which _on_rank0 says in one line), else nothing (the save's own error
    is raised on every rank)."""
    shutil.rmtree(tmp, ignore_errors=True)
    oserrors = [e for e, _ in exc.failures.values() if isinstance(e, OSError)]
    if oserrors:  # a write to an open file names none: the dir being written is the one
        raise oserrors[0] if oserrors[0].filename else OSError(oserrors[0].errno, oserrors[0].strerror, tmp)


# what a run note holds that does not change the state, only the compute: a resume does not compare it
NOT_STATE = {"model": ("activation_checkpointing", "reshard_after_forward", "sum_grads_unsharded")}


def check_checkpoint(path: str, run: dict[str, Any]) -> int:
    """Raises a one-line JobError when the checkpoint at `path` was written by an incompatible run, or
    when a part of it is missing, damaged or from another checkpoint; returns its step."""
    saved = _whole_note(path)  # whole before compared: a damaged run.json is named as damaged
    differs = _first_difference(saved, run)
    if differs is not None:
        key, have, value = differs
        older = next((p for p in reversed(_step_dirs(os.path.dirname(os.path.abspath(path))))
                      if p != os.path.abspath(path) and _first_difference(_note_or_none(p), run) is None), None)  # fmt: skip
        also = f"; {older} was written with this run's settings: checkpoint.resume={older} starts from it" if older else ""
        raise JobError(f"checkpoint {path} was written with {key}={have}, this run has {key}={value}: resume with the "
                       f"same {key}, or point checkpoint.dir elsewhere to start afresh{also}")  # fmt: skip
    return int(saved["step"])


def _first_difference(saved: dict[str, Any] | None, run: dict[str, Any]) -> tuple[str, str, str] | None:
    """The first of `run`'s settings that a checkpoint's run note `saved` differs in (field by field), as
    (name, the note's, the run's); None where none does (a missing note differs in everything)."""
    if saved is None:
        return "run.json", "nothing", "a run note"
    shown = lambda d, k: repr(d[k]) if k in d else "nothing"  # noqa: E731
    for key, value in run.items():
        have = saved.get(key)
        if isinstance(value, dict) and isinstance(have, dict):  # field by field, the first that differs named
            fields = [k for k in {**have, **value} if k not in NOT_STATE.get(key, ())]
            differs = [k for k in fields if k not in have or k not in value or have[k] != value[k]]
            if differs:
                return f"{key}.{differs[0]}", shown(have, differs[0]), shown(value, differs[0])
        elif have != value:
            return key, shown(saved, key), repr(value)
    return None


def _whole_note(path: str) -> dict[str, Any]:
    """The checkpoint's run note once all of it checks out (metadata read unpickling no code, manifest), else a JobError."""
    for part in PARTS:
        if not os.path.isfile(os.path.join(path, part, ".metadata")):
            raise JobError(_unreadable(path, f"no {part}/.metadata: written by an older fsdp-offload (before checkpoints went "
                                             "through DCP as model/ and optimizer/), copied in part, or damaged"))  # fmt: skip
    saved = _run_note(path)
    for part in PARTS:
        try:
            read_dcp_metadata(os.path.join(path, part, ".metadata"))
        except CheckpointFileError as exc:
            raise JobError(_unreadable(path, f"{part}/.metadata {exc.problem}")) from None
    _manifest_digests(path, int(saved["step"]))
    return saved


def _note_or_none(path: str) -> dict[str, Any] | None:
    """_whole_note, or None where the checkpoint would be refused: an offer of another checkpoint skips it."""
    try:
        return _whole_note(path)
    except JobError:
        return None


def _run_note(path: str) -> dict[str, Any]:
    """The checkpoint's run.json, with its step; a JobError naming it when it cannot be read."""
    try:
        with open(os.path.join(path, RUN_FILE), "rb") as f:
            saved = json.loads(f.read())
        int(saved["step"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise JobError(_unreadable(path, f"{RUN_FILE}: {exc!r}")) from exc
    match = re.search(r"step_(\d+)$", os.path.basename(os.path.normpath(path)))
    if match and int(match.group(1)) != int(saved["step"]):
        raise JobError(_unreadable(path, f"{RUN_FILE} is of step {saved['step']}, its dir of step {int(match.group(1))}"))
    return saved


def _manifest_digests(path: str, step: int) -> tuple[dict[str, dict[str, int]], dict[str, set[str]]]:
    """The entries' digests and self-checked entries per part, once every part of the checkpoint
    agrees with its manifest."""
    try:
        return check_manifest(path, step)
    except CheckpointFileError as exc:
        where = os.path.relpath(exc.path, path)
        raise JobError(_unreadable(path, f"{where} {exc.problem}")) from None


def load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restores model shards and optimizer state, each entry checked against the manifest's digest;
    returns this rank's `rank_state`."""
    digests, self_checked = _manifest_digests(path, int(_run_note(path)["step"]))
    key = f"rank{_rank()}"
    state = {"model": get_model_state_dict(model), key: b""}
    _load(state, os.path.join(path, "model"), WeightsOnlyLoadPlanner(), digests["model"], self_checked["model"])
    set_model_state_dict(model, state["model"])
    optim = {"optimizer": _optimizer_state(model, optimizer)}
    _load(optim, os.path.join(path, "optimizer"), StreamingLoadPlanner(digests["optimizer"]), digests["optimizer"], self_checked["optimizer"])
    if not isinstance(optimizer, OffloadAdamW):
        set_optimizer_state_dict(model, optimizer, optim["optimizer"])
    try:
        return _unpack(state[key])
    except pickle.UnpicklingError:
        raise JobError(_unreadable(path, f"model/ entry {key}, the trainer state, holds more than tensors and plain values, "
                                   "so it is not loaded (it could run code)")) from None


def _load(state: dict[str, Any], path: str, planner: Any, digests: dict[str, int], self_checked: set[str]) -> None:
    """dcp.load, with a damaged or mismatched checkpoint (a ValueError on some rank, or a file of it cut
    short or garbled) raised as a one-line JobError named by its path, rather than DCP's gathered
    tracebacks; any other error (a tier that fails as subgroups go to it, a bug) as it is."""
    try:
        metadata = read_dcp_metadata(os.path.join(path, ".metadata"))  # here, so that a refusal is named once
    except CheckpointFileError as exc:
        raise JobError(_unreadable(os.path.dirname(path), f"{os.path.basename(path)}/.metadata {exc.problem}")) from None
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path, metadata, digests, self_checked), planner=planner)
    except CheckpointException as exc:
        _raise_interrupt(exc)
        named = [e for e, _ in exc.failures.values() if isinstance(e, CheckpointFileError)]
        if named:  # a path of the reader's, or a file name of the planner's (inside the part's dir)
            where = os.path.relpath(os.path.join(path, named[0].path), os.path.dirname(path))
            raise JobError(_unreadable(os.path.dirname(path), f"{where} {named[0].problem}")) from None
        bad = [e for e, _ in exc.failures.values() if isinstance(e, ValueError)]
        if bad:
            raise JobError(f"{path}: {bad[0]}") from exc
        unread = [e for e, _ in exc.failures.values() if _reading_failed(e, path)]
        if unread:
            raise JobError(_unreadable(os.path.dirname(path), f"{os.path.basename(path)}/: {unread[0]!r}")) from exc
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
