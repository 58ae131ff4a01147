"""Which tier a subgroup is written to when it leaves the host cache, and the bandwidth model behind it.

Three rules, one per `offload.placement`:
- "fixed": shares given by `tier_ratios`.
- "eq1": the MLP-Offload paper's Eq. 1: T_i = ceil(M * B_i / sum B) subgroups on tier i (trimmed to
  sum to M), with B_i = min(read, write) bandwidth of tier i.
- "learned": the split that minimises the expected update phase. It knows which subgroups the host
  cache keeps (they never reach a tier), what each step reads and writes (with alternating order a
  subgroup is read in one step and written in the next, or both in the middle of the order), costs
  reads and writes at their own bandwidths, and interleaves tiers along the next step's order so that
  every tier is busy all through the step.

Both bandwidth rules replan when a tier's learned bandwidth drifts; a subgroup then moves to its new
tier when it is next flushed, which it is anyway: replanning costs no I/O.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from .calibrate import MIN_BPS, BandwidthProfile, TierSpeed, seed_speeds, tier_profile_key
from .config import OffloadConfig
from .node import node_peers
from .order import step_kinds
from .storage import TierError
from .storage.base import Transfer
from .subgroups import SubgroupLayout

log = logging.getLogger(__name__)


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

    def __len__(self) -> int:
        return len(self._latency)

    def speeds(self) -> list[TierSpeed]:
        with self._lock:
            return [
                TierSpeed(statistics.median(s["read"]), statistics.median(s["write"]), lat)
                for s, lat in zip(self._samples, self._latency)
            ]

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


# -- what a step costs: the one cost model of the rules, the log and the tests -----------------------


def io_seconds(speed: TierSpeed, sg: int, nbytes: int, traffic: StepTraffic, kind: int) -> float:
    """Seconds that subgroup `sg` (of `nbytes`) costs a tier of `speed` in steps of kind `kind`."""
    read = speed.seconds("read", nbytes) if sg in traffic.reads[kind] else 0.0
    return read + (speed.seconds("write", nbytes) if sg in traffic.writes[kind] else 0.0)


def expected_step_seconds(tiers: list[int], speeds: list[TierSpeed], sizes: list[int], traffic: StepTraffic) -> float:
    """Mean over the kinds of step of the busiest tier's I/O time: the update phase of an I/O-bound
    step whose tiers all stay busy. The makespan the learned rule minimises."""
    total = 0.0
    for kind, order in enumerate(traffic.orders):
        load = [0.0] * len(speeds)
        for sg in order:
            load[tiers[sg]] += io_seconds(speeds[tiers[sg]], sg, sizes[sg], traffic, kind)
        total += max(load)
    return total / len(traffic.orders)


# -- the rules --------------------------------------------------------------------------------------


def smooth_round_robin(shares: list[float], num_subgroups: int) -> list[int]:
    """Tier of each subgroup, in proportion to `shares` and interleaved along the subgroups: subgroup
    k goes to the tier furthest behind its share after k placements (smooth weighted round-robin)."""
    if not shares or any(r < 0 for r in shares) or sum(shares) <= 0:
        raise ValueError(f"placement shares {shares} must be non-negative with a positive sum")
    total = sum(shares)
    credit = [0.0] * len(shares)
    out = []
    for _ in range(num_subgroups):
        for i, r in enumerate(shares):
            credit[i] += r / total
        best = max(range(len(shares)), key=lambda i: credit[i])
        credit[best] -= 1.0
        out.append(best)
    return out


def eq1_counts(bandwidths: list[float], num_subgroups: int) -> list[int]:
    """The paper's Eq. 1: T_i = ceil(M * B_i / sum B), then the most over-rounded trimmed until they sum to M."""
    total = sum(bandwidths)
    exact = [num_subgroups * b / total for b in bandwidths]
    counts = [math.ceil(x) for x in exact]
    while sum(counts) > num_subgroups:
        i = max(range(len(counts)), key=lambda i: counts[i] - exact[i])
        counts[i] -= 1
    return counts


def plan_eq1(speeds: list[TierSpeed], num_subgroups: int) -> list[int]:
    counts = eq1_counts([min(s.read_bps, s.write_bps) for s in speeds], num_subgroups)
    return smooth_round_robin([float(c) for c in counts], num_subgroups)


def plan_makespan(speeds: list[TierSpeed], sizes: list[int], traffic: StepTraffic) -> list[int]:
    """The learned rule. Walks the next step's order and gives each subgroup the tier that keeps the
    expected update phase (summed over the kinds of step) lowest, ties going to the tier that would
    finish its share earliest; walking in order balances every prefix, which keeps all tiers busy as
    the pipeline works through a step. Then moves single subgroups to other tiers while that still
    lowers it (the walk decides early subgroups before it knows the totals). Subgroups the cache keeps
    cost no step anything: they go where a full flush (a checkpoint) would end soonest."""
    n, kinds = len(speeds), range(len(traffic.orders))
    cost = {sg: [[io_seconds(speeds[i], sg, sizes[sg], traffic, k) for i in range(n)] for k in kinds] for sg in traffic.orders[0]}
    load = [[0.0] * n for _ in kinds]
    flush = [0.0] * n
    tiers = [0] * len(sizes)

    def makespan_with(sg: int, i: int, without: int | None = None) -> float:
        """Summed step makespans if `sg` (now on `without`, or nowhere) were on tier i."""
        total = 0.0
        for k in kinds:
            row = load[k]
            total += max(row[j] + (cost[sg][k][i] if j == i else 0.0) - (cost[sg][k][j] if j == without else 0.0) for j in range(n))
        return total

    for sg in traffic.orders[0]:
        flush_cost = [speeds[i].seconds("write", sizes[sg]) for i in range(n)]

        def score(i: int) -> tuple[float, float, float]:
            full_flush = max(flush[j] + (flush_cost[i] if j == i else 0.0) for j in range(n))
            finish = max(load[k][i] + cost[sg][k][i] for k in kinds)
            return makespan_with(sg, i), full_flush, finish

        best = min(range(n), key=score)
        for k in kinds:
            load[k][best] += cost[sg][k][best]
        flush[best] += flush_cost[best]
        tiers[sg] = best

    moving = [sg for sg in traffic.orders[0] if sg in traffic.moving]
    improved = True
    while improved:
        improved = False
        for sg in moving:
            here = tiers[sg]
            now = makespan_with(sg, here, without=here)
            better = min(range(n), key=lambda i: makespan_with(sg, i, without=here))
            if makespan_with(sg, better, without=here) < now * (1 - 1e-9):
                for k in kinds:
                    load[k][here] -= cost[sg][k][here]
                    load[k][better] += cost[sg][k][better]
                tiers[sg] = better
                improved = True
    return tiers


class FixedRatioPlacement:
    """Spreads subgroups over tiers in fixed proportions (1 tier: everything goes there)."""

    def __init__(self, ratios: list[float], num_subgroups: int) -> None:
        self._ratios = list(ratios)
        self._tier = smooth_round_robin(ratios, num_subgroups)

    def tier_for(self, sg: int) -> int:
        return self._tier[sg]

    def drop(self, tier: int) -> None:
        """Takes `tier` out of the split (it failed): its share goes to the others. Refused, changing
        nothing, when no other tier has a share."""
        ratios = [0.0 if i == tier else r for i, r in enumerate(self._ratios)]
        if sum(ratios) <= 0:
            raise ValueError(f"cannot drop tier {tier}: no other tier has a share")
        self._ratios = ratios
        self._tier = smooth_round_robin(ratios, len(self._tier))

    def observe(self, tier: int, transfer: Transfer) -> None:
        """Fixed placement learns nothing from transfers."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the split follows from the ratios alone."""

    def close(self) -> None:
        """Fixed placement has nothing to save."""


class AdaptivePlacement:
    """A bandwidth rule (`plan`: speeds -> tier of each subgroup) kept current with a BandwidthModel;
    `predict` (tiers, speeds -> seconds) is what a plan is expected to cost a step, for the log.

    Replans when any tier's read or write bandwidth has moved by more than DRIFT since the current
    plan was made (less would only shuffle subgroups on noise), and then saves the new numbers to the
    profile, so the next run starts from them.
    """

    DRIFT = 0.10

    def __init__(
        self,
        model: BandwidthModel,
        plan: Callable[[list[TierSpeed]], list[int]],
        predict: Callable[[list[int], list[TierSpeed]], float],
        name: str,
        tier_specs: list[str],
        profile: BandwidthProfile | None = None,
    ) -> None:
        if len(tier_specs) != len(model):
            raise ValueError(f"{len(tier_specs)} tier specs for a model of {len(model)} tiers")
        self.model = model
        self.name = name
        self.tier_specs = tier_specs
        self._plan_fn = plan
        self._predict = predict
        self._profile = profile
        self._keys = [tier_profile_key(s) for s in tier_specs]
        self.replans = 0
        self.basis: list[TierSpeed] = []
        self.tiers: list[int] = []
        self.dropped: set[int] = set()  # tiers that failed: planned as all but unusable, and never chosen
        self._plan(model.speeds())

    def _plan(self, speeds: list[TierSpeed]) -> None:
        usable = [TierSpeed(MIN_BPS, MIN_BPS, s.latency_s) if i in self.dropped else s for i, s in enumerate(speeds)]
        fastest = max((i for i in range(len(speeds)) if i not in self.dropped), key=lambda i: min(usable[i].read_bps, usable[i].write_bps))
        previous, self.tiers = self.tiers, [fastest if t in self.dropped else t for t in self._plan_fn(usable)]
        self.basis = speeds
        log.log(
            logging.INFO if self.tiers != previous else logging.DEBUG,  # a replan that moves nothing is noise
            "placement %s (expected update I/O %.3g s a step): %s",
            self.name,
            self._predict(self.tiers, speeds),
            ", ".join(
                f"{spec} {self.tiers.count(i)} subgroups (read {s.read_bps / 1e9:.3g} GB/s, write {s.write_bps / 1e9:.3g} GB/s)"
                for i, (spec, s) in enumerate(zip(self.tier_specs, speeds))
            ),
        )

    def tier_for(self, sg: int) -> int:
        speeds = self.model.speeds()
        if any(now.drifted_from(then, self.DRIFT) for now, then in zip(speeds, self.basis)):
            self._plan(speeds)
            self.replans += 1
            self._save(speeds)
        return self.tiers[sg]

    def observe(self, tier: int, transfer: Transfer) -> None:
        self.model.observe(tier, transfer)

    def drop(self, tier: int) -> None:
        """Takes `tier` out of the plan (it failed) and replans over the others."""
        if len(self.dropped | {tier}) == len(self.tier_specs):
            raise ValueError(f"cannot drop tier {tier}: no other tier is left")
        self.dropped.add(tier)
        self._plan(self.model.speeds())

    def state_dict(self) -> dict:
        """The learned speeds by tier, so that a run resumed from a checkpoint starts from them even
        without a profile. Tiers are named by profile key (resolved path and options)."""
        return {"speeds": {k: [s.read_bps, s.write_bps, s.latency_s] for k, s in zip(self._keys, self.model.speeds())}}

    def load_state_dict(self, state: dict) -> None:
        """Takes the saved speeds of the tiers this optimizer also has (the others keep theirs) and replans."""
        saved = state.get("speeds", {})
        restored = {}
        for i, key in enumerate(self._keys):
            if key in saved:
                speed = TierSpeed(*map(float, saved[key]))
                if not speed.valid:
                    raise ValueError(f"checkpoint's placement state has an unusable speed for {key}: {saved[key]}")
                restored[i] = speed
        if restored:
            self.model.reseed(restored)
            self._plan(self.model.speeds())

    def _save(self, speeds: list[TierSpeed]) -> None:
        if self._profile is not None:
            self._profile.save_learned(dict(zip(self._keys, speeds)))

    def close(self) -> None:
        """Saves what was learned to the profile and lets go of it."""
        if self._profile is None:
            return
        if self.model.observed:
            self._save(self.model.speeds())
        self._profile.close()
        self._profile = None


def check_speeds(speeds: list[TierSpeed], tiers: list[str]) -> None:
    """Refuses given tier speeds that do not match the tiers one to one, or that no model can use."""
    if len(speeds) != len(tiers):
        raise ValueError(f"tier_speeds has {len(speeds)} entries for the {len(tiers)} offload.tiers {tiers}: give one per tier, in order")
    for spec, speed in zip(tiers, speeds):
        if not isinstance(speed, TierSpeed) or not speed.valid:
            raise ValueError(f"tier_speeds for {spec!r} is {speed!r}: give a TierSpeed with positive read_bps and write_bps "
                             "and a latency_s >= 0 (as fsdp_offload.plan measures them)")  # fmt: skip


def placement_request_bytes(cfg: OffloadConfig) -> int:
    """The transfer size a placement's tiers are measured with: one state slot (12 bytes a param), at
    most 64 MiB."""
    return min(12 * cfg.subgroup_numel, 64 << 20)


def placement_measures(cfg: OffloadConfig) -> bool:
    """Whether the placement starts from the tiers' speeds (make_placement's bandwidth rules: 2+ tiers)."""
    return len(cfg.tiers) >= 2 and cfg.placement != "fixed"


def tier_speeds(cfg: OffloadConfig) -> list[TierSpeed]:
    """The tiers' speeds from the bandwidth profile, measured (as make_placement would) when it lacks them."""
    profile = None if cfg.bandwidth_profile is None else BandwidthProfile(cfg.bandwidth_profile)
    try:
        return seed_speeds(cfg.tiers, profile, int(cfg.calibration_gb * (1 << 30)), placement_request_bytes(cfg))
    finally:
        if profile is not None:
            profile.close()


def node_tier_speeds(cfg: OffloadConfig, group: dist.ProcessGroup | None) -> list[TierSpeed]:
    """tier_speeds, taken by the first rank of each node of `group` and handed to the node's other ranks
    (a collective), so that a node measures its tiers once, not once per rank."""
    if group is None:
        return tier_speeds(cfg)
    first = node_peers(group)[0]
    everyone: list[tuple[str, object] | None] = [None] * dist.get_world_size(group)
    if dist.get_rank(group) == first:
        try:
            speeds = tier_speeds(cfg)
        except Exception as exc:  # the node's other ranks wait for this rank: tell them, then raise
            dist.all_gather_object(everyone, ("error", f"{type(exc).__name__}: {exc}"), group=group)
            raise
        dist.all_gather_object(everyone, ("speeds", speeds), group=group)
        return speeds
    dist.all_gather_object(everyone, None, group=group)
    kind, value = everyone[first]
    if kind == "error":
        raise TierError(f"measuring offload.tiers on this node (rank {dist.get_global_rank(group, first)}) failed: {value}")
    return value


def make_placement(
    cfg: OffloadConfig, layout: SubgroupLayout, cache_slots: int, streamed: int, forward: list[int] | None = None,
    speeds: list[TierSpeed] | None = None,
) -> FixedRatioPlacement | AdaptivePlacement:
    """The placement that `cfg.placement` names, for the first `streamed` subgroups (the ones after them
    stay in GPU memory and never move); `forward` is their forward order (default: ascending). With 2+
    tiers and a bandwidth rule, its model starts from `speeds` (measured once for every rank a plan
    plans, or for a node's ranks; nothing is saved), else from the bandwidth profile, measuring (and
    saving) the tiers the profile lacks."""
    m = streamed
    if speeds is not None:
        check_speeds(speeds, cfg.tiers)
    if not placement_measures(cfg) or m == 0:
        return FixedRatioPlacement(cfg.tier_ratios or [1.0] * max(1, len(cfg.tiers)), m)
    profile = None if cfg.bandwidth_profile is None or speeds is not None else BandwidthProfile(cfg.bandwidth_profile)
    try:
        seeds = speeds or seed_speeds(cfg.tiers, profile, int(cfg.calibration_gb * (1 << 30)), placement_request_bytes(cfg))
    except BaseException:
        if profile is not None:
            profile.close()
        raise
    sizes = [sg.state_bytes for sg in layout.subgroups[:m]]
    traffic = steady_traffic(m, cache_slots, cfg.update_order, forward)
    if cfg.placement == "eq1":
        plan = lambda speeds: plan_eq1(speeds, m)  # noqa: E731
    else:
        plan = lambda speeds: plan_makespan(speeds, sizes, traffic)  # noqa: E731
    predict = lambda tiers, speeds: expected_step_seconds(tiers, speeds, sizes, traffic)  # noqa: E731
    return AdaptivePlacement(BandwidthModel(seeds), plan, predict, cfg.placement, list(cfg.tiers), profile)
