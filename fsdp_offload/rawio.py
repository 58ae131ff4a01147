"""A directory's raw I/O ceiling, measured as the pipeline does I/O (a pre-sized O_DIRECT file, its
request size and queue depth, reads and writes at once, the median of samples), with plain
pread/pwrite and no tier in between: what benchmarks compare the pipeline's effective I/O against.

- `measure_raw_io`: written, read, and read and written at once; GB/s of each.
- `mixed_io_timeline`: the mixed load held for a while, window by window (does the disk keep its rate?).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .cache import aligned_host_buffer
from .storage.base import ALIGN, TierError
from .storage.posix import open_private_file, pread_all, pwrite_all


@dataclass(frozen=True)
class RawIO:
    """A directory's raw bandwidth, measured the way the pipeline does I/O: a pre-sized O_DIRECT file,
    fixed-size requests from `threads` threads, read, written, and read and written at once. Each figure
    is the median of `samples` passes over the whole file, in GB/s."""

    path: str
    file_bytes: int
    request_bytes: int
    threads: int
    direct: bool
    write_gbps: float
    read_gbps: float
    mixed_gbps: float  # reads and writes at once (half the threads each): all bytes / the last finish
    mixed_read_gbps: float
    mixed_write_gbps: float
    samples: dict[str, list[float]]

    @property
    def read_write_gbps(self) -> float:
        """Writing then reading the same bytes, one after the other (harmonic mean of the two)."""
        return 2 / (1 / self.write_gbps + 1 / self.read_gbps)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "read_write_gbps": self.read_write_gbps}


class _RawFile:
    """A pre-sized file under `root` (in a private dir, removed on exit) and one request buffer per
    thread: what the raw measurements time plain pread/pwrite on, O_DIRECT where the file system
    takes it."""

    def __init__(self, root: str, file_bytes: int, request_bytes: int, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"raw I/O test: threads={threads}; give at least 1")
        self.request_bytes = max(ALIGN, request_bytes // ALIGN * ALIGN)
        self.file_bytes = max(2 * self.request_bytes, file_bytes // (2 * self.request_bytes) * 2 * self.request_bytes)
        self.offsets = list(range(0, self.file_bytes, self.request_bytes))
        if not os.path.isdir(root):
            raise TierError(f"raw I/O test: {root} is not a directory; give the tier dir to measure")
        self.root = root
        self.readers = max(1, threads // 2)  # the mixed passes: half the threads read, the rest write
        self.writers = max(1, threads - self.readers)
        # one buffer per thread of any pass (the mixed pass takes 2 even when threads=1)
        self.buffers = [memoryview(aligned_host_buffer(self.request_bytes).numpy()) for _ in range(max(threads, 2))]
        for b in self.buffers:  # incompressible, so a compressing file system cannot flatter itself
            b[:] = os.urandom(self.request_bytes)
        self.threads = threads
        self.folder = None
        try:
            self.folder = tempfile.mkdtemp(prefix="raw-io-", dir=root)  # 0700, new: nothing else's file is touched
            self.fd, self.direct = open_private_file(os.path.join(self.folder, "raw.bin"))
        except OSError as exc:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
            raise self.error(exc) from exc

    def __enter__(self) -> _RawFile:
        try:
            self.run(self.deal(pwrite_all, self.offsets, self.threads))  # pre-size: every block allocated
        except BaseException as exc:
            self.__exit__()
            if isinstance(exc, OSError):
                raise self.error(exc) from exc
            raise
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
        shutil.rmtree(self.folder, ignore_errors=True)

    def deal(self, op: Callable, offsets: list[int], n: int) -> list[list[tuple[Callable, int]]]:
        """`offsets` dealt round-robin into `n` job lists of `op`."""
        return [[(op, o) for o in offsets[i::n]] for i in range(n)]

    def mixed_jobs(self) -> list[list[tuple[Callable, int]]]:
        """Reads of the first half from the reader threads, writes of the second from the writers."""
        half = len(self.offsets) // 2
        return self.deal(pread_all, self.offsets[:half], self.readers) + self.deal(pwrite_all, self.offsets[half:], self.writers)

    def run(self, jobs: list[list[tuple[Callable, int]]], until: float | None = None, done=None) -> list[float]:
        """Runs each job list on its own thread (thread i with buffer i); returns each list's finish time
        from the common start. `until` (a perf_counter time): each list starts over until then;
        `done(thread, bytes, perf_counter)` is told of every request as it finishes."""
        ends = [0.0] * len(jobs)
        errors: list[BaseException] = []
        start = time.perf_counter()

        def go(i: int) -> None:
            try:
                while True:
                    for op, off in jobs[i]:
                        op(self.fd, self.buffers[i], off)
                        if done is not None:
                            done(i, self.request_bytes, time.perf_counter())
                        if until is not None and time.perf_counter() >= until:
                            break
                    if until is None or time.perf_counter() >= until:
                        break
            except BaseException as exc:
                errors.append(exc)
            ends[i] = time.perf_counter() - start

        pool = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if errors:
            raise errors[0]
        if not self.direct:
            os.fsync(self.fd)
            ends = [time.perf_counter() - start] * len(jobs)
        return ends

    def drop_cache(self) -> None:
        if not self.direct:  # buffered: reads must come from the disk, not the page cache
            os.fsync(self.fd)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def error(self, exc: OSError) -> TierError:
        return TierError(f"raw I/O test in {self.root} failed: {exc.strerror or exc} (is the file system full or read-only?)")


def measure_raw_io(root: str, file_bytes: int, request_bytes: int = 8 << 20, threads: int = 4, samples: int = 3) -> RawIO:
    """Times a pre-sized file under `root` (in a private dir, removed after) written, read, and read
    and written at once (reads from one half, writes to the other) in `request_bytes` requests
    from `threads` threads (the pipeline's queue depth); buffered I/O where O_DIRECT is refused, with
    an fsync in each timed write and the page cache dropped before each read."""
    got: dict[str, list[float]] = {k: [] for k in ("write_gbps", "read_gbps", "mixed_gbps", "mixed_read_gbps", "mixed_write_gbps")}
    with _RawFile(root, file_bytes, request_bytes, threads) as f:
        try:
            n = f.file_bytes
            for _ in range(samples):
                got["write_gbps"].append(n / max(f.run(f.deal(pwrite_all, f.offsets, threads))) / 1e9)
                f.drop_cache()
                got["read_gbps"].append(n / max(f.run(f.deal(pread_all, f.offsets, threads))) / 1e9)
                f.drop_cache()
                ends = f.run(f.mixed_jobs())
                moved = len(f.offsets) // 2 * f.request_bytes
                got["mixed_read_gbps"].append(moved / max(ends[: f.readers]) / 1e9)
                got["mixed_write_gbps"].append((n - moved) / max(ends[f.readers :]) / 1e9)
                got["mixed_gbps"].append(n / max(ends) / 1e9)
        except OSError as exc:
            raise f.error(exc) from exc
    medians = {k: statistics.median(v) for k, v in got.items()}
    return RawIO(root, f.file_bytes, f.request_bytes, threads, f.direct, samples=got, **medians)


def mixed_io_timeline(
    root: str, seconds: float, window_s: float = 5.0, file_bytes: int = 4 << 30, request_bytes: int = 8 << 20, threads: int = 4
) -> dict:
    """Reads and writes at once, as measure_raw_io's mixed pass, without a pause for `seconds`, and
    returns the GB/s read and written in each `window_s` window (by when each request finished; the
    last window ends with the last request): whether the disk holds its rate under sustained load (a
    cloud disk that bursts on credits does not). O_DIRECT only: buffered, it would time the page cache."""
    if not (seconds > 0 and window_s > 0):
        raise ValueError(f"mixed_io_timeline: seconds={seconds} and window_s={window_s} must be positive")
    windows = max(1, math.ceil(seconds / window_s))
    moved = [[0, 0] for _ in range(windows)]  # [read, written] bytes finished in each window
    lock = threading.Lock()
    with _RawFile(root, file_bytes, request_bytes, threads) as f:
        if not f.direct:
            raise TierError(f"raw I/O timeline: the file system of {root} refuses O_DIRECT, so the timeline would time "
                            "the page cache, not the disk; give a directory on the disk itself")  # fmt: skip
        start = time.perf_counter()
        last = [start]  # when the last request finished (run's own finish times count from its later start)

        def done(thread: int, nbytes: int, now: float) -> None:
            w = min(windows - 1, int((now - start) / window_s))
            with lock:
                moved[w][thread >= f.readers] += nbytes
                last[0] = max(last[0], now)

        try:
            f.run(f.mixed_jobs(), until=start + seconds, done=done)
        except OSError as exc:
            raise f.error(exc) from exc
        end = last[0]
    rows = []
    for w, (r, wr) in enumerate(moved):
        lo, hi = w * window_s, (w + 1) * window_s if w < windows - 1 else end - start
        rows.append({"t_s": round(hi, 3), "read_gbps": r / (hi - lo) / 1e9, "write_gbps": wr / (hi - lo) / 1e9,
                     "mixed_gbps": (r + wr) / (hi - lo) / 1e9})  # fmt: skip
    return {"path": root, "seconds": seconds, "window_s": window_s, "file_bytes": f.file_bytes,
            "request_bytes": f.request_bytes, "threads": threads, "direct": f.direct, "windows": rows}  # fmt: skip
