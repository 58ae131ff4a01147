"""Errors a job meets on every rank alike, said once: a bad option, a checkpoint that cannot be read
or written, a checkpoint dir held by another run, a full or read-only output dir. train.py prints a
JobError on rank 0 only (the other ranks exit with the same status, silently), and an OSError as one
line naming the path, the option that chose it and the fix."""

from __future__ import annotations

import errno
import os


class JobError(ValueError):
    """A fault that every rank of the job raises alike; one line naming the path, option and fix."""


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
