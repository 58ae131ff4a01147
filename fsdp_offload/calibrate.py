"""Raw bandwidth of a tier's directory: parallel aligned pwrite/pread, as the tier itself issues them.

The numbers are the ceiling the offload pipeline is measured against (effective I/O / raw) and the
seed of the bandwidth model.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .cache import aligned_host_buffer
from .storage.base import TierError
from .storage.posix import _pread_all, _pwrite_all, make_private_dir, open_private_file


@dataclass(frozen=True)
class RawBandwidth:
    path: str
    nbytes: int
    request_bytes: int
    threads: int
    direct: bool
    write_gbps: float
    read_gbps: float
    latency_s: float  # one 4 KiB read, median of a few

    @property
    def read_write_gbps(self) -> float:
        """Bandwidth of writing then reading the same bytes (harmonic mean of the two)."""
        return 2 / (1 / self.write_gbps + 1 / self.read_gbps)


def measure_raw_bandwidth(
    root: str, nbytes: int = 2 << 30, request_bytes: int = 8 << 20, threads: int = 4
) -> RawBandwidth:
    """Writes then reads `nbytes` under `root` with `threads` threads of `request_bytes` requests."""
    if nbytes % request_bytes:
        nbytes -= nbytes % request_bytes
    if nbytes <= 0:
        raise ValueError(f"raw bandwidth test of {nbytes} bytes: give at least one {request_bytes}-byte request")
    spec = f"raw:{root}"
    path = os.path.join(make_private_dir(root, spec), f"raw-bandwidth-{os.getpid()}.bin")
    fd, direct = open_private_file(path)
    buffers = [memoryview(aligned_host_buffer(request_bytes).numpy()) for _ in range(threads)]
    offsets = list(range(0, nbytes, request_bytes))
    try:

        def run(op) -> float:
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: op(fd, buffers[i % threads], offsets[i]), range(len(offsets))))
            if op is _pwrite_all:
                os.fsync(fd)
            return time.perf_counter() - start

        write_s = run(_pwrite_all)
        read_s = run(_pread_all)
        small = memoryview(aligned_host_buffer(4096).numpy())
        lat = []
        for off in offsets[:: max(1, len(offsets) // 5)][:5]:
            t0 = time.perf_counter()
            _pread_all(fd, small, off)
            lat.append(time.perf_counter() - t0)
    except OSError as exc:
        raise TierError(f"raw bandwidth test in {root} failed: {exc.strerror} (is the file system full or read-only?)") from exc
    finally:
        os.close(fd)
        os.unlink(path)
    return RawBandwidth(
        root, nbytes, request_bytes, threads, direct, nbytes / write_s / 1e9, nbytes / read_s / 1e9, sorted(lat)[len(lat) // 2]
    )
