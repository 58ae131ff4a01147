"""One writer per checkpoint dir: the run that writes checkpoints into `checkpoint.dir` holds an
flock on `<dir>/.lock` for its whole life. A second run is refused at start, naming the holder (host,
pid, start time, written into the file); the kernel drops the lock of a process that dies, so a
crashed run's lock is taken over by the next run with no stale-lock cleanup."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

import torch.distributed as dist

from ..job_errors import JobError

LOCK_FILE = ".lock"
_held: list["CheckpointDirLock"] = []  # the run's lock (train.py holds one dir at a time)


class CheckpointDirBusy(JobError):
    """Another live process holds the checkpoint dir's lock."""


class CheckpointDirLock:
    """The lock of one checkpoint dir, held from `acquire()` to `release()` (or the process's end)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> "CheckpointDirLock":
        """Takes the lock or raises CheckpointDirBusy naming its holder; never waits."""
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointDirBusy(
                f"checkpoint.dir={self.directory} is being written by another run ({holder}; lock {self.path}): one run "
                "writes a checkpoint dir at a time; wait for that run to end, or give this one another checkpoint.dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        note = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, json.dumps(note).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing drops the flock

    def __enter__(self) -> "CheckpointDirLock":
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


def hold_checkpoint_dir(directory: str | None) -> None:
    """Rank 0 takes the lock of `directory` for the run (nothing without a checkpoint dir); every rank
    fails when it cannot, rank 0 saying why. Released by `release_checkpoint_dir`."""
    error = None
    if directory and (not dist.is_initialized() or dist.get_rank() == 0):
        try:
            _held.append(CheckpointDirLock(directory).acquire())
        except CheckpointDirBusy as exc:
            error = exc
        except OSError as exc:
            error = JobError(f"checkpoint.dir={directory}: cannot take its lock {os.path.join(directory, LOCK_FILE)} ({exc.strerror}): "
                             "make the dir writable, or give another checkpoint.dir")  # fmt: skip
    if directory and dist.is_initialized() and dist.get_world_size() > 1:
        refused = [error is not None]
        dist.broadcast_object_list(refused, src=0)
        if refused[0] and error is None:
            raise JobError(f"checkpoint.dir={directory} cannot be locked for this run: rank 0 says why")
    if error is not None:
        raise error


def release_checkpoint_dir() -> None:
    """Drops the lock `hold_checkpoint_dir` took (if any)."""
    while _held:
        _held.pop().release()
