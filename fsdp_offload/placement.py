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

Both bandwidth rules replan when a tier's learned bandwidth drifts and the new split is predicted to
save more of a step than the learned speeds' own noise; a subgroup then moves to its new tier when it
is next flushed, which it is anyway: replanning costs no I/O. The model and the cost of a step are
bandwidth.py's; the speeds a rule starts from, tier_speeds.py's.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch.distributed as dist

from .bandwidth import MIN_BPS, BandwidthModel, StepTraffic, TierSpeed, expected_step_seconds, io_seconds
from .bandwidth_profile import BandwidthProfile
from .config import OffloadConfig
from .storage import TierSpec, Transfer
from .subgroups import SubgroupLayout

log = logging.getLogger(__name__)


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
    tier_of = [0] * len(sizes)

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
        tier_of[sg] = best

    moving = [sg for sg in traffic.orders[0] if sg in traffic.moving]
    improved = True
    while improved:
        improved = False
        for sg in moving:
            here = tier_of[sg]
            now = makespan_with(sg, here, without=here)
            better = min(range(n), key=lambda i: makespan_with(sg, i, without=here))
            if makespan_with(sg, better, without=here) < now * (1 - 1e-9):
                for k in kinds:
                    load[k][here] -= cost[sg][k][here]
                    load[k][better] += cost[sg][k][better]
                tier_of[sg] = better
                improved = True
    return tier_of


def fit_to_room(tier_of: list[int], room: list[int], speeds: list[TierSpeed]) -> list[int]:
    """`tier_of` with no tier given more subgroups than its `room`: the last of a full tier's subgroups
    go to the fastest tiers with room left. Unchanged where every tier has room for its share, or where
    all the tiers together have too little (the plan's fit check then names the one that is short)."""
    counts = [tier_of.count(i) for i in range(len(room))]
    if all(c <= r for c, r in zip(counts, room)) or len(tier_of) > sum(room):
        return tier_of
    fastest_first = sorted(range(len(room)), key=lambda i: -min(speeds[i].read_bps, speeds[i].write_bps))
    out = list(tier_of)
    for sg in reversed(range(len(out))):
        if counts[out[sg]] > room[out[sg]]:
            to = next(i for i in fastest_first if counts[i] < room[i])
            counts[out[sg]], counts[to], out[sg] = counts[out[sg]] - 1, counts[to] + 1, to
    return out


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
    """A bandwidth rule kept current with a BandwidthModel that starts from `seeds` and learns from every
    transfer: `rule` "learned" (plan_makespan) or "eq1" (plan_eq1) places the subgroups of `sizes`,
    whose steady-state `traffic` prices a plan (for the log). `tier_of[sg]` is the tier subgroup sg is
    written to.

    Looks again when any tier's read or write bandwidth has moved by more than DRIFT since it last
    looked, and replans (then saves the new numbers to the profile, so the next run starts from them)
    where the rule's split for the new speeds moves nothing, or is predicted to take less of a step
    than the current one by a factor beyond the speeds' noise (NOISE_MARGIN x BandwidthModel.spread).
    Small transfers' timings are mostly latency and jitter: their learned speeds swing by several times
    with no change in the tier, and a split chasing them would move subgroups every few flushes for
    nothing.
    """

    DRIFT = 0.10
    # How many times the speeds' noise (BandwidthModel.spread, log) a new split must save: the medians of
    # windows of noisy timings stray about this far over a run's hundreds of looks (tests/test_placement_noise.py:
    # 3x jitter on two equal tiers moves nothing), while a tier that slows by half still moves its share.
    NOISE_MARGIN = 3.0

    def __init__(
        self, seeds: list[TierSpeed], rule: str, sizes: list[int], traffic: StepTraffic, tier_specs: Sequence[TierSpec],
        profile: BandwidthProfile | None = None, room: list[int] | None = None, sharers: int = 1,
    ) -> None:  # fmt: skip
        """`seeds` are the tiers' whole speeds, which the node's `sharers` ranks share over a step: the first
        plan's logged I/O is this rank's share. (The model learns what this rank sees while it transfers:
        under tier_access=exclusive, the tier's whole speed, as it saves it; under shared access, a share.)"""
        if len(tier_specs) != len(seeds):
            raise ValueError(f"{len(tier_specs)} tier specs for {len(seeds)} tier speeds")
        self.name, self.sizes, self.traffic = rule, sizes, traffic
        self.room = room  # subgroups each tier's free space takes (None: no limit)
        self.tier_specs = tier_specs
        self._profile = profile
        self._keys = [s.key for s in tier_specs]
        self.replans = 0
        self.basis: list[TierSpeed] = []  # the speeds the current split was made for
        self._looked: list[TierSpeed] = []  # the speeds last weighed for a replan
        self.tier_of: list[int] = []
        self.dropped: set[int] = set()  # tiers that failed: planned as all but unusable, and never chosen
        self._plan(list(seeds), share=sharers)  # what the model says before it has learned anything
        self.model = BandwidthModel(seeds)

    def plan(self, speeds: list[TierSpeed]) -> list[int]:
        """The rule's tier of each subgroup for these speeds."""
        return rule_split(self.name, speeds, self.sizes, self.traffic)

    def _usable(self, speeds: list[TierSpeed]) -> list[TierSpeed]:
        return [TierSpeed(MIN_BPS, MIN_BPS, s.latency_s) if i in self.dropped else s for i, s in enumerate(speeds)]

    def _split(self, speeds: list[TierSpeed]) -> list[int]:
        """The rule's split for these speeds, kept to the tiers' room and off the dropped tiers."""
        usable = self._usable(speeds)
        fastest = max((i for i in range(len(speeds)) if i not in self.dropped), key=lambda i: min(usable[i].read_bps, usable[i].write_bps))
        wanted = self.plan(usable)
        if self.room is not None:  # a fast tier short of space takes what it has room for
            wanted = fit_to_room(wanted, [0 if i in self.dropped else r for i, r in enumerate(self.room)], usable)
        return [fastest if t in self.dropped else t for t in wanted]

    def _plan(self, speeds: list[TierSpeed], split: list[int] | None = None, share: int = 1) -> None:
        """Takes `split` (default: the rule's for `speeds`) as the plan, and logs it with its I/O a step
        at 1/`share` of each tier's `speeds` (the split is the same at any share)."""
        previous, self.tier_of = self.tier_of, self._split(speeds) if split is None else split
        self.basis = self._looked = speeds
        ranked = dist.is_initialized() and dist.get_world_size() > 1  # each rank places its own subgroups
        mine = [TierSpeed(s.read_bps / share, s.write_bps / share, s.latency_s) for s in speeds]
        log.log(
            logging.INFO if self.tier_of != previous else logging.DEBUG,  # a replan that moves nothing is noise
            "%splacement %s (expected update I/O %.3g s a step%s): %s",
            f"rank {dist.get_rank()}: " if ranked else "",
            self.name,
            expected_step_seconds(self.tier_of, mine, self.sizes, self.traffic),
            f", the tiers shared by the node's {share} ranks" if share > 1 else "",
            ", ".join(
                f"{spec} {self.tier_of.count(i)} subgroups (read {s.read_bps / 1e9:.3g} GB/s, write {s.write_bps / 1e9:.3g} GB/s)"
                for i, (spec, s) in enumerate(zip(self.tier_specs, speeds))
            ),
        )

    def tier_for(self, sg: int) -> int:
        speeds = self.model.speeds()
        if any(now.drifted_from(then, self.DRIFT) for now, then in zip(speeds, self._looked)):
            self._replan(speeds)
        return self.tier_of[sg]

    def _replan(self, speeds: list[TierSpeed]) -> None:
        """Replans for drifted `speeds` where the rule's new split is worth more than the noise in them."""
        self._looked = speeds
        split = self._split(speeds)
        if split != self.tier_of:
            usable = self._usable(speeds)
            current, proposed = (expected_step_seconds(s, usable, self.sizes, self.traffic) for s in (self.tier_of, split))
            spread = self.model.spread()
            noise = max(spread[i] for i in range(len(speeds)) if i not in self.dropped)
            if proposed * math.exp(self.NOISE_MARGIN * noise) >= current:  # the gain may be the noise's alone: the subgroups stay
                log.debug("kept the %s placement: a new split would take %.3g s of I/O a step for %.3g s, within the "
                          "learned speeds' noise (timings off by %.0f%%)", self.name, proposed, current, 100 * math.expm1(noise))  # fmt: skip
                return
        self._plan(speeds, split)
        self.replans += 1
        self._save(speeds)

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


def rule_split(rule: str, speeds: list[TierSpeed], sizes: list[int], traffic: StepTraffic) -> list[int]:
    """A bandwidth rule's tier of each subgroup of `sizes` for these speeds."""
    return plan_eq1(speeds, len(sizes)) if rule == "eq1" else plan_makespan(speeds, sizes, traffic)


def planned_split(cfg: OffloadConfig, sizes: list[int], traffic: StepTraffic, speeds: list[TierSpeed] | None,
                  room: list[int] | None) -> list[int]:  # fmt: skip
    """The tier of each streamed subgroup (`sizes`) as make_placement's placement starts, without its
    log or its learning: the planner's split."""
    if speeds is None or not sizes or not cfg.places_by_bandwidth:
        return smooth_round_robin(cfg.tier_ratios or [1.0] * max(1, len(cfg.tiers)), len(sizes))
    split = rule_split(cfg.placement, speeds, sizes, traffic)
    return split if room is None else fit_to_room(split, room, speeds)


def make_placement(
    cfg: OffloadConfig, layout: SubgroupLayout, streamed: int, traffic: StepTraffic, speeds: list[TierSpeed] | None = None,
    learn_into: BandwidthProfile | None = None, room: list[int] | None = None, sharers: int = 1,
) -> FixedRatioPlacement | AdaptivePlacement:
    """The placement that `cfg.placement` names, for the first `streamed` subgroups (the ones after them
    stay in GPU memory and never move), whose steady-state `traffic` (bandwidth.steady_traffic) a
    bandwidth rule plans for. It starts from `speeds` (tier_speeds.starting_speeds decides them: None,
    or no subgroup to place, is the fixed split) and saves what it learns to `learn_into`, which it closes.
    A bandwidth rule gives no tier more subgroups than its `room` (machine.tier_room_subgroups); the fixed
    split is the user's, as given. The node's `sharers` ranks share the tiers' starting `speeds`."""
    m = streamed
    if speeds is None or m == 0 or not cfg.places_by_bandwidth:
        return FixedRatioPlacement(cfg.tier_ratios or [1.0] * max(1, len(cfg.tiers)), m)
    sizes = [sg.stored_bytes for sg in layout.subgroups[:m]]
    return AdaptivePlacement(speeds, cfg.placement, sizes, traffic, cfg.tier_specs, learn_into, room, sharers)
