"""POSIX file tier: O_DIRECT (when the file system takes it) from a pool of threads.

A subgroup is cut into MiB-scale, 4 KiB-aligned requests that the pool issues in parallel; each
request loops over short reads and writes and carries a CRC32 so that a truncated or corrupted file
is caught on read and reported with its path.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import time
import zlib
from concurrent.futures import Future

import torch

from .base import (
    ALIGN,
    READ_PRIORITY,
    WRITE_PRIORITY,
    CorruptSubgroupError,
    IOWorkers,
    Tier,
    TierError,
    gather,
    transfer,
)

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Writes all of `view` at `offset`, looping over short writes."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        done += n


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    """Reads up to len(view) bytes at `offset`, looping over short reads; returns the count (EOF stops)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def make_private_dir(root: str, spec: str) -> str:
    """Returns `root`/fsdp-offload-<uid>, created 0700 and checked to be ours and not a symlink."""
    if not os.path.exists(root):
        raise TierError(f"{spec}: tier dir {root} does not exist; create it or pick another path")
    if not os.path.isdir(root):
        raise TierError(f"{spec}: {root} is not a directory; give a directory for the tier")
    if not os.access(root, os.W_OK | os.X_OK):
        raise TierError(f"{spec}: tier dir {root} is not writable by uid {os.getuid()}; fix its mode or pick another path")
    path = os.path.join(root, f"fsdp-offload-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise TierError(f"{spec}: cannot create {path}: {exc.strerror}; check the file system") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise TierError(
            f"{spec}: {path} exists but is not a 0700 directory owned by uid {os.getuid()} "
            "(a symlink or someone else's); remove it"
        )
    return path


def create_private_file(path: str) -> int:
    """Creates `path` 0600 for reading and writing: never an existing file, never through a symlink."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)


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


class PosixTier(Tier):
    """`posix:/dir[?threads=N&request_mb=M]`: one O_DIRECT file per rank under `dir`."""

    def __init__(self, spec: str, root: str, threads: int = 4, request_bytes: int = 8 << 20) -> None:
        super().__init__(spec)
        if request_bytes <= 0 or request_bytes % ALIGN:
            raise ValueError(f"{spec}: request size {request_bytes} must be a positive multiple of {ALIGN}")
        self.root = root
        self.threads = threads
        self.request_bytes = request_bytes
        self.direct = False
        self._fd = -1
        self._path = ""
        self._crcs: dict[int, list[int]] = {}
        self._workers: IOWorkers | None = None
        # Checks the dir at construction so a bad path fails before any training.
        self._dir = make_private_dir(root, spec)

    @property
    def path(self) -> str:
        return self._path

    def _open(self, tag: str, total_bytes: int) -> None:
        self._path = os.path.join(self._dir, f"{tag}.subgroups")
        try:
            self._fd, self.direct = open_private_file(self._path)
            os.ftruncate(self._fd, total_bytes)
        except OSError as exc:
            raise TierError(f"{self.spec}: cannot create {self._path}: {exc.strerror}") from exc
        if not self.direct:
            log.warning("%s: O_DIRECT is not supported on %s; using buffered I/O", self.spec, self.root)
        self._workers = IOWorkers(self.threads, self.spec)

    def _views(self, key: int, buf: torch.Tensor) -> tuple[int, memoryview, int]:
        offset = self._check_slot(key, buf)
        if self.direct and buf.data_ptr() % ALIGN:
            raise ValueError(f"{self.spec}: O_DIRECT buffer for subgroup {key} is not {ALIGN}-byte aligned")
        view = memoryview(buf.view(torch.uint8).numpy()).cast("B")
        return offset, view, len(view)

    def write(self, key: int, buf: torch.Tensor) -> Future:
        offset, view, nbytes = self._views(key, buf)
        fd, start = self._fd, time.perf_counter()
        chunks = range(0, nbytes, self.request_bytes)
        crcs = [0] * len(chunks)

        def write_chunk(i: int, lo: int) -> None:
            part = view[lo : lo + self.request_bytes]
            crcs[i] = zlib.crc32(part)
            try:
                _pwrite_all(fd, part, offset + lo)
            except OSError as exc:  # keeps the errno; says where and what to do
                raise OSError(
                    exc.errno,
                    f"writing subgroup {key} ({len(part)} bytes at offset {offset + lo}) failed: {exc.strerror}; "
                    f"free space on {self.root} or point offload.tiers elsewhere (nothing is lost: the subgroup "
                    "stays in host memory and the next step() retries)",
                    self._path,
                ) from exc

        def done() -> object:
            self._crcs[key] = crcs
            return transfer(self.spec, "write", key, nbytes, start)

        futs = [self._workers.submit(WRITE_PRIORITY, lambda i=i, lo=lo: write_chunk(i, lo)) for i, lo in enumerate(chunks)]
        return gather(futs, done)

    def read(self, key: int, buf: torch.Tensor) -> Future:
        offset, view, nbytes = self._views(key, buf)
        expected = self._crcs.get(key)
        if expected is None:
            raise TierError(f"{self.spec}: subgroup {key} was never written to {self._path}")
        fd, start = self._fd, time.perf_counter()

        def read_chunk(i: int, lo: int) -> None:
            part = view[lo : lo + self.request_bytes]
            got = _pread_all(fd, part, offset + lo)
            if got != len(part):
                raise CorruptSubgroupError(
                    f"{self._path}: subgroup {key} is truncated: wanted {len(part)} bytes at offset "
                    f"{offset + lo}, the file gave {got}"
                )
            if zlib.crc32(part) != expected[i]:
                raise CorruptSubgroupError(
                    f"{self._path}: subgroup {key} is corrupted: checksum mismatch in the "
                    f"{len(part)} bytes at offset {offset + lo}"
                )

        futs = [self._workers.submit(READ_PRIORITY, lambda i=i, lo=lo: read_chunk(i, lo)) for i, lo in enumerate(range(0, nbytes, self.request_bytes))]
        return gather(futs, lambda: transfer(self.spec, "read", key, nbytes, start))

    def close(self) -> None:
        if self._workers is not None:
            self._workers.shutdown()
            self._workers = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
