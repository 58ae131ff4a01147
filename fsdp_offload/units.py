"""Units of size, rate and time, and the one parser of each: the config's sizes ('6GiB') and a
throttle's rates and latencies ('1.5GB/s', '2ms') read the same tables."""

from __future__ import annotations

import numbers
import re

GIB = 1 << 30
SIZE_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": GIB, "TiB": 1 << 40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
# A rate's unit is read in any case ('gb/s', 'MiB/s'); bytes when it names none ('B', '')
_RATE_UNITS = {"": 1, "B": 1, **{unit.upper(): size for unit, size in SIZE_UNITS.items()}}
TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def readable_size(nbytes: float) -> str:
    """A size in the largest binary unit it fills: '1.57 MiB', '3.00 GiB', '512 bytes'."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if nbytes >= SIZE_UNITS[unit]:
            return f"{nbytes / SIZE_UNITS[unit]:.2f} {unit}"
    return f"{int(nbytes)} bytes"


def format_bytes(nbytes: float) -> str:
    """Exact bytes plus a readable size, for error messages: '3221225472 bytes (3.00 GiB)'."""
    readable = readable_size(nbytes)
    return f"{int(nbytes)} bytes" + ("" if readable.endswith("bytes") else f" ({readable})")


def in_unit(nbytes: float, unit: str) -> str:
    """`nbytes` written in `unit` (one of SIZE_UNITS), for messages that answer a size in that unit: four
    figures, or all of a whole number past them (21200 MiB, not 2.12e+04 MiB)."""
    value = nbytes / SIZE_UNITS[unit]
    return f"{value:.4g} {unit}" if abs(value) < 1e4 else f"{value:.0f} {unit}"


def parse_size(value: str | float) -> tuple[float, str]:
    """'6GiB', '512 MiB', '1.5GB' -> (number, unit); a bare number (or one written as text) is GiB.
    ValueError if not a size (a bool is none: True is an int to Python, never a size to a recipe)."""
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        raise ValueError(f"{value!r} is not a size")
    if not isinstance(value, str):
        return float(value), "GiB"
    text = value.strip()
    for unit in sorted(SIZE_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)].strip()), unit
    return float(text), "GiB"


def parse_rate(text: str) -> float | None:
    """'1.5GB/s' -> 1.5e9 bytes/s (any unit of SIZE_UNITS, in any case, or plain bytes/s); None if
    `text` is not a rate."""
    m = re.fullmatch(_NUMBER + r"([KMGT]?i?B)?(?:/s)?\s*", text, re.IGNORECASE)
    unit = (m.group(2) or "").upper() if m else None
    return None if m is None or unit not in _RATE_UNITS else float(m.group(1)) * _RATE_UNITS[unit]


def format_seconds(seconds: float) -> str:
    """0.25 -> '0.25 s', 0.0022 -> '2.2 ms': a small model's step phases keep their figures."""
    if not 0 < seconds < 0.1:  # (0, or not a time: as it is)
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.3g} us"


def parse_seconds(text: str) -> float | None:
    """'2ms' -> 0.002 (also s, us, or plain seconds); None if `text` is not a duration."""
    m = re.fullmatch(_NUMBER + r"(s|ms|us)?\s*", text)
    return None if m is None else float(m.group(1)) * TIME_UNITS[m.group(2) or ""]


def format_count(n: float) -> str:
    """Params as the planner and train.py say them: 1.345B, 0.13M."""
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
