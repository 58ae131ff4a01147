"""What the file tiers (posix, kvikio) share: one private file per rank, and each subgroup moved as
chunk-sized requests that a pool of threads issues in parallel, each chunk with a checksum.

A backend supplies the file and the I/O of one chunk; this module cuts a subgroup into chunks, queues
them (reads of the next subgroup before writes of the last), checks them and times the transfer.
Checksums follow where the buffer lives: a CRC32 per chunk on the CPU for host buffers; for CUDA
buffers (KvikIO only), a sum (mod 2**64) of each chunk's 64-bit words, one reduction on the GPU,
because a CRC there would need a custom kernel and a CRC on the host would copy the whole subgroup
back. The sum catches truncation and overwritten bytes, not words swapped within one chunk.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import time
import zlib
from concurrent.futures import Future
from typing import Any, Callable

import torch

from ..node import node_ranks
from .base import READ_PRIORITY, WRITE_PRIORITY, CorruptSubgroupError, IOWorkers, Tier, TierError, Transfer, transfer
from .private_files import create_private_file, in_private_dir, make_private_dir, remove_private_dir, remove_stale_files
from .private_files import tier_file_tag, tier_root_problem  # (store.py and train.py take them from here)
from .spec import TierSpec, io_settings

__all__ = ["ChunkedFileTier", "punch_hole", "tier_file_tag", "tier_root_problem"]
log = logging.getLogger(__name__)


def _word_sums(flat: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """Per-chunk sums (mod 2**64) of a byte buffer's 64-bit words, on the buffer's device."""
    words = flat.view(torch.int64)
    per = chunk_bytes // 8
    full = words.numel() // per
    sums = [words[: full * per].view(full, per).sum(dim=1)]
    if words.numel() > full * per:
        sums.append(words[full * per :].sum().reshape(1))
    return torch.cat(sums)


def _after_queued_work(buf: torch.Tensor) -> Callable[[], None]:
    """What a chunk job waits for before it touches `buf`: for a CUDA buffer, the work queued on it so
    far (the backend copies on its own streams, so it must wait for the writer of a buffer it stores
    and the readers of one it fills); nothing for a host buffer."""
    if not buf.is_cuda:
        return lambda: None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(buf.device))
    return event.synchronize


def _flat_bytes(buf: torch.Tensor) -> torch.Tensor:
    return buf.detach().reshape(-1).view(torch.uint8)


_FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE (linux/falloc.h)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def punch_hole(path: str, offset: int, nbytes: int) -> bool:
    """Frees `nbytes` of `path`'s space at `offset` (the file keeps its size and reads zeros there);
    False when its file system cannot (EOPNOTSUPP)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if _libc.fallocate(fd, _FALLOC_PUNCH_HOLE, offset, nbytes) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise OSError(err, f"fallocate(PUNCH_HOLE) on {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


class ChunkedFileTier(Tier):
    """A tier that keeps this rank's subgroups in one file under `<dir>/fsdp-offload-<uid>/`.

    The skeleton makes the file (private_files.py: 0600, O_EXCL | O_NOFOLLOW, in the checked 0700 dir)
    and at close removes it, and the dir where no other file is in it. A backend supplies `_create` /
    `_close_file` (the file sized and open for its I/O; closed), `_chunk_source` (a buffer's bytes as
    it slices them) and `_write_at` / `_read_at` (one chunk; a short file is a CorruptSubgroupError).
    """

    def __init__(self, spec: TierSpec) -> None:
        super().__init__(spec.text)
        self.root = spec.path
        self.threads, self.chunk_bytes = io_settings(spec)
        self._path = ""
        self._held = -1  # a shared flock on this rank's file, while it is in use
        # Per subgroup: ("crc32" | "sum64", one checksum per chunk), as of its last good write.
        self._sums: dict[int, tuple[str, list[int]]] = {}
        self._workers: IOWorkers | None = None
        self._short_of_space = False  # no room for every slot of the node's ranks: stale copies are freed
        # Checks the dir at construction so a bad path fails before any training, then leaves it to the file
        # (attach makes it again): a tier built and never attached or closed leaves nothing behind.
        self._dir = make_private_dir(self.root, self.spec)
        remove_private_dir(self.root)

    @property
    def path(self) -> str:
        return self._path

    # -- what a backend supplies --------------------------------------------------------------------

    @abc.abstractmethod
    def _create(self, fd: int, total_bytes: int) -> None:
        """Sizes the new, empty file at `self._path` (made by the skeleton, open as `fd`) to `total_bytes`
        and readies it for I/O. Owns `fd`: keeps it, or closes it before raising (the skeleton then
        removes the file)."""

    @abc.abstractmethod
    def _close_file(self) -> bool:
        """Closes the file; whether one was open."""

    @abc.abstractmethod
    def _chunk_source(self, key: int, buf: torch.Tensor) -> Any:
        """`buf`'s bytes, sliced [lo:hi] into the chunks that `_write_at` and `_read_at` take; raises
        ValueError for a buffer the backend cannot use."""

    @abc.abstractmethod
    def _write_at(self, key: int, part: Any, file_offset: int) -> None:
        """Writes all of one chunk of subgroup `key` at `file_offset`."""

    @abc.abstractmethod
    def _read_at(self, key: int, part: Any, file_offset: int) -> None:
        """Fills one chunk of subgroup `key` from `file_offset`; CorruptSubgroupError if the file is short."""

    def _written(self, key: int) -> None:
        """Called once every chunk of a write of `key` has returned, before the write counts as good:
        a backend whose writes land later (buffered I/O) makes them land here, so that a failure is
        this write's error and not a later checksum mismatch."""

    # -- the skeleton -------------------------------------------------------------------------------

    def _open(self, tag: str, total_bytes: int) -> None:
        name = f"{tag}.subgroups"
        self._path = os.path.join(self._dir, name)
        self._short_of_space = shutil.disk_usage(self.root).free < total_bytes * node_ranks()  # the node's ranks write here too
        if self._short_of_space:
            log.info("%s: %s has less free space than every subgroup of the node's ranks takes: the stale copy of a "
                     "subgroup that changed in host memory is freed", self.spec, self.root)  # fmt: skip
        try:
            try:  # in the dir as checked, made again where its last user removed it meanwhile (private_files.py)
                fd = in_private_dir(self.root, self.spec, lambda dir_fd: self._create_held(dir_fd, tag))
            except OSError as exc:
                raise TierError(f"{self.spec}: cannot create {self._path}: {exc.strerror}; check the file system") from exc
            self._create(fd, total_bytes)
        except BaseException:
            self._remove_file()  # and the dir, where nothing else is in it
            raise
        self._workers = IOWorkers(self.threads, self.spec)

    def _create_held(self, dir_fd: int, tag: str) -> int:
        """Creates this rank's file in `dir_fd` and holds it (self._held); returns its fd. Held while
        the file is in use: a later start that finds it unheld knows its owner died."""
        remove_stale_files(self._dir, tag, dir_fd)
        name = f"{tag}.subgroups"
        fd = create_private_file(name, dir_fd)
        try:
            self._held = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                fcntl.flock(self._held, fcntl.LOCK_SH)
            except OSError as exc:  # a file system without flock (Lustre noflock, NFS without lockd)
                if exc.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                    raise
                log.info("%s: no flock on %s (%s): the process id alone marks it as in use", self.spec, self.root, exc.strerror)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):  # (the error to raise is the one above)
                os.unlink(name, dir_fd=dir_fd)
            if self._held >= 0:
                os.close(self._held)
                self._held = -1
            raise
        return fd

    def _submit(self, priority: int, nbytes: int, job: Callable[[int, int], None], done: Callable[[], Transfer]) -> Future:
        spans = range(0, nbytes, self.chunk_bytes)
        return self._workers.run_all(priority, [lambda i=i, lo=lo: job(i, lo) for i, lo in enumerate(spans)], done)

    def write(self, key: int, buf: torch.Tensor) -> Future:
        offset = self._check_slot(key, buf)
        data = self._chunk_source(key, buf)
        nbytes, start = buf.numel() * buf.element_size(), time.perf_counter()
        crcs = [0] * len(range(0, nbytes, self.chunk_bytes))
        sums = _word_sums(_flat_bytes(buf), self.chunk_bytes) if buf.is_cuda else None  # queued after buf's writer
        ready = _after_queued_work(buf)

        def write_chunk(i: int, lo: int) -> None:
            ready()
            part = data[lo : lo + self.chunk_bytes]
            if sums is None:
                crcs[i] = zlib.crc32(part)
            self._write_at(key, part, offset + lo)

        def done() -> Transfer:  # every chunk has waited for `ready`, so `sums` is computed
            self._written(key)
            self._sums[key] = ("crc32", crcs) if sums is None else ("sum64", sums.tolist())
            return transfer(self.spec, "write", key, nbytes, start)

        return self._submit(WRITE_PRIORITY, nbytes, write_chunk, done)

    def read(self, key: int, buf: torch.Tensor) -> Future:
        offset = self._check_slot(key, buf)
        data = self._chunk_source(key, buf)
        if key not in self._sums:
            raise TierError(f"{self.spec}: subgroup {key} was never written to {self._path}")
        kind, expected = self._sums[key]
        nbytes, start = buf.numel() * buf.element_size(), time.perf_counter()
        ready = _after_queued_work(buf)

        def corrupted(i: int) -> CorruptSubgroupError:
            lo = i * self.chunk_bytes
            return CorruptSubgroupError(
                f"{self._path}: subgroup {key} is corrupted: checksum mismatch in the "
                f"{min(self.chunk_bytes, nbytes - lo)} bytes at offset {offset + lo}"
            )

        def read_chunk(i: int, lo: int) -> None:
            ready()
            part = data[lo : lo + self.chunk_bytes]
            self._read_at(key, part, offset + lo)
            if kind == "crc32":  # written from host memory: a CUDA buffer is checked on a host copy
                if zlib.crc32(part.cpu().numpy() if buf.is_cuda else part) != expected[i]:
                    raise corrupted(i)

        def done() -> Transfer:
            if kind == "sum64":  # written from a CUDA buffer: one reduction wherever buf lives
                got = _word_sums(_flat_bytes(buf), self.chunk_bytes).tolist()
                bad = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e), None)
                if bad is not None:
                    raise corrupted(bad)
            return transfer(self.spec, "read", key, nbytes, start)

        return self._submit(READ_PRIORITY, nbytes, read_chunk, done)

    def discard(self, key: int) -> None:
        """Frees the slot's space only where the file system has no room for every slot (a hole costs
        the next write of the slot its block allocation)."""
        self._sums.pop(key, None)  # a read now fails as never written, rather than returning stale bytes
        if self._short_of_space and not punch_hole(self._path, self._slot_offsets[key], self._slot_bytes[key]):
            log.info("%s: the file system of %s cannot punch holes: stale subgroup copies keep their space", self.spec, self.root)
            self._short_of_space = False

    def close(self) -> None:
        if self._workers is not None:
            self._workers.shutdown()
            self._workers = None
        self._close_file()
        self._remove_file()

    def _remove_file(self) -> None:
        """Removes this rank's file, if any, then the private dir if no other file is in it: its last
        user takes it away (a process making a file there meanwhile makes it again)."""
        if self._held >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            os.close(self._held)
            self._held = -1
        remove_private_dir(self.root)
