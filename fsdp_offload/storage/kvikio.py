"""KvikIO file tier: subgroups read and written through `kvikio.CuFile`, from host or CUDA buffers.

KvikIO moves CUDA buffers with GPUDirect Storage when the nvidia-fs driver is loaded, and through
POSIX I/O and pinned bounce buffers otherwise (compat mode); host buffers, pinned or not, always go
through its POSIX thread pool. As in PosixTier, a subgroup is cut into task-sized chunks and each chunk
carries a checksum, so that a truncated or corrupted file is caught on read and reported with its
path: CRC32 on the CPU for host buffers; for CUDA buffers, a sum (mod 2**64) of the chunk's 64-bit
words, one reduction on the GPU, because a CRC there would need a custom kernel and a CRC on the host
would copy the whole subgroup back. The sum catches truncation and overwritten bytes, not words
swapped within one chunk.

KvikIO is imported only when the tier is built (`pip install fsdp-offload[gds]`). It needs the CUDA
driver, libcuda.so.1, even for host buffers in compat mode, so this tier runs on GPU machines only.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
import zlib
from concurrent.futures import Future
from types import ModuleType
from typing import Any

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
from .posix import create_private_file, make_private_dir

log = logging.getLogger(__name__)

# KvikIO's thread pool and default task size are process-wide: the last KvikioTier built sets them.
_pool_settings: tuple[int, int] | None = None


def _cuda_driver_error() -> str | None:
    """Why the CUDA driver cannot be used here, or None when it can."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return str(exc)
    rc = libcuda.cuInit(0)
    return None if rc == 0 else f"cuInit failed with CUDA error {rc}"


def _load_kvikio(spec: str) -> ModuleType:
    reason = _cuda_driver_error()
    if reason is not None:
        raise TierError(
            f"{spec}: KvikIO cannot do I/O, not even host I/O in compat mode, without the CUDA driver "
            f"libcuda.so.1 and a GPU ({reason}); use a posix: tier on this machine"
        )
    try:
        import kvikio
        import kvikio.cufile_driver
        import kvikio.defaults
    except ImportError as exc:
        raise TierError(f"{spec}: the kvikio tier needs KvikIO: pip install fsdp-offload[gds] ({exc})") from exc
    return kvikio


def _configure_pool(kvikio: ModuleType, spec: str, threads: int, task_bytes: int) -> None:
    global _pool_settings
    if _pool_settings not in (None, (threads, task_bytes)):
        log.warning(
            "%s: KvikIO's thread pool is process-wide; %d threads / %d-byte tasks replace %d / %d",
            spec, threads, task_bytes, *_pool_settings,
        )
    kvikio.defaults.set({"num_threads": threads, "task_size": task_bytes})
    _pool_settings = (threads, task_bytes)


def _gds_mode(kvikio: ModuleType) -> tuple[bool, str]:
    """(whether CUDA buffers move by GPUDirect Storage, "gds" | "compat")."""
    if kvikio.defaults.is_compat_mode_preferred():  # KvikIO does POSIX I/O itself (compat ON, or no libcufile)
        return False, "compat"
    try:
        # libcufile loaded, but without nvidia-fs cuFile falls back to POSIX I/O on its own.
        gds = bool(kvikio.cufile_driver.get("is_gds_available"))
    except RuntimeError:  # the cuFile driver would not open
        gds = False
    return gds, "gds" if gds else "compat"


def _word_sums(flat: torch.Tensor, chunk_bytes: int) -> torch.Tensor:
    """Per-chunk sums (mod 2**64) of a byte buffer's 64-bit words, on the buffer's device."""
    words = flat.view(torch.int64)
    per = chunk_bytes // 8
    full = words.numel() // per
    sums = [words[: full * per].view(full, per).sum(dim=1)]
    if words.numel() > full * per:
        sums.append(words[full * per :].sum().reshape(1))
    return torch.cat(sums)


def _after_queued_work(flat: torch.Tensor) -> torch.cuda.Event | None:
    """For a CUDA buffer, an event after the work queued on it so far: KvikIO copies on its own
    streams, so it must wait for the writer of a buffer it stores and the readers of one it fills."""
    if not flat.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(flat.device))
    return event


class KvikioTier(Tier):
    """`kvikio:/dir[?threads=N&task_mb=M]`: one file per rank under `dir`, moved by KvikIO.

    `gds` says whether CUDA buffers move by GPUDirect Storage (a file system that GDS does not
    support still falls back per file); `mode` is "gds" or "compat".
    """

    def __init__(self, spec: str, root: str, threads: int = 4, task_bytes: int = 8 << 20) -> None:
        super().__init__(spec)
        if threads < 1:
            raise ValueError(f"{spec}: threads must be >= 1, got {threads}")
        if task_bytes <= 0 or task_bytes % ALIGN:
            raise ValueError(f"{spec}: task size {task_bytes} must be a positive multiple of {ALIGN}")
        self.root = root
        self.threads = threads
        self.task_bytes = task_bytes
        self._kvikio = _load_kvikio(spec)
        _configure_pool(self._kvikio, spec, threads, task_bytes)
        self.gds, self.mode = _gds_mode(self._kvikio)
        self._file: Any = None  # kvikio.CuFile
        self._path = ""
        # Per subgroup: ("crc32" | "sum64", one checksum per chunk), as of its last good write.
        self._sums: dict[int, tuple[str, list[int]]] = {}
        self._workers: IOWorkers | None = None
        self._dir = make_private_dir(root, spec)

    @property
    def path(self) -> str:
        return self._path

    def _open(self, tag: str, total_bytes: int) -> None:
        self._path = os.path.join(self._dir, f"{tag}.subgroups")
        try:
            fd = create_private_file(self._path)
        except OSError as exc:
            raise TierError(f"{self.spec}: cannot create {self._path}: {exc.strerror}") from exc
        try:
            os.ftruncate(fd, total_bytes)
            # CuFile opens by path: check that it opened the file created above, not a swapped one.
            self._file = self._kvikio.CuFile(self._path, "r+")
            if not os.path.samestat(os.fstat(fd), os.fstat(self._file.fileno())):
                raise TierError(f"{self._path} was replaced while KvikIO opened it")
        except (OSError, RuntimeError, ValueError) as exc:
            if self._file is not None:
                self._file.close()
                self._file = None
            os.unlink(self._path)
            raise TierError(f"{self.spec}: cannot open {self._path} with KvikIO: {exc}") from exc
        finally:
            os.close(fd)
        log.info("%s: KvikIO %s mode (GPUDirect Storage: %s; host buffers use POSIX I/O)", self.spec, self.mode, self.gds)
        self._workers = IOWorkers(self.threads, self.spec)

    def _flat(self, key: int, buf: torch.Tensor) -> tuple[int, torch.Tensor]:
        offset = self._check_slot(key, buf)
        if not buf.is_contiguous():
            raise ValueError(f"{self.spec}: buffer for subgroup {key} is not contiguous")
        return offset, buf.detach().reshape(-1).view(torch.uint8)

    def _pwrite(self, key: int, part: Any, file_offset: int) -> None:
        want = part.nbytes
        try:
            done = self._file.pwrite(part, want, file_offset, self.task_bytes).get()
        except (RuntimeError, OSError) as exc:
            raise TierError(f"{self._path}: writing subgroup {key} at offset {file_offset} failed: {exc}") from exc
        if done != want:
            raise TierError(f"{self._path}: writing subgroup {key} at offset {file_offset} wrote {done} of {want} bytes")

    def _pread(self, key: int, part: Any, file_offset: int) -> None:
        want, error = part.nbytes, None
        try:
            got = self._file.pread(part, want, file_offset, self.task_bytes).get()
        except (RuntimeError, OSError) as exc:  # KvikIO reports a short file as "POSIX error on pread: EOF"
            got, error = -1, exc
        if got == want:
            return
        size = os.fstat(self._file.fileno()).st_size
        if size < file_offset + want:
            raise CorruptSubgroupError(
                f"{self._path}: subgroup {key} is truncated: wanted {want} bytes at offset {file_offset}, "
                f"the file has {size} bytes"
            ) from error
        raise TierError(
            f"{self._path}: reading subgroup {key} at offset {file_offset} failed: "
            f"{error if error is not None else f'got {got} of {want} bytes'}"
        ) from error

    def write(self, key: int, buf: torch.Tensor) -> Future:
        offset, flat = self._flat(key, buf)
        nbytes, start = flat.numel(), time.perf_counter()
        chunks = range(0, nbytes, self.task_bytes)
        # KvikIO takes CUDA tensors by the CUDA array interface, host memory by the buffer protocol.
        data: Any = flat if flat.is_cuda else flat.numpy()
        crcs = [0] * len(chunks)
        sums = _word_sums(flat, self.task_bytes) if flat.is_cuda else None  # queued after buf's writer
        ready = _after_queued_work(flat)

        def write_chunk(i: int, lo: int) -> None:
            if ready is not None:
                ready.synchronize()
            part = data[lo : lo + self.task_bytes]
            if sums is None:
                crcs[i] = zlib.crc32(part)
            self._pwrite(key, part, offset + lo)

        def done() -> object:  # every chunk has waited for `ready`, so `sums` is computed
            self._sums[key] = ("crc32", crcs) if sums is None else ("sum64", sums.tolist())
            return transfer(self.spec, "write", key, nbytes, start)

        futs = [self._workers.submit(WRITE_PRIORITY, lambda i=i, lo=lo: write_chunk(i, lo)) for i, lo in enumerate(chunks)]
        return gather(futs, done)

    def read(self, key: int, buf: torch.Tensor) -> Future:
        offset, flat = self._flat(key, buf)
        if key not in self._sums:
            raise TierError(f"{self.spec}: subgroup {key} was never written to {self._path}")
        kind, expected = self._sums[key]
        nbytes, start = flat.numel(), time.perf_counter()
        data: Any = flat if flat.is_cuda else flat.numpy()
        ready = _after_queued_work(flat)

        def corrupted(i: int) -> CorruptSubgroupError:
            lo = i * self.task_bytes
            return CorruptSubgroupError(
                f"{self._path}: subgroup {key} is corrupted: checksum mismatch in the "
                f"{min(self.task_bytes, nbytes - lo)} bytes at offset {offset + lo}"
            )

        def read_chunk(i: int, lo: int) -> None:
            if ready is not None:
                ready.synchronize()
            part = data[lo : lo + self.task_bytes]
            self._pread(key, part, offset + lo)
            if kind == "crc32":  # written from host memory: a CUDA buffer is checked on a host copy
                if zlib.crc32(part.cpu().numpy() if flat.is_cuda else part) != expected[i]:
                    raise corrupted(i)

        def done() -> object:
            if kind == "sum64":  # written from a CUDA buffer: one reduction wherever buf lives
                got = _word_sums(flat, self.task_bytes).tolist()
                bad = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e), None)
                if bad is not None:
                    raise corrupted(bad)
            return transfer(self.spec, "read", key, nbytes, start)

        futs = [self._workers.submit(READ_PRIORITY, lambda i=i, lo=lo: read_chunk(i, lo)) for i, lo in enumerate(range(0, nbytes, self.task_bytes))]
        return gather(futs, done)

    def close(self) -> None:
        if self._workers is not None:
            self._workers.shutdown()
            self._workers = None
        if self._file is not None:
            self._file.close()
            self._file = None
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
