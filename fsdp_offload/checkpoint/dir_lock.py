"""One writer per run dir: a training run holds an flock on `<dir>/.lock` of its `checkpoint.dir` and of
its `train.out_dir` (its metrics rows, plan and TensorBoard dir) for its whole life. A second run given
either is refused at start, naming the holder (host, pid, start time, written into the file), before it
moves or writes anything there; the kernel drops the lock of a process that dies, so a crashed run's lock
is taken over by the next run with no stale-lock cleanup."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

import torch.distributed as dist

from ..job_errors import JobError, os_error_line

LOCK_FILE = ".lock"
_held: list["RunDirLock"] = []  # the run's locks (train.py's)


class RunDirBusy(JobError):
    """Another live process holds the run dir's lock."""


class RunDirLock:
    """The lock of one dir a run writes (`option` names it), held from `acquire()` to `release()` (or the
    process's end)."""

    def __init__(self, directory: str, option: str = "checkpoint.dir") -> None:
        self.directory, self.option = directory, option
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        """Takes the lock or raises RunDirBusy naming its holder; never waits."""
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            note = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            os.pwrite(fd, json.dumps(note).encode(), 0)  # (a full disk fails here: the lock goes with the fd)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirBusy(
                f"{self.option}={self.directory} is being written by another run ({holder}; lock {self.path}): one run "
                f"writes a dir at a time; wait for that run to end, or give this one another {self.option}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing drops the flock

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> str:
    """The holder as its note says ('host h, pid p, since t'), or that the note cannot be read."""
    try:
        note = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {note['host']}, pid {note['pid']}, since {note['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder did not say who it is"


def hold_run_dirs(dirs: dict[str, str | None]) -> None:
    """Rank 0 takes the lock of each dir of `dirs` (option name -> dir; None: none), one dir named twice
    once; every rank fails when it cannot, rank 0 saying why. Released by `release_run_dirs`."""
    error, taken = None, set()
    if not dist.is_initialized() or dist.get_rank() == 0:
        for option, directory in dirs.items():
            if directory is None or os.path.realpath(directory) in taken:
                continue
            try:
                _held.append(RunDirLock(directory, option).acquire())
                taken.add(os.path.realpath(directory))
            except RunDirBusy as exc:
                error = exc
            except OSError as exc:  # (the path, the option and the fix, as any write there names them)
                error = JobError(os_error_line(exc if exc.filename else OSError(exc.errno, exc.strerror, os.path.join(directory, LOCK_FILE)),
                                               {option: directory}))  # fmt: skip
            if error is not None:
                break
    if dist.is_initialized() and dist.get_world_size() > 1:
        refused = [error is not None]
        dist.broadcast_object_list(refused, src=0)
        if refused[0] and error is None:
            raise JobError(f"{', '.join(f'{k}={v}' for k, v in dirs.items() if v)}: cannot be locked for this run: rank 0 says why")
    if error is not None:
        release_run_dirs()
        raise error


def release_run_dirs() -> None:
    """Drops the locks `hold_run_dirs` took (if any)."""
    while _held:
        _held.pop().release()
