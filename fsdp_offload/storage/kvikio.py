"""KvikIO file tier: subgroups read and written through `kvikio.CuFile`, from host or CUDA buffers.

KvikIO moves CUDA buffers with GPUDirect Storage when the nvidia-fs driver is loaded, and through
POSIX I/O and pinned bounce buffers otherwise (compat mode); host buffers, pinned or not, always go
through its POSIX thread pool. As in PosixTier (both are a ChunkedFileTier), a subgroup is cut into
task-sized chunks and each chunk carries a checksum, so that a truncated or corrupted file is caught
on read and reported with its path: CRC32 for host buffers, word sums on the GPU for CUDA buffers.

KvikIO is imported only when the tier is built (`pip install fsdp-offload[gds]`). It needs the CUDA
driver, libcuda.so.1, even for host buffers in compat mode, so this tier runs on GPU machines only.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from types import ModuleType
from typing import Any

import torch

from .base import CorruptSubgroupError, TierError
from .chunked import ChunkedFileTier
from .spec import TierSpec, io_settings

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


class KvikioTier(ChunkedFileTier):
    """`kvikio:/dir[?threads=N&task_mb=M]`: one file per rank under `dir`, moved by KvikIO.

    `gds` says whether CUDA buffers move by GPUDirect Storage (a file system that GDS does not
    support still falls back per file); `mode` is "gds" or "compat".
    """

    def __init__(self, spec: TierSpec) -> None:
        self._kvikio = _load_kvikio(spec.text)
        _configure_pool(self._kvikio, spec.text, *io_settings(spec))
        self.gds, self.mode = _gds_mode(self._kvikio)
        self._file: Any = None  # kvikio.CuFile
        super().__init__(spec)

    def _create(self, fd: int, total_bytes: int) -> None:
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
            raise TierError(f"{self.spec}: cannot open {self._path} with KvikIO: {exc}") from exc
        finally:
            os.close(fd)
        log.info("%s: KvikIO %s mode (GPUDirect Storage: %s; host buffers use POSIX I/O)", self.spec, self.mode, self.gds)

    def _close_file(self) -> bool:
        if self._file is None:
            return False
        self._file.close()
        self._file = None
        return True

    def _chunk_source(self, key: int, buf: torch.Tensor) -> Any:
        if not buf.is_contiguous():
            raise ValueError(f"{self.spec}: buffer for subgroup {key} is not contiguous")
        flat = buf.detach().reshape(-1).view(torch.uint8)
        # KvikIO takes CUDA tensors by the CUDA array interface, host memory by the buffer protocol.
        return flat if flat.is_cuda else flat.numpy()

    def _write_at(self, key: int, part: Any, file_offset: int) -> None:
        want = part.nbytes
        try:
            done = self._file.pwrite(part, want, file_offset, self.chunk_bytes).get()
        except (RuntimeError, OSError) as exc:
            raise self._io_error("writing", key, f"{want} bytes at offset {file_offset}", exc) from exc
        if done != want:
            raise self._io_error("writing", key, f"{want} bytes at offset {file_offset}", f"wrote {done} of {want} bytes")

    def _read_at(self, key: int, part: Any, file_offset: int) -> None:
        want, error = part.nbytes, None
        try:
            got = self._file.pread(part, want, file_offset, self.chunk_bytes).get()
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
        cause = error if error is not None else f"got {got} of {want} bytes"
        raise self._io_error("reading", key, f"{want} bytes at offset {file_offset}", cause) from error

    def _io_error(self, doing: str, key: int, what: str, cause: BaseException | str) -> OSError:
        """A failed transfer as an OSError, as PosixTier raises it: the pipeline fails over on OSError. It
        keeps the errno KvikIO gave (EIO where it gave none: its POSIX errors are RuntimeErrors)."""
        code = getattr(cause, "errno", None) or errno.EIO
        return OSError(
            code,
            f"{doing} subgroup {key} ({what}) failed: {cause}; check the file system of {self.root} or point "
            "offload.tiers elsewhere",
            self._path,
        )
