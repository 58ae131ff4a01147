"""Errors a job meets on every rank alike, said once: a bad option, a checkpoint that cannot be read
or written, a checkpoint dir held by another run, a full or read-only output dir. train.py prints a
JobError on rank 0 only (the other ranks exit with the same status, silently), and an OSError as one
line naming the path, the option that chose it and the fix."""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
from typing import Any, Callable

import torch.distributed as dist


class JobError(ValueError):
    """A fault that every rank of the job raises alike; one line naming the path, option and fix."""


def job_wide(read: Callable) -> Callable:
    """Makes the ValueErrors of `read` (reading the job's options, the same on every rank) JobErrors."""

    @functools.wraps(read)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return read(*args, **kwargs)
        except JobError:
            raise
        except ValueError as exc:
            raise JobError(str(exc)) from exc

    return wrapper


def raise_on_every_rank(error: str | None, group: dist.ProcessGroup | None) -> None:
    """Raises a JobError on every rank of `group` where any rank found `error` (a check whose answer
    may differ between nodes, such as a node-local dir): rank 0 says the first one, naming the ranks
    that found one when not all did, so another node's fault is said once and not lost."""
    errors = [error]
    if group is not None:
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    failed = [rank for rank, e in enumerate(errors) if e]
    if failed:
        where = "" if len(failed) == len(errors) else f" (on ranks {', '.join(map(str, failed))})"
        raise JobError(errors[failed[0]] + where)


# Seconds a rank other than 0 waits at most before it exits on an error rank 0 prints: under torchrun, the
# first rank to exit with an error has the launcher stop the others, rank 0 with its line unprinted (it
# lost that race on a busy machine)
LET_RANK0_SAY_S = 10.0


class _LauncherEnded(Exception):
    """The launcher's SIGTERM, taken by `wait_for_rank0_to_say_it`."""


def _launcher_ended(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one leaves the exit's cleanup whole
    raise _LauncherEnded


_sigterm_noted = False  # a SIGTERM came while `note_sigterm` held it


def note_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler that lets it be, as SIG_IGN would, and notes it: a rank that then waits for rank 0
    to say the job's error (`wait_for_rank0_to_say_it`) ends at once where the launcher's SIGTERM came first."""
    global _sigterm_noted
    _sigterm_noted = True


def wait_for_rank0_to_say_it() -> bool:
    """On a rank other than 0, after an error rank 0 prints for the job: waits until the launcher ends
    this rank (torchrun's SIGTERM, sent once rank 0 has exited, its line said; or sent before the wait,
    while `note_sigterm` held it) or LET_RANK0_SAY_S at most, under a launcher that sends none. Whether
    the SIGTERM came. SIGTERM is ignored from then on, so that the exit's own cleanup is not cut short."""
    try:
        try:
            signal.signal(signal.SIGTERM, _launcher_ended)  # (inside: one taken the moment it is installed is caught)
            if _sigterm_noted:
                raise _LauncherEnded
            time.sleep(LET_RANK0_SAY_S)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except _LauncherEnded:
        return True
    return False


def printed_by_another_rank(exc: BaseException) -> bool:
    """Whether rank 0 prints `exc` for the job (a JobError on another rank)."""
    return isinstance(exc, JobError) and int(os.environ.get("RANK", "0")) != 0


_FIXES = {
    errno.ENOSPC: "free space on that file system, or point {option} at one with room",
    errno.EDQUOT: "free space within your quota, or point {option} at a file system with room",
    errno.EROFS: "the file system is read-only: point {option} at a writable one",
    errno.EACCES: "uid {uid} may not write there: fix the dir's mode or owner, or point {option} elsewhere",
    errno.EPERM: "uid {uid} may not write there: fix the dir's mode or owner, or point {option} elsewhere",
    errno.ELOOP: "a symlink is in the way, and files are never written through links: remove it or point {option} elsewhere",
    errno.ENOENT: "it vanished while the run wrote it: check what else removes files there, or point {option} elsewhere",
    errno.EIO: "the device reported an I/O error: check it (dmesg), or point {option} elsewhere",
}
# a file system that takes no flock (Lustre mounted without flock, NFS without lockd): a run dir's lock,
# which keeps a second run from writing there at once, cannot be held
_NO_FLOCK = ("its file system takes no flock (Lustre without -o flock, NFS without lockd), which keeps a second run out of "
             "the dir: mount it with flock, or point {option} at a dir on a file system that has it")  # fmt: skip
_FIXES.update({errno.ENOLCK: _NO_FLOCK, errno.ENOSYS: _NO_FLOCK, errno.EOPNOTSUPP: _NO_FLOCK})


def os_error_line(exc: OSError, options: dict[str, str | None]) -> str:
    """One line for an OSError on a file under one of `options` (option -> its dir): what failed,
    on which path, which option chose that dir, and the fix."""
    path = os.fsdecode(exc.filename) if exc.filename is not None else None
    option = _owning_option(path, options) if path else None
    what = exc.strerror or str(exc)
    if option is None:
        return f"{what}: {path}" if path else what
    fix = _FIXES.get(exc.errno, "fix it, or point {option} elsewhere").format(option=option, uid=os.getuid())
    return f"{option}={options[option]}: cannot write {path} ({what}): {fix}"


def _owning_option(path: str, options: dict[str, str | None]) -> str | None:
    where = os.path.abspath(path)
    for option, directory in options.items():
        if directory and os.path.commonpath([where, os.path.abspath(directory)]) == os.path.abspath(directory):
            return option
    return None


def error_line(exc: BaseException, cfg: Any) -> str | None:
    """The one line train.py prints for `exc`: its message, or for an OSError on a dir the options
    chose (train.out_dir, Hydra's run dir, checkpoint.dir) the path, the option and the fix; None for
    an OSError elsewhere (its traceback says more)."""
    if not isinstance(exc, OSError) or isinstance(exc, FileNotFoundError) and exc.filename is None:
        return str(exc)
    options = _dir_options(cfg)
    if exc.filename is not None:
        line = os_error_line(exc, options)
        return line if _owning_option(os.fsdecode(exc.filename), options) else (str(exc) if isinstance(exc, FileNotFoundError) else None)
    # a write to an open file (the metrics, a log) names no path: the dir whose file system is full or read-only
    for option, directory in options.items():
        if directory and _cannot_write(directory, exc.errno):
            fix = _FIXES.get(exc.errno, "").format(option=option, uid=os.getuid())
            return f"{option}={directory}: writing the run's files there failed ({exc.strerror}): {fix}"
    return None


def _dir_options(cfg: Any) -> dict[str, str | None]:
    train, checkpoint = cfg.get("train") or {}, cfg.get("checkpoint") or {}
    out_dir = train.get("out_dir")
    if out_dir is None:
        try:
            import hydra

            out_dir = hydra.core.hydra_config.HydraConfig.get().runtime.output_dir
        except Exception:  # noqa: BLE001 - no Hydra run: no run dir to name
            out_dir = None
    return {"train.out_dir": None if out_dir is None else str(out_dir), "checkpoint.dir": checkpoint.get("dir")}


def _cannot_write(directory: str, code: int | None) -> bool:
    """Whether the file system of `directory` is full (ENOSPC/EDQUOT) or read-only (EROFS) now."""
    try:
        fs = os.statvfs(directory)
    except OSError:
        return False
    if code in (errno.ENOSPC, errno.EDQUOT):
        return fs.f_bavail == 0 or fs.f_favail == 0
    if code == errno.EROFS:
        return bool(fs.f_flag & os.ST_RDONLY)
    return False


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited", "NCCL communicator was aborted")


def a_peer_stopped(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because another rank of the job ended (gloo's closed
    connection, NCCL's aborted communicator): that rank's own error says why."""
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_GONE)


_TIMED_OUT = ("Timed out waiting", "Watchdog caught collective operation timeout", "timed out in blocking wait")


def a_collective_timed_out(exc: BaseException) -> bool:
    """Whether `exc` is a collective that waited past train.collective_timeout_s (gloo's "Timed out
    waiting ...ms", NCCL's watchdog) for a rank that neither answered nor ended; not a rendezvous or
    store that could not be reached (DistNetworkError, DistStoreError: a network fault, its own words)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)):
        return False
    return not a_peer_stopped(exc) and any(s in str(exc) for s in _TIMED_OUT)
