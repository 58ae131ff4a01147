"""POSIX file tier: O_DIRECT (when the file system takes it) from a pool of threads.

A subgroup is cut into MiB-scale, 4 KiB-aligned requests that the pool issues in parallel; each
request loops over short reads and writes and carries a CRC32 so that a truncated or corrupted file
is caught on read and reported with its path. Where the file system refuses O_DIRECT, each subgroup's
write ends with an fdatasync, so that a write-back error is that write's error, or, where writes
overlap, the error of every write whose page it could be (nothing is fsynced for durability: tier
files are scratch, checkpoints are the durable copy).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from concurrent.futures import Future

import torch

from .base import ALIGN, CorruptSubgroupError, TierError
from .chunked import ChunkedFileTier
from .private_files import create_private_file
from .spec import TierSpec

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Writes all of `view` at `offset`, looping over short writes."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        done += n


def pread_all(fd: int, view: memoryview, offset: int) -> int:
    """Reads up to len(view) bytes at `offset`, looping over short reads; returns the count (EOF stops)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def open_private_file(path: str) -> tuple[int, bool]:
    """Creates `path` (create_private_file), then switches it to O_DIRECT if the file system takes an
    aligned O_DIRECT write, else keeps buffered I/O. Returns (fd, direct); on any error the file is
    removed again."""
    fd = create_private_file(path)
    try:
        return fd, _try_direct(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


def _try_direct(fd: int) -> bool:
    if not _O_DIRECT:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    probe = mmap.mmap(-1, ALIGN)  # page-aligned by construction
    try:
        os.pwrite(fd, probe, 0)
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return False
    finally:
        probe.close()


class PosixTier(ChunkedFileTier):
    """`posix:/dir[?threads=N&request_mb=M]`: one O_DIRECT file per rank under `dir`."""

    def __init__(self, spec: TierSpec) -> None:
        self.direct = False
        self._fd = -1
        # Buffered I/O only: the fdatasyncs begun and ended so far (one at a time), the ones that failed,
        # and how many had ended when each write in flight started (one running then may meet its pages).
        self._sync_lock = threading.Lock()
        self._syncs = 0
        self._syncs_ended = 0
        self._sync_errors: dict[int, OSError] = {}
        self._write_began: dict[int, int] = {}
        super().__init__(spec)

    def _create(self, fd: int, total_bytes: int) -> None:
        try:
            self.direct = _try_direct(fd)
            os.ftruncate(fd, total_bytes)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise TierError(f"{self.spec}: cannot create {self._path}: {exc.strerror}") from exc
            raise
        self._fd = fd
        if not self.direct:
            log.warning("%s: O_DIRECT is not supported on %s; using buffered I/O", self.spec, self.root)

    def _close_file(self) -> bool:
        if self._fd < 0:
            return False
        os.close(self._fd)
        self._fd = -1
        return True

    def _chunk_source(self, key: int, buf: torch.Tensor) -> memoryview:
        if self.direct and buf.data_ptr() % ALIGN:
            raise ValueError(f"{self.spec}: O_DIRECT buffer for subgroup {key} is not {ALIGN}-byte aligned")
        return memoryview(buf.view(torch.uint8).numpy()).cast("B")

    def _write_at(self, key: int, part: memoryview, file_offset: int) -> None:
        try:
            pwrite_all(self._fd, part, file_offset)
        except OSError as exc:
            raise self._write_error(key, f"({len(part)} bytes at offset {file_offset})", exc) from exc

    def write(self, key: int, buf: torch.Tensor) -> Future:
        if not self.direct:
            self._write_began[key] = self._syncs_ended
        return super().write(key, buf)

    def _written(self, key: int) -> None:
        """Buffered I/O: an fdatasync makes a write-back error this write's. The kernel reports such an
        error once, to whichever fdatasync meets it, though it may be any write's: so the syncs run one
        at a time, and a write fails if any sync that had not ended when it started failed, up to the first
        one that began once all of it was written (which, succeeding, wrote it back)."""
        if self.direct:  # O_DIRECT: pwrite returned once the device had the data
            return
        began, finished = self._write_began.pop(key), self._syncs
        with self._sync_lock:
            if self._syncs == finished:  # no sync has begun since it was all written: this one writes it back
                self._syncs += 1
                try:
                    os.fdatasync(self._fd)
                except OSError as exc:
                    self._sync_errors[self._syncs] = exc
                finally:
                    self._syncs_ended = self._syncs
            error = next((self._sync_errors[n] for n in range(began + 1, finished + 2) if n in self._sync_errors), None)
        if error is not None:
            raise self._write_error(key, f"back to {self._path}", error) from error

    def _write_error(self, key: int, what: str, exc: OSError) -> OSError:
        """A failed write of subgroup `key`, keeping the errno, saying where and what to do."""
        return OSError(
            exc.errno,
            f"writing subgroup {key} {what} failed: {exc.strerror}; free space on {self.root} or point offload.tiers "
            "elsewhere (nothing is lost: the subgroup stays in host memory and the next step() retries)",
            self._path,
        )

    def _read_at(self, key: int, part: memoryview, file_offset: int) -> None:
        got = pread_all(self._fd, part, file_offset)
        if got != len(part):
            raise CorruptSubgroupError(
                f"{self._path}: subgroup {key} is truncated: wanted {len(part)} bytes at offset "
                f"{file_offset}, the file gave {got}"
            )
