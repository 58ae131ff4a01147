"""Storage tiers, built from spec strings such as `posix:/local/nvme?threads=8` (see spec.py)."""

from __future__ import annotations

import os

from .base import ALIGN, CorruptSubgroupError, Tier, TierError, Transfer
from .lock import LockedTier, NodeTierLock, access_slots
from .posix import PosixTier
from .spec import TierSpec, as_spec, throttle_limits
from .throttle import Limits, ThrottledTier


def make_tier(spec: TierSpec | str) -> Tier:
    """Builds the tier a spec names (a string is parsed first, and fails as TierSpec.parse does)."""
    spec = as_spec(spec)
    if spec.scheme == "posix":
        return PosixTier(spec)
    if spec.scheme == "kvikio":
        from .kvikio import KvikioTier  # that module imports KvikIO only when a tier is built

        return KvikioTier(spec)
    assert spec.scheme == "throttle" and spec.inner is not None, spec
    return ThrottledTier(spec.text, make_tier(spec.inner), throttle_limits(spec))


def tier_dir(spec: TierSpec | str) -> str:
    """The directory a tier spec stores its files in (through any wrapping schemes)."""
    return as_spec(spec).dir


def open_tiers(specs: list[TierSpec | str], access: str | int, lock_dir: str, lock_timeout_s: float = 1800.0) -> list[Tier]:
    """Builds the tiers; unless access is "shared", each only does I/O while holding its node lock
    (one of k slots; "exclusive" is k = 1), kept in `lock_dir`, waited for at most `lock_timeout_s`."""
    slots = access_slots(access)
    parsed = [as_spec(s) for s in specs]
    dirs: dict[str, TierSpec] = {}
    for spec in parsed:
        real = os.path.realpath(spec.dir)
        if real in dirs:
            raise ValueError(f"offload.tiers {dirs[real].text!r} and {spec.text!r} both store in {real}: give each tier its own directory")
        dirs[real] = spec
    tiers: list[Tier] = []
    try:
        for spec in parsed:
            # the lock first: a bad lock dir fails before anything is made in the tier dir
            lock = None if slots is None else NodeTierLock(spec.dir, lock_dir, slots, lock_timeout_s)
            try:
                tier = make_tier(spec)
            except BaseException:
                if lock is not None:
                    lock.close()
                raise
            tiers.append(tier if lock is None else LockedTier(tier, lock))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


__all__ = [
    "ALIGN",
    "CorruptSubgroupError",
    "Limits",
    "PosixTier",
    "Tier",
    "ThrottledTier",
    "TierError",
    "TierSpec",
    "Transfer",
    "make_tier",
    "open_tiers",
    "tier_dir",
]
