"""Storage tiers, built from spec strings such as `posix:/local/nvme?threads=8`."""

from __future__ import annotations

import os
from typing import Callable
from urllib.parse import parse_qsl, urlencode

from .base import ALIGN, CorruptSubgroupError, Tier, TierError, Transfer
from .posix import PosixTier
from .lock import LockedTier, NodeTierLock, access_slots
from .throttle import THROTTLE_OPTIONS, Limits, ThrottledTier, throttle_limits

TierFactory = Callable[[str, str, dict[str, str]], Tier]


def split_spec(spec: str) -> tuple[str, str, dict[str, str]]:
    """`scheme:rest?k=v&...` -> (scheme, rest, {k: v})."""
    scheme, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise ValueError(f"tier spec {spec!r} is not of the form 'scheme:/path' (e.g. 'posix:/mnt/nvme')")
    path, _, query = rest.partition("?")
    return scheme, path, dict(parse_qsl(query, strict_parsing=bool(query)))


def _io_options(spec: str, opts: dict[str, str], size_key: str) -> tuple[int, int]:
    """(threads, request bytes) from a tier spec's `threads=N&<size_key>=MiB`; anything else is an error."""
    known = {"threads", size_key}
    if set(opts) - known:
        raise ValueError(f"tier spec {spec!r}: unknown option(s) {sorted(set(opts) - known)}; known: {sorted(known)}")
    try:
        return int(opts.get("threads", 4)), int(float(opts.get(size_key, 8)) * (1 << 20))
    except ValueError:
        raise ValueError(f"tier spec {spec!r}: threads must be a whole number and {size_key} a number of MiB") from None


def _posix(spec: str, path: str, opts: dict[str, str]) -> Tier:
    threads, request_bytes = _io_options(spec, opts, "request_mb")
    return PosixTier(spec, path, threads=threads, request_bytes=request_bytes)


def _kvikio(spec: str, path: str, opts: dict[str, str]) -> Tier:
    from .kvikio import KvikioTier  # that module imports KvikIO only when a tier is built

    threads, task_bytes = _io_options(spec, opts, "task_mb")
    return KvikioTier(spec, path, threads=threads, task_bytes=task_bytes)


def _throttle(spec: str, inner_spec: str, opts: dict[str, str]) -> Tier:
    """`throttle:<tier spec>?read=..&write=..&latency=..`; other options belong to the wrapped tier."""
    inner_opts = {k: v for k, v in opts.items() if k not in THROTTLE_OPTIONS}
    limits = throttle_limits(spec, opts)
    inner = make_tier(inner_spec + (f"?{urlencode(inner_opts)}" if inner_opts else ""))
    return ThrottledTier(spec, inner, limits)


TIER_SCHEMES: dict[str, TierFactory] = {"posix": _posix, "kvikio": _kvikio, "throttle": _throttle}
WRAPPER_SCHEMES = {"throttle"}  # schemes whose path is another tier's spec


def make_tier(spec: str) -> Tier:
    """Builds the tier a spec names; an unknown scheme is an error that lists the known ones."""
    scheme, path, opts = split_spec(spec)
    factory = TIER_SCHEMES.get(scheme)
    if factory is None:
        raise ValueError(f"unknown tier scheme {scheme!r} in {spec!r}: known schemes are {sorted(TIER_SCHEMES)}")
    return factory(spec, path, opts)


def tier_dir(spec: str) -> str:
    """The directory a tier spec stores its files in (through any wrapping schemes)."""
    scheme, path, _ = split_spec(spec)
    return tier_dir(path) if scheme in WRAPPER_SCHEMES else path


def open_tiers(specs: list[str], access: str | int, lock_dir: str) -> list[Tier]:
    """Builds the tiers; unless access is "shared", each only does I/O while holding its node lock
    (one of k slots; "exclusive" is k = 1), kept in `lock_dir`."""
    slots = access_slots(access)
    dirs: dict[str, str] = {}
    for spec in specs:
        real = os.path.realpath(tier_dir(spec))
        if real in dirs:
            raise ValueError(f"offload.tiers {dirs[real]!r} and {spec!r} both store in {real}: give each tier its own directory")
        dirs[real] = spec
    tiers: list[Tier] = []
    try:
        for spec in specs:
            tier = make_tier(spec)
            if slots is not None:
                tier = LockedTier(tier, NodeTierLock(tier_dir(spec), lock_dir, slots))
            tiers.append(tier)
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
    "TIER_SCHEMES",
    "WRAPPER_SCHEMES",
    "Tier",
    "ThrottledTier",
    "TierError",
    "Transfer",
    "make_tier",
    "open_tiers",
    "split_spec",
    "tier_dir",
]
