"""Tier specs: `scheme:path?name=value&...`, parsed and checked once.

    posix:/mnt/nvme?threads=8&request_mb=8       O_DIRECT files under /mnt/nvme
    kvikio:/mnt/nvme?threads=4&task_mb=8         files moved by KvikIO
    throttle:posix:/tmp/b?read=1.5GB/s&write=0.8GB/s&latency=2ms
                                                 a wrapper: another tier, slowed down

A wrapper's path is another tier's spec, and its options other than its own go to that tier
(`throttle:posix:/x?read=1GB/s&threads=2` wraps `posix:/x?threads=2`). `TierSpec.parse` checks the
form, every scheme and every option name and value, so a config fails when it is built, naming the
spec and the fix, not when the tier is.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping
from urllib.parse import parse_qsl, urlencode

from .. import units
from .base import ALIGN
from .throttle import Limits


@dataclass(frozen=True)
class TierSpec:
    """A parsed tier spec. Build it with `TierSpec.parse`, which checks everything."""

    text: str  # the spec as the user wrote it (str(spec) returns it)
    scheme: str  # "posix" | "kvikio" | "throttle"
    path: str  # the directory (for a wrapper: the inner spec's text)
    options: Mapping[str, str] = field(hash=False)  # this scheme's own options, validated
    inner: TierSpec | None  # the wrapped tier's spec (wrapper schemes), else None
    # what the options say, read once: (I/O threads, bytes per request) of a file tier, a throttle's Limits
    settings: object = field(hash=False, compare=False)

    @classmethod
    def parse(cls, text: str) -> TierSpec:
        """Parses and checks `text`; a ValueError names the spec, what is wrong and the fix."""
        if not isinstance(text, str):
            raise TypeError(f"a tier spec is a string like 'posix:/mnt/nvme', not {text!r} ({type(text).__name__})")
        scheme, path, query = _split(text, text)
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
        except ValueError:
            raise ValueError(
                f"tier spec {text!r}: options must be name=value pairs joined by '&' (e.g. "
                f"'{scheme}:{path}?threads=8'), not {query!r}"
            ) from None
        opts = dict(pairs)
        if len(opts) < len(pairs):
            twice = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
            raise ValueError(f"tier spec {text!r}: option(s) {twice} given more than once; give each once")
        known = _known_options(text, text)
        if set(opts) - known:
            raise ValueError(f"tier spec {text!r}: unknown option(s) {sorted(set(opts) - known)}; known: {sorted(known)}")
        kind = SCHEMES[scheme]
        own = {k: v for k, v in opts.items() if k in kind.options}
        settings = kind.settings(text, own)  # checks the values
        inner = None
        if kind.wraps:
            passed = {k: v for k, v in opts.items() if k not in kind.options}
            try:
                inner = cls.parse(path + (f"?{urlencode(passed)}" if passed else ""))
            except ValueError as exc:
                raise ValueError(f"{exc} (in {text!r})") from None
            path = inner.text
        else:
            path = os.path.expanduser(path)  # "posix:~/nvme" as a shell would read it
        return cls(text, scheme, path, MappingProxyType(own), inner, settings)

    @property
    def dir(self) -> str:
        """The directory the tier stores its files in, through any wrappers."""
        return _storage_spec(self).path

    @property
    def key(self) -> str:
        """The spec with its path resolved and its options sorted: one key per distinct tier (the
        bandwidth profile's). Wrappers come first, then the dir; the options of every level go, merged,
        into one query (`throttle:posix:/x?read=1GB/s&threads=2`), as the spec was written."""
        spec, schemes, opts = self, [self.scheme], dict(self.options)
        while spec.inner is not None:
            spec = spec.inner
            schemes.append(spec.scheme)
            opts.update(spec.options)
        query = "&".join(f"{k}={v}" for k, v in sorted(opts.items()))
        return ":".join([*schemes, os.path.realpath(spec.path)]) + (f"?{query}" if query else "")

    def __str__(self) -> str:
        return self.text

    def __reduce__(self):  # options is a read-only view, which pickle cannot copy: parse again
        return (TierSpec.parse, (self.text,))


def as_spec(spec: TierSpec | str) -> TierSpec:
    """`spec`, parsed if it is still text."""
    return spec if isinstance(spec, TierSpec) else TierSpec.parse(spec)


def io_settings(spec: TierSpec) -> tuple[int, int]:
    """(I/O threads, bytes per request) of the file tier that `spec` stores in, through any wrappers."""
    return _storage_spec(spec).settings


def _storage_spec(spec: TierSpec) -> TierSpec:
    while spec.inner is not None:
        spec = spec.inner
    return spec


def _split(text: str, whole: str) -> tuple[str, str, str]:
    """`scheme:path?query` -> (scheme, path, query), with the form and the scheme checked; `whole`
    is the spec that `text` is part of (for messages)."""
    scheme, sep, rest = text.partition(":")
    path, _, query = rest.partition("?")
    if not sep or not path:
        where = f"tier spec {whole!r}" if text == whole else f"tier spec {whole!r}: {text!r}"
        raise ValueError(f"{where} is not of the form 'scheme:/path' (e.g. 'posix:/mnt/nvme')")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown tier scheme {scheme!r} in {whole!r}: known schemes are {sorted(SCHEMES)}")
    return scheme, path, query


def _known_options(text: str, whole: str) -> set[str]:
    """The options that `text`'s query may give: its scheme's and, for a wrapper, the wrapped tier's."""
    scheme, path, _ = _split(text, whole)
    kind = SCHEMES[scheme]
    return set(kind.options) | (_known_options(path, whole) if kind.wraps else set())


# -- option values ----------------------------------------------------------------------------------


def _number(text: str, name: str, value: str, convert: Callable[[str], float], what: str) -> float:
    try:
        number = convert(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(f"tier spec {text!r}: {name}={value!r} is not {what} (e.g. {name}=8)")
    return number


def _file_io(size_key: str, size_name: str) -> Callable[[str, Mapping[str, str]], tuple[int, int]]:
    """The settings of a file tier: `threads=N` and `<size_key>=MiB` per request."""

    def settings(text: str, opts: Mapping[str, str]) -> tuple[int, int]:
        threads = int(_number(text, "threads", opts.get("threads", "4"), int, "a whole number"))
        mib = _number(text, size_key, opts.get(size_key, "8"), float, "a number of MiB")
        if threads < 1:
            raise ValueError(f"tier spec {text!r}: threads must be >= 1, got {threads}")
        nbytes = int(mib * (1 << 20))
        if nbytes <= 0 or nbytes % ALIGN:
            raise ValueError(
                f"tier spec {text!r}: {size_name} size of {nbytes} bytes ({size_key}={opts.get(size_key, '8')}) must be a positive "
                f"multiple of {ALIGN} (1/256 MiB); e.g. {size_key}=8"
            )
        return threads, nbytes

    return settings


def _rate(spec: str, name: str, text: str) -> float:
    """A throttle's rate option in bytes/s, or an error naming the spec and the fix."""
    rate = units.parse_rate(text)
    if rate is None:
        raise ValueError(f"tier spec {spec!r}: {name}={text!r} is not a rate; write it like {name}=1.5GB/s or {name}=800MiB/s")
    if rate <= 0:
        raise ValueError(f"tier spec {spec!r}: {name}={text!r} is not positive; a tier must move bytes (e.g. {name}=0.5GB/s)")
    return rate


def _seconds(spec: str, name: str, text: str) -> float:
    """A throttle's duration option in seconds, or an error naming the spec and the fix."""
    seconds = units.parse_seconds(text)
    if seconds is None:
        raise ValueError(f"tier spec {spec!r}: {name}={text!r} is not a duration; write it like {name}=2ms")
    return seconds


THROTTLE_OPTIONS = ("read", "write", "latency")


def _limits(text: str, opts: Mapping[str, str]) -> Limits:
    if not any(k in opts for k in THROTTLE_OPTIONS):
        raise ValueError(
            f"tier spec {text!r} limits nothing: give read=, write= and/or latency= "
            "(e.g. ?read=1.5GB/s&write=0.8GB/s&latency=2ms)"
        )
    return Limits(
        read_bps=_rate(text, "read", opts["read"]) if "read" in opts else None,
        write_bps=_rate(text, "write", opts["write"]) if "write" in opts else None,
        latency_s=_seconds(text, "latency", opts["latency"]) if "latency" in opts else 0.0,
    )


@dataclass(frozen=True)
class Scheme:
    options: tuple[str, ...]  # the option names this scheme takes
    settings: Callable[[str, Mapping[str, str]], object]  # (spec text, its options) -> typed values, checked
    wraps: bool = False  # its path is another tier's spec


SCHEMES: dict[str, Scheme] = {
    "posix": Scheme(("threads", "request_mb"), _file_io("request_mb", "request")),
    "kvikio": Scheme(("threads", "task_mb"), _file_io("task_mb", "task")),
    "throttle": Scheme(THROTTLE_OPTIONS, _limits, wraps=True),
}


def parse_tiers(tiers: list[str | TierSpec]) -> tuple[TierSpec, ...]:
    """offload.tiers parsed, each in a directory of its own (two tiers in one dir would write over each
    other's files): the one check, made wherever the tiers are read."""
    parsed = tuple(as_spec(t) for t in tiers)
    dirs: dict[str, TierSpec] = {}
    for spec in parsed:
        real = os.path.realpath(spec.dir)
        if real in dirs:
            raise ValueError(f"offload.tiers {dirs[real].text!r} and {spec.text!r} both store in {real}: give each tier its own directory")
        dirs[real] = spec
    return parsed
