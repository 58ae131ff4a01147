"""The tiers' speeds a bandwidth placement starts from, decided in one place for the planner, train.py
and the optimizer alike: given by the caller, read from the bandwidth profile (the tiers it lacks
measured and saved), or measured; and, as a value of its own, whether the placement writes what it
learns back to the profile (whenever one is set, however the starting speeds were got).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from .bandwidth import TierSpeed
from .bandwidth_profile import BandwidthProfile
from .calibrate import seed_speeds
from .config import OffloadConfig
from .job_errors import JobError
from .node import node_peers
from .units import GIB

log = logging.getLogger(__name__)

SOURCES = ("given", "profile", "measured", "unneeded")


@dataclass(frozen=True)
class StartingSpeeds:
    """Where a bandwidth placement's tier speeds start, and where what it learns goes."""

    speeds: list[TierSpeed] | None  # one per offload.tiers, in order; None: nothing needs them
    source: str  # one of SOURCES; "profile": the profile's, the tiers it lacked measured
    save_learned: bool  # the placement writes its learned speeds to offload.bandwidth_profile


def starting_speeds(
    cfg: OffloadConfig, *, given: list[TierSpeed] | None = None, group: dist.ProcessGroup | None = None,
    needed: bool | None = None,
) -> StartingSpeeds:  # fmt: skip
    """The one decision about the tiers' speeds. `needed` (default: cfg.places_by_bandwidth; the
    planner's predicted update time needs them for any tier): without it, none. Else `given` (one per
    tier, e.g. the plan's), checked; else the profile's, measuring the tiers it lacks; else measured.
    With `group`, the first rank of each node of it reads or measures them for the node's other ranks:
    a collective, so every rank of `group` calls it with the same `needed` and with speeds given or not."""
    if given is not None:
        check_speeds(given, cfg.tiers)  # whether or not they are needed: a wrong list is the caller's mistake
    if not (cfg.places_by_bandwidth if needed is None else needed):
        return StartingSpeeds(None, "unneeded", save_learned=False)
    save = cfg.bandwidth_profile is not None and cfg.places_by_bandwidth  # only a bandwidth rule learns
    if given is not None:
        return StartingSpeeds(list(given), "given", save)
    return StartingSpeeds(_node_speeds(cfg, group), "measured" if cfg.bandwidth_profile is None else "profile", save)


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


def _node_speeds(cfg: OffloadConfig, group: dist.ProcessGroup | None) -> list[TierSpeed]:
    """_read_or_measure once a node: by the first rank of each node of `group`, which hands them to the
    node's other ranks (a collective), so that a node measures its tiers once, not once per rank;
    without a group, by this process. A node whose measurement fails ends every rank of `group` alike
    (a JobError that rank 0 says once, naming that node), none left waiting for the failed ones."""
    first = None if group is None else node_peers(group)[0]
    if first is None:
        return _read_or_measure(cfg)
    mine: tuple[str, object] | None = None
    if dist.get_rank(group) == first:
        try:
            mine = ("speeds", _read_or_measure(cfg))
        except Exception as exc:  # noqa: BLE001 - any failure is this node's, said for the job
            log.debug("measuring offload.tiers failed", exc_info=True)
            mine = ("error", f"{type(exc).__name__}: {exc}")
    everyone: list[tuple[str, object] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [r for r, entry in enumerate(everyone) if entry is not None and entry[0] == "error"]
    if failed:
        others = f" (and on the nodes of ranks {', '.join(str(dist.get_global_rank(group, r)) for r in failed[1:])})" if failed[1:] else ""
        raise JobError(f"measuring offload.tiers on the node of rank {dist.get_global_rank(group, failed[0])} failed: "
                           f"{everyone[failed[0]][1]}{others}")  # fmt: skip
    return everyone[first][1]


def _read_or_measure(cfg: OffloadConfig) -> list[TierSpeed]:
    """The tiers' speeds from the bandwidth profile, measuring (and saving) those it lacks; without a
    profile, measured."""
    transfer_bytes = placement_request_bytes(cfg)
    profile = None if cfg.bandwidth_profile is None else BandwidthProfile(cfg.bandwidth_profile)
    try:
        return seed_speeds(cfg.tier_specs, profile, int(cfg.calibration_gb * GIB), transfer_bytes)
    finally:
        if profile is not None:
            profile.close()
