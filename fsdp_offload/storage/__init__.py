"""Storage tiers, built from spec strings such as `posix:/local/nvme?threads=8` (see spec.py)."""

from __future__ import annotations

from .base import ALIGN, CorruptSubgroupError, Tier, TierError, Transfer
from .lock import LockedTier, NodeTierLock, access_slots
from .posix import PosixTier
from .spec import TierSpec, as_spec, parse_tiers
from .throttle import Limits, ThrottledTier


def make_tier(spec: TierSpec | str) -> Tier:
    """Builds the tier a spec names (a string is parsed first, and fails as TierSpec.parse does): the
    file tier it stores in, inside the wrappers (throttles) around it, outermost first in the spec."""
    spec = as_spec(spec)
    wrappers: list[TierSpec] = []
    while spec.inner is not None:
        wrappers.append(spec)
        spec = spec.inner
    if spec.scheme == "kvikio":
        from .kvikio import KvikioTier  # that module imports KvikIO only when a tier is built

        tier: Tier = KvikioTier(spec)
    else:
        tier = PosixTier(spec)
    for wrapper in reversed(wrappers):
        assert wrapper.scheme == "throttle", wrapper
        tier = ThrottledTier(wrapper.text, tier, wrapper.settings)  # (its Limits)
    return tier


def open_tiers(specs: list[TierSpec | str], access: str | int, lock_dir: str, lock_timeout_s: float = 1800.0) -> list[Tier]:
    """Builds the tiers; unless access is "shared", each only does I/O while holding its node lock
    (one of k slots; "exclusive" is k = 1), kept in `lock_dir`, waited for at most `lock_timeout_s`."""
    slots = access_slots(access)
    parsed = parse_tiers(specs)
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
]
