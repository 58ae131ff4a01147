"""Storage tiers, built from spec strings such as `posix:/local/nvme?threads=8`."""

from __future__ import annotations

from typing import Callable
from urllib.parse import parse_qsl

from .base import ALIGN, CorruptSubgroupError, Tier, TierError, Transfer
from .posix import PosixTier

TierFactory = Callable[[str, str, dict[str, str]], Tier]


def split_spec(spec: str) -> tuple[str, str, dict[str, str]]:
    """`scheme:rest?k=v&...` -> (scheme, rest, {k: v})."""
    scheme, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise ValueError(f"tier spec {spec!r} is not of the form 'scheme:/path' (e.g. 'posix:/mnt/nvme')")
    path, _, query = rest.partition("?")
    return scheme, path, dict(parse_qsl(query, strict_parsing=bool(query)))


def _posix(spec: str, path: str, opts: dict[str, str]) -> Tier:
    known = {"threads", "request_mb"}
    if set(opts) - known:
        raise ValueError(f"tier spec {spec!r}: unknown option(s) {sorted(set(opts) - known)}; known: {sorted(known)}")
    return PosixTier(
        spec,
        path,
        threads=int(opts.get("threads", 4)),
        request_bytes=int(float(opts.get("request_mb", 8)) * (1 << 20)),
    )


TIER_SCHEMES: dict[str, TierFactory] = {"posix": _posix}


def make_tier(spec: str) -> Tier:
    """Builds the tier a spec names; an unknown scheme is an error that lists the known ones."""
    scheme, path, opts = split_spec(spec)
    factory = TIER_SCHEMES.get(scheme)
    if factory is None:
        raise ValueError(f"unknown tier scheme {scheme!r} in {spec!r}: known schemes are {sorted(TIER_SCHEMES)}")
    return factory(spec, path, opts)


__all__ = [
    "ALIGN",
    "CorruptSubgroupError",
    "PosixTier",
    "TIER_SCHEMES",
    "Tier",
    "TierError",
    "Transfer",
    "make_tier",
    "split_spec",
]
