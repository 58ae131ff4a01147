"""The bandwidth model and the cost of a step: what each tier reads and writes, and how long it takes.

- `TierSpeed`: what one tier costs a request (latency and bandwidth each way).
- `BandwidthModel`: each tier's read and write bandwidth, learned from every transfer, and their noise.
- `StepTraffic` / `steady_traffic`: which subgroups each kind of step reads and writes in steady state.
- `expected_step_seconds`: the busiest tier's I/O time of a step, the one cost model of the placement
  rules, the planner, the log and the tests.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass

from .order import step_kinds
from .storage.base import Transfer

MIN_BPS = 1.0  # floor of any bandwidth the model uses: a stalled tier is very slow, never a division by zero


@dataclass(frozen=True)
class TierSpeed:
    """What one tier costs: seconds = latency + bytes / bandwidth, per request."""

    read_bps: float
    write_bps: float
    latency_s: float

    def seconds(self, kind: str, nbytes: int) -> float:
        rate = self.read_bps if kind == "read" else self.write_bps
        return self.latency_s + nbytes / max(rate, MIN_BPS)

    @property
    def valid(self) -> bool:
        numbers = (self.read_bps, self.write_bps, self.latency_s)
        return all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers) and (
            self.read_bps > 0 and self.write_bps > 0 and self.latency_s >= 0
        )

    def drifted_from(self, other: TierSpeed, tolerance: float) -> bool:
        """Whether read or write bandwidth differs from `other`'s by more than `tolerance` (relative)."""
        return any(
            abs(math.log(max(a, MIN_BPS) / max(b, MIN_BPS))) > math.log1p(tolerance)
            for a, b in ((self.read_bps, other.read_bps), (self.write_bps, other.write_bps))
        )


class BandwidthModel:
    """Each tier's read and write bandwidth, learned from every transfer; per-request latency as seeded.

    A transfer's record spans from when it was issued to when it finished, and on a busy tier that
    includes waiting behind other transfers. So a tier's busy time is shared out as a serial device
    spends it: each instant goes to the transfer, of those in flight then, that finishes first. Each
    transfer reports when it finishes (from the I/O threads), and claims the part of its span that no
    earlier-finished transfer has claimed. Its bandwidth sample is bytes / (claimed - latency); the
    estimate is the median of the last WINDOW samples of that tier and direction, so a one-off stall
    moves nothing and a lasting change takes over after WINDOW // 2 + 1 transfers. Latency stays at its
    calibrated value: subgroups are all about one size, so their times cannot tell it from bandwidth.
    """

    WINDOW = 7
    _CLAIMS_KEPT = 64

    def __init__(self, seeds: list[TierSpeed]) -> None:
        if not seeds:
            raise ValueError("a bandwidth model needs at least one tier")
        for i, s in enumerate(seeds):
            if not s.valid:
                raise ValueError(f"tier {i}: seed {s} must have positive, finite read/write rates and latency >= 0")
        self._latency = [s.latency_s for s in seeds]
        self._samples = [self._window(s) for s in seeds]
        self._claimed: list[list[list[float]]] = [[] for _ in seeds]  # per tier: disjoint [start, end], sorted
        self._lock = threading.Lock()
        self.observed = 0  # transfers learned from

    def speeds(self) -> list[TierSpeed]:
        with self._lock:
            return [
                TierSpeed(statistics.median(s["read"]), statistics.median(s["write"]), lat)
                for s, lat in zip(self._samples, self._latency)
            ]

    def spread(self) -> list[float]:
        """Each tier's noise: the larger of its read and write windows' median absolute deviation of
        log bandwidth (0.1: one timing is typically off by 10%). A lasting change shifts the median and
        leaves this small once most of the window has it; transfers too small to time the device (under
        8 MiB: each request's own costs and the scheduler's jitter) leave it large."""
        with self._lock:
            return [max(_log_spread(s["read"]), _log_spread(s["write"])) for s in self._samples]

    def reseed(self, speeds: dict[int, TierSpeed]) -> None:
        """Starts the given tiers over from these speeds, forgetting their samples."""
        with self._lock:
            for i, s in speeds.items():
                self._latency[i] = s.latency_s
                self._samples[i] = self._window(s)

    def _window(self, seed: TierSpeed) -> dict[str, deque[float]]:
        """Sample windows that start from the seed's bandwidths."""
        return {"read": deque([seed.read_bps], maxlen=self.WINDOW), "write": deque([seed.write_bps], maxlen=self.WINDOW)}

    def observe(self, tier: int, t: Transfer) -> None:
        """Learns from one finished transfer on `tier` (call it as each transfer finishes)."""
        if t.kind not in ("read", "write"):
            raise ValueError(f"transfer of kind {t.kind!r}: expected 'read' or 'write'")
        with self._lock:
            busy = self._claim(tier, t.start, t.end) - self._latency[tier]
            self.observed += 1
            if busy > 0 and t.nbytes > 0:
                self._samples[tier][t.kind].append(max(t.nbytes / busy, MIN_BPS))

    def _claim(self, tier: int, start: float, end: float) -> float:
        """Seconds of [start, end] that no earlier-finished transfer claimed; marks them claimed."""
        claimed = self._claimed[tier]
        free, merged, lo, hi = end - start, [], start, end
        for a, b in claimed:  # disjoint, so overlaps add up
            if b < start or a > end:
                merged.append([a, b])
                continue
            free -= max(0.0, min(b, end) - max(a, start))
            lo, hi = min(lo, a), max(hi, b)
        merged.append([lo, hi])
        merged.sort()
        self._claimed[tier] = merged[-self._CLAIMS_KEPT :]
        return max(free, 0.0)


def _log_spread(samples: deque[float]) -> float:
    logs = [math.log(x) for x in samples]  # (samples are at least MIN_BPS)
    mid = statistics.median(logs)
    return statistics.median(abs(x - mid) for x in logs)


# -- what a step moves ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTraffic:
    """Which subgroups each kind of step reads from and writes to the tiers, in steady state.

    With alternating order there are two kinds of step (ascending, descending); with fixed order one;
    with forward order the cycle it settles into (see order.step_kinds).
    A step in order O whose cache of C slots holds O[:C] when it starts (alternating and forward order
    leave it so) hits O[:C], reads O[C:] and writes O[:M-C] as it evicts them, least recently used first. With fixed
    order the cache holds the last C, which are evicted before the step reaches them: every subgroup is
    read and written every step.
    """

    orders: list[list[int]]
    reads: list[frozenset[int]]
    writes: list[frozenset[int]]

    @property
    def moving(self) -> frozenset[int]:
        """Subgroups that a tier ever sees in steady state; the others stay in the host cache."""
        return frozenset().union(*self.reads, *self.writes)


def steady_traffic(num_subgroups: int, cache_slots: int, update_order: str, forward: list[int] | None = None) -> StepTraffic:
    """`forward`: the subgroups in the order the model's forward uses them (default: ascending)."""
    m, c = num_subgroups, cache_slots
    orders = step_kinds(list(range(m)) if forward is None else forward, c, update_order)
    if update_order == "fixed":
        everything = frozenset(orders[0]) if c < m else frozenset()
        return StepTraffic(orders, [everything], [everything])
    return StepTraffic(orders, [frozenset(o[c:]) for o in orders], [frozenset(o[: max(0, m - c)]) for o in orders])


def spills(cache_slots: int, streamed: int) -> bool:
    """Whether any of the `streamed` subgroups (those off the GPU) reaches a tier: the host cache holds
    fewer of them than there are. (grad_path="tier_fp32" writes its grads to a tier either way.)"""
    return cache_slots < streamed


# -- what a step costs: the one cost model of the rules, the log and the tests -----------------------


def io_seconds(speed: TierSpeed, sg: int, nbytes: int, traffic: StepTraffic, kind: int) -> float:
    """Seconds that subgroup `sg` (of `nbytes`) costs a tier of `speed` in steps of kind `kind`."""
    read = speed.seconds("read", nbytes) if sg in traffic.reads[kind] else 0.0
    return read + (speed.seconds("write", nbytes) if sg in traffic.writes[kind] else 0.0)


def expected_step_seconds(tier_of: list[int], speeds: list[TierSpeed], sizes: list[int], traffic: StepTraffic) -> float:
    """Mean over the kinds of step of the busiest tier's I/O time, subgroup sg on tier `tier_of[sg]`:
    the update phase of an I/O-bound step whose tiers all stay busy. The makespan the learned rule
    minimises."""
    total = 0.0
    for kind, order in enumerate(traffic.orders):
        load = [0.0] * len(speeds)
        for sg in order:
            load[tier_of[sg]] += io_seconds(speeds[tier_of[sg]], sg, sizes[sg], traffic, kind)
        total += max(load)
    return total / len(traffic.orders)
