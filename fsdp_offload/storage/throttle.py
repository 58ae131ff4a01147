"""A tier slowed down to given speeds, to stand in for a slow or remote path on a machine with one disk.

`throttle:posix:/tmp/b?read=1.5GB/s&write=0.8GB/s&latency=2ms` stores subgroups in the wrapped tier
(`posix:/tmp/b`) and completes each transfer no sooner than a device of those speeds would. Reads and
writes share the device, as they do on a disk: a read costs latency + bytes / read rate of device
time, a write latency + bytes / write rate, and requests are served one at a time, reads first.
Options other than read, write and latency go to the wrapped tier (`...?threads=2&read=1GB/s`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from .base import READ_PRIORITY, WRITE_PRIORITY, IOWorkers, Tier, Transfer

@dataclass(frozen=True)
class Limits:
    """A device's speeds; None leaves that direction unlimited."""

    read_bps: float | None
    write_bps: float | None
    latency_s: float = 0.0

    def seconds(self, kind: str, nbytes: int) -> float:
        rate = self.read_bps if kind == "read" else self.write_bps
        return self.latency_s + (nbytes / rate if rate else 0.0)


class DeviceClock:
    """When a serial device starts and finishes each request: a token bucket of device-seconds with
    zero depth, so idle time earns no burst and waiting requests follow each other back to back.

    Times are absolute (perf_counter), so a pacing thread that wakes late delays nothing after it.
    """

    def __init__(self) -> None:
        self._free_at = 0.0
        self._lock = threading.Lock()

    def reserve(self, cost_s: float, arrival: float) -> tuple[float, float]:
        """Books `cost_s` of device time for a request that arrived at `arrival`: (start, end)."""
        with self._lock:
            start = max(self._free_at, arrival)
            self._free_at = start + cost_s
            return start, self._free_at

    def busy_until(self, t: float) -> None:
        """The device could not start anything before `t` (the wrapped tier took longer than booked)."""
        with self._lock:
            self._free_at = max(self._free_at, t)


class ThrottledTier(Tier):
    """Another tier, completing each transfer at the pace that `limits` allow."""

    def __init__(self, spec: str, inner: Tier, limits: Limits) -> None:
        super().__init__(spec)
        self.inner = inner
        self.limits = limits
        self._clock = DeviceClock()
        self._pacer: IOWorkers | None = None

    @property
    def path(self) -> str:
        return self.inner.path

    def set_limits(self, limits: Limits) -> None:
        """Changes the speeds from the next request on (a shared file system coming under load).

        For simulating a tier coming under load mid-run (tests, fault injection); a spec sets the first speeds.
        """
        self.limits = limits

    def _open(self, tag: str, total_bytes: int) -> None:
        self.inner.attach(tag, self._slot_bytes)
        self._pacer = IOWorkers(1, self.spec)  # one request at a time: a serial device

    def _paced(self, kind: str, key: int, buf: torch.Tensor, arrival: float) -> object:
        nbytes = buf.numel() * buf.element_size()
        start, done_at = self._clock.reserve(self.limits.seconds(kind, nbytes), arrival)
        op = self.inner.read if kind == "read" else self.inner.write
        op(key, buf).result()
        finished = time.perf_counter()
        if finished > done_at:
            self._clock.busy_until(finished)
        else:
            time.sleep(done_at - finished)
        # The device's own span, as the bandwidth model should learn it: the wrapped tier's end where it took
        # longer than booked; not when this pacing thread woke (late on a busy machine: a slower tier than
        # the one set)
        return Transfer(self.spec, kind, key, nbytes, start, max(done_at, finished))

    def write(self, key: int, buf: torch.Tensor) -> Future:
        self._check_slot(key, buf)
        arrival = time.perf_counter()
        return self._pacer.submit(WRITE_PRIORITY, lambda: self._paced("write", key, buf, arrival))

    def read(self, key: int, buf: torch.Tensor) -> Future:
        self._check_slot(key, buf)
        arrival = time.perf_counter()
        return self._pacer.submit(READ_PRIORITY, lambda: self._paced("read", key, buf, arrival))

    def discard(self, key: int) -> None:
        self.inner.discard(key)

    def close(self) -> None:
        if self._pacer is not None:
            self._pacer.shutdown()
            self._pacer = None
        self.inner.close()

