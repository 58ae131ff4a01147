"""What every storage tier is: a place that stores and returns whole subgroups by key.

A tier keeps one file per rank. Each subgroup has a fixed slot in it (`attach`), so a subgroup is one
I/O of MiB-scale, 4 KiB-aligned requests. Reads and writes return futures that resolve to a
`Transfer` record, which the bandwidth model and the metrics learn from.
"""

from __future__ import annotations

import abc
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

ALIGN = 4096

# Priorities of the I/O queue: reads of the next subgroup go before writes of the last.
READ_PRIORITY = 0
WRITE_PRIORITY = 1


class TierError(RuntimeError):
    """A tier cannot do what was asked; the message names the path and the fix."""


class CorruptSubgroupError(TierError):
    """A subgroup read back differs (in size or checksum) from what was written."""


@dataclass(frozen=True)
class Transfer:
    """One finished subgroup transfer, as the bandwidth model and metrics see it."""

    tier: str
    kind: str  # "read" | "write"
    key: int
    nbytes: int
    start: float  # time.perf_counter()
    end: float


class IOWorkers:
    """A fixed pool of threads fed by a priority queue (lower value first, FIFO within one)."""

    def __init__(self, num_threads: int, name: str) -> None:
        if num_threads < 1:
            raise ValueError(f"{name}: I/O thread count must be >= 1, got {num_threads}")
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-io{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, fn: Callable[[], object]) -> Future:
        fut: Future = Future()
        self._queue.put((priority, next(self._seq), fn, fut))
        return fut

    def _loop(self) -> None:
        while True:
            _, _, fn, fut = self._queue.get()
            if fn is None:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to whoever waits on the future
                fut.set_exception(exc)

    def run_all(self, priority: int, jobs: list[Callable[[], None]], then: Callable[[], object]) -> Future:
        """Queues `jobs` at `priority`; returns a future of `then()`, which the worker thread that finishes
        the last job runs (never the caller: a tier's write returns before its fdatasync, however fast its
        chunks were). It waits for every job even after one fails, so a buffer is never reused while a
        request on it is still in flight; the first job's failure (in `jobs` order) is what it raises."""
        out: Future = Future()
        jobs = jobs or [lambda: None]
        errors: list[BaseException | None] = [None] * len(jobs)
        remaining = [len(jobs)]
        lock = threading.Lock()

        def run(i: int) -> None:
            try:
                jobs[i]()
            except BaseException as exc:  # handed to whoever waits on `out`
                errors[i] = exc
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            failed = next((e for e in errors if e is not None), None)
            if failed is not None:
                out.set_exception(failed)
                return
            try:
                out.set_result(then())
            except BaseException as exc:
                out.set_exception(exc)

        for i in range(len(jobs)):
            self.submit(priority, lambda i=i: run(i))
        return out

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put((1 << 30, next(self._seq), None, None))
        for t in self._threads:
            t.join()


class Tier(abc.ABC):
    """A storage path for subgroups. Subclasses do the I/O; this class holds what is common."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._slot_offsets: list[int] = []
        self._slot_bytes: list[int] = []

    @property
    def name(self) -> str:
        return self.spec

    @property
    def lock_wait_s(self) -> float | None:
        """Seconds spent so far waiting for this tier's node lock; None for a tier without one."""
        return None

    def attach(self, tag: str, slot_bytes: list[int]) -> None:
        """Creates this rank's file, with one 4 KiB-aligned slot per subgroup.

        `tag` makes the file unique per process and rank (e.g. "rank3-<run id>").
        """
        offsets, off = [], 0
        for n in slot_bytes:
            if n % ALIGN:
                raise ValueError(f"{self.spec}: slot of {n} bytes is not a multiple of {ALIGN}")
            offsets.append(off)
            off += n
        self._slot_offsets, self._slot_bytes = offsets, list(slot_bytes)
        self._open(tag, off)

    def _check_slot(self, key: int, buf: torch.Tensor) -> int:
        nbytes = buf.numel() * buf.element_size()
        if not 0 <= key < len(self._slot_bytes):
            raise KeyError(f"{self.spec}: no slot for subgroup {key} (it has {len(self._slot_bytes)})")
        if nbytes != self._slot_bytes[key]:
            raise ValueError(
                f"{self.spec}: subgroup {key} slot is {self._slot_bytes[key]} bytes, buffer is {nbytes}"
            )
        return self._slot_offsets[key]

    @abc.abstractmethod
    def _open(self, tag: str, total_bytes: int) -> None: ...

    @abc.abstractmethod
    def write(self, key: int, buf: torch.Tensor) -> Future:
        """Starts writing `buf` (a contiguous host tensor) to subgroup `key`'s slot.

        The future resolves to a Transfer once every byte is known written.
        """

    @abc.abstractmethod
    def read(self, key: int, buf: torch.Tensor) -> Future:
        """Starts reading subgroup `key` into `buf`; raises CorruptSubgroupError on a bad read."""

    def discard(self, key: int) -> None:
        """Gives back the file space of subgroup `key`'s stored copy, which a newer host copy has made
        stale (its slot reads as never written until it is written again). A tier that cannot free
        space keeps it; nothing is lost either way."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops the workers and deletes this rank's file."""

    @property
    @abc.abstractmethod
    def path(self) -> str:
        """The file this rank's subgroups live in (for messages)."""


def transfer(tier: str, kind: str, key: int, nbytes: int, start: float) -> Transfer:
    return Transfer(tier, kind, key, nbytes, start, time.perf_counter())
