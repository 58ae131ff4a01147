"""The MLP-Offload paper's per-step metrics: update time and throughput, I/O volume and speed; and
the update's phases named in a profiler trace (`traced`).

Effective I/O throughput is bytes moved over the time I/O was under way (the union of the transfers'
intervals): for an update phase bound by I/O this is 2 x subgroup bytes / (read + write time).
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, TypeVar

import torch

from .storage.base import Transfer

log = logging.getLogger("fsdp_offload.metrics")

_F = TypeVar("_F", bound=Callable)


def traced(name: str) -> Callable[[_F], _F]:
    """Names each call of the function in a torch profiler trace (train.py's `train.profile_step`,
    which records every thread; scripts/trace_ops.py --region reads what it holds). A region object of
    its own each call (record_function keeps its handle on itself); a few microseconds a call when no
    profiler runs."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def named(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return named  # type: ignore[return-value]

    return wrap


def busy_seconds(transfers: list[Transfer]) -> float:
    """Length of the union of the transfers' [start, end] intervals."""
    total, end = 0.0, float("-inf")
    for t in sorted(transfers, key=lambda t: t.start):
        if t.start > end:
            total += t.end - t.start
            end = t.end
        elif t.end > end:
            total += t.end - end
            end = t.end
    return total


@dataclass
class StepMetrics:
    step: int
    update_s: float
    params: int  # params updated this step
    subgroups: int
    cache_hits: int
    subgroups_read: int = 0
    subgroups_written: int = 0
    bytes_read: dict[str, int] = field(default_factory=dict)  # per tier spec
    bytes_written: dict[str, int] = field(default_factory=dict)
    read_s: dict[str, float] = field(default_factory=dict)  # busy time of reads per tier
    write_s: dict[str, float] = field(default_factory=dict)
    io_busy_s: float = 0.0
    subgroups_per_tier: dict[str, int] = field(default_factory=dict)  # where stored copies live
    skipped: bool = False  # fp16 overflow: the step changed nothing
    subgroups_on_gpu: int = 0  # whose state lives in GPU memory
    lock_wait_s: dict[str, float] = field(default_factory=dict)  # time waiting for node-level tier locks
    # step()'s time to take the global grad norm: the hooks took each grad's sum of squares, so this
    # is their sum (plus any accumulated grads'), the all-reduce, and the wait for the GPU work queued
    # before it; 0 when the step needs no norm, about 0 when clip_grad_norm_() took it already
    norm_s: float = 0.0
    # Time in the CPU kernel over the subgroups updated in host memory: the part of update_s that the
    # planner's CPU rate predicts (the rest: the norm, waits for grads, I/O, the copies back into the
    # model, and the updates of subgroups kept on the GPU)
    cpu_kernel_s: float = 0.0
    # The part of update_s the training loop waited for: step() itself, plus, with the update
    # overlapped, the next forward's waits for its subgroups. None until the update has finished.
    exposed_update_s: float | None = None

    @property
    def overlap_s(self) -> float | None:
        """Update time hidden behind the training loop's own work."""
        return None if self.exposed_update_s is None else max(0.0, self.update_s - self.exposed_update_s)

    @property
    def update_mparams_per_s(self) -> float:
        return self.params / self.update_s / 1e6 if self.update_s > 0 else 0.0

    @property
    def effective_io_gbps(self) -> float:
        moved = sum(self.bytes_read.values()) + sum(self.bytes_written.values())
        return moved / self.io_busy_s / 1e9 if self.io_busy_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["update_mparams_per_s"] = self.update_mparams_per_s
        d["effective_io_gbps"] = self.effective_io_gbps
        d["overlap_s"] = self.overlap_s
        return d

    def log(self) -> None:
        log.debug(json.dumps(self.as_dict()))


def step_metrics(
    step: int,
    update_s: float,
    params: int,
    subgroups: int,
    cache_hits: int,
    transfers: list[Transfer],
    location: dict[int, str],
) -> StepMetrics:
    """Folds one step's transfers into a StepMetrics."""
    m = StepMetrics(step, update_s, params, subgroups, cache_hits)
    for kind, nbytes, secs in (("read", m.bytes_read, m.read_s), ("write", m.bytes_written, m.write_s)):
        by_tier: dict[str, list[Transfer]] = {}
        for t in transfers:
            if t.kind == kind:
                by_tier.setdefault(t.tier, []).append(t)
        for tier, ts in by_tier.items():
            nbytes[tier] = sum(t.nbytes for t in ts)
            secs[tier] = busy_seconds(ts)
    m.subgroups_read = sum(t.kind == "read" for t in transfers)
    m.subgroups_written = sum(t.kind == "write" for t in transfers)
    m.io_busy_s = busy_seconds(transfers)
    m.subgroups_per_tier = dict(Counter(location.values()))
    return m
