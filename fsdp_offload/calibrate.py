"""Measuring tiers: the bandwidth model's seeds, and where they are kept between runs.

- `measure_tier`: writes then reads through a tier itself (its threads, O_DIRECT, any throttle): the
  read and write bandwidth and per-request latency the offload pipeline will see.
- `BandwidthProfile`: a JSON file of those numbers per host and tier, which the bandwidth model also
  writes back what it learned into, so the next run starts from it.
- `measure_raw_bandwidth`: the raw ceiling of a directory (parallel aligned pwrite/pread), which
  benchmarks compare the pipeline's effective I/O against.

    python -m fsdp_offload.calibrate posix:/local/nvme posix:/pfs/run   # measure, print, save
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .cache import aligned_host_buffer
from .storage import TierSpec, make_tier
from .storage.base import ALIGN, Tier, TierError
from .storage.chunked import make_private_dir
from .storage.posix import _pread_all, _pwrite_all, open_private_file
from .storage.spec import as_spec

log = logging.getLogger(__name__)

DEFAULT_PROFILE = "~/.cache/fsdp-offload/bandwidth.json"
PROFILE_FORMAT = "fsdp-offload-bandwidth-profile/1"
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


# -- measuring a tier -------------------------------------------------------------------------------


def _timed_transfers(op: Callable[[int, torch.Tensor], Future], keys: list[int], buffers: list[torch.Tensor]) -> float:
    """Runs op(key, buffer) over `keys` with len(buffers) in flight; returns the elapsed seconds."""
    start = time.perf_counter()
    futures: list[Future] = []
    for i, key in enumerate(keys):
        if i >= len(buffers):
            futures[i - len(buffers)].result()  # its buffer is free again
        futures.append(op(key, buffers[i % len(buffers)]))
    for f in futures:
        f.result()
    return time.perf_counter() - start


def measure_tier(spec: TierSpec | str, nbytes: int = 1 << 30, transfer_bytes: int = 64 << 20, in_flight: int = 4) -> TierSpeed:
    """Writes then reads `nbytes` through the tier `spec` in transfers of `transfer_bytes`, `in_flight`
    at a time, and times one-page reads for the per-request latency."""
    transfer_bytes = max(ALIGN, transfer_bytes // ALIGN * ALIGN)
    count = max(2, nbytes // transfer_bytes)
    tier: Tier = make_tier(spec)
    try:
        tier.attach(f"calibrate-{platform.node()}-{os.getpid()}-{uuid.uuid4().hex[:8]}", [ALIGN] + [transfer_bytes] * count)
        buffers = [aligned_host_buffer(transfer_bytes) for _ in range(min(in_flight, count))]
        for b in buffers:  # incompressible, so a compressing file system cannot flatter itself
            b.copy_(torch.randint(0, 256, (transfer_bytes,), dtype=torch.uint8))
        keys = list(range(1, count + 1))
        write_s = _timed_transfers(tier.write, keys, buffers)
        read_s = _timed_transfers(tier.read, keys, buffers)
        page = aligned_host_buffer(ALIGN)
        tier.write(0, page).result()
        latencies = []
        for _ in range(5):
            t0 = time.perf_counter()
            tier.read(0, page).result()
            latencies.append(time.perf_counter() - t0)
    except OSError as exc:
        hint = "the file system is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "check the file system"
        raise TierError(
            f"calibrating {spec}: {count} x {transfer_bytes} bytes failed: {exc.strerror or exc} ({hint}; free "
            "space, lower offload.calibration_gb, or pick another path)"
        ) from exc
    finally:
        tier.close()
    # the fastest page read: scheduling noise only ever adds to a latency
    total, latency = count * transfer_bytes, min(latencies)

    def bandwidth(elapsed: float) -> float:
        # The model charges latency + bytes / bandwidth per request, so the latency of each transfer
        # comes off (as on a serial device); the floor keeps a device that overlaps requests finite.
        return total / max(elapsed - count * latency, 0.1 * elapsed)

    speed = TierSpeed(bandwidth(read_s), bandwidth(write_s), latency)
    if not speed.valid:
        raise TierError(f"calibrating {spec} gave {speed}: not a usable bandwidth; measure again with more bytes")
    return speed


# -- the profile ------------------------------------------------------------------------------------


def tier_profile_key(spec: TierSpec | str) -> str:
    """A tier spec with its path resolved and its options sorted: one key per distinct tier.

    Wrappers come first, then the dir; the options of every level go, merged, into one query
    (`throttle:posix:/x?read=1GB/s&threads=2`), as the spec was written."""
    spec = as_spec(spec)
    schemes, opts = [spec.scheme], dict(spec.options)
    while spec.inner is not None:
        spec = spec.inner
        schemes.append(spec.scheme)
        opts.update(spec.options)
    query = "&".join(f"{k}={v}" for k, v in sorted(opts.items()))
    return ":".join([*schemes, os.path.realpath(spec.path)]) + (f"?{query}" if query else "")


class BandwidthProfile:
    """`{"format": ..., "hosts": {host: {tier key: {read_gbps, write_gbps, latency_ms, source, updated}}}}`.

    Read and rewritten under an flock on `<path>.lock`, and replaced atomically, so the ranks of a node
    (and nodes sharing a home dir) can use one file.
    """

    def __init__(self, path: str, host: str | None = None) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.host = host or platform.node() or "unknown-host"
        folder = os.path.dirname(self.path)
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            self._lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TierError(
                f"offload.bandwidth_profile={path!r}: cannot use {folder}: {exc.strerror}; point it to a writable "
                "file or set it to None (measure every run, keep nothing)"
            ) from exc

    @contextlib.contextmanager
    def locked(self, wait: bool = True) -> Iterator[bool]:
        """Holds the profile's lock inside the block; with wait=False, yields False if it is busy."""
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_all(self) -> dict:
        """The whole file (call with the lock held). A corrupt file is moved aside with a warning."""
        try:
            with open(self.path) as f:
                data = json.load(f)
            hosts = data.get("hosts") if isinstance(data, dict) else None
            well_formed = isinstance(hosts, dict) and all(isinstance(h, dict) for h in hosts.values())
            if not well_formed or data.get("format") != PROFILE_FORMAT:
                raise ValueError(f"not a {PROFILE_FORMAT} file")
            return data
        except FileNotFoundError:
            return {"format": PROFILE_FORMAT, "hosts": {}}
        except (ValueError, UnicodeDecodeError) as exc:
            aside = f"{self.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(self.path, aside)
            log.warning("bandwidth profile %s is unreadable (%s): moved it to %s; tiers will be measured again", self.path, exc, aside)
            return {"format": PROFILE_FORMAT, "hosts": {}}

    def load(self) -> dict[str, TierSpeed]:
        """This host's valid entries (call with the lock held); invalid ones are reported and left out."""
        data = self._read_all()
        mine = data["hosts"].get(self.host)
        if mine is None:
            if data["hosts"]:
                log.info("bandwidth profile %s has no entry for host %s (it has %s)", self.path, self.host, sorted(data["hosts"]))
            return {}
        out = {}
        for key, entry in mine.items():
            try:
                speed = TierSpeed(entry["read_gbps"] * 1e9, entry["write_gbps"] * 1e9, entry["latency_ms"] / 1e3)
            except (TypeError, KeyError):
                speed = None
            if speed is None or not speed.valid:
                log.warning(
                    "bandwidth profile %s: entry for %s on %s is not usable (%s); it will be measured again",
                    self.path, key, self.host, entry,
                )  # fmt: skip
                continue
            out[key] = speed
        return out

    def store(self, speeds: dict[str, TierSpeed], source: str) -> None:
        """Merges `speeds` (tier key -> speed) into this host's entries (call with the lock held)."""
        data = self._read_all()
        mine = data["hosts"].setdefault(self.host, {})
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        for key, s in speeds.items():
            mine[key] = {
                "read_gbps": s.read_bps / 1e9, "write_gbps": s.write_bps / 1e9, "latency_ms": s.latency_s * 1e3,
                "source": source, "updated": stamp,
            }  # fmt: skip
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".bandwidth-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def save_learned(self, speeds: dict[str, TierSpeed]) -> None:
        """Stores learned speeds if the file is free right now; never raises (training goes on)."""
        try:
            with self.locked(wait=False) as got:
                if got:
                    self.store(speeds, "learned")
                else:
                    log.debug("bandwidth profile %s is busy; learned speeds saved later", self.path)
        except OSError as exc:
            log.warning("cannot save learned bandwidths to %s: %s (training goes on)", self.path, exc)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def seed_speeds(
    specs: list[TierSpec | str], profile: BandwidthProfile | None, nbytes: int, transfer_bytes: int
) -> list[TierSpeed]:
    """Each tier's speed from the profile, measuring (and saving) those it lacks. Ranks of one node
    take turns on the profile's lock, so a tier is measured once and never by two ranks at a time."""
    if profile is None:
        return [measure_tier(s, nbytes, transfer_bytes) for s in specs]
    with profile.locked():
        known = profile.load()
        measured: dict[str, TierSpeed] = {}
        for spec in specs:
            key = tier_profile_key(spec)
            if key not in known:
                log.info("measuring %s (%d bytes) for the bandwidth profile %s", spec, nbytes, profile.path)
                known[key] = measured[key] = measure_tier(spec, nbytes, transfer_bytes)
        if measured:
            profile.store(measured, "calibrated")
        return [known[tier_profile_key(s)] for s in specs]


@dataclass(frozen=True)
class RawBandwidth:
    path: str
    nbytes: int
    request_bytes: int
    threads: int
    direct: bool
    write_gbps: float
    read_gbps: float
    latency_s: float  # one 4 KiB read, median of a few

    @property
    def read_write_gbps(self) -> float:
        """Bandwidth of writing then reading the same bytes (harmonic mean of the two)."""
        return 2 / (1 / self.write_gbps + 1 / self.read_gbps)


def measure_raw_bandwidth(
    root: str, nbytes: int = 2 << 30, request_bytes: int = 8 << 20, threads: int = 4
) -> RawBandwidth:
    """Writes then reads `nbytes` under `root` with `threads` threads of `request_bytes` requests."""
    if nbytes % request_bytes:
        nbytes -= nbytes % request_bytes
    if nbytes <= 0:
        raise ValueError(f"raw bandwidth test of {nbytes} bytes: give at least one {request_bytes}-byte request")
    spec = f"raw:{root}"
    path = os.path.join(make_private_dir(root, spec), f"raw-bandwidth-{os.getpid()}.bin")
    fd, direct = open_private_file(path)
    buffers = [memoryview(aligned_host_buffer(request_bytes).numpy()) for _ in range(threads)]
    offsets = list(range(0, nbytes, request_bytes))
    try:

        def run(op) -> float:
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: op(fd, buffers[i % threads], offsets[i]), range(len(offsets))))
            if op is _pwrite_all:
                os.fsync(fd)
            return time.perf_counter() - start

        write_s = run(_pwrite_all)
        read_s = run(_pread_all)
        small = memoryview(aligned_host_buffer(4096).numpy())
        lat = []
        for off in offsets[:: max(1, len(offsets) // 5)][:5]:
            t0 = time.perf_counter()
            _pread_all(fd, small, off)
            lat.append(time.perf_counter() - t0)
    except OSError as exc:
        raise TierError(f"raw bandwidth test in {root} failed: {exc.strerror} (is the file system full or read-only?)") from exc
    finally:
        os.close(fd)
        os.unlink(path)
    return RawBandwidth(
        root, nbytes, request_bytes, threads, direct, nbytes / write_s / 1e9, nbytes / read_s / 1e9, sorted(lat)[len(lat) // 2]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fsdp_offload.calibrate",
        description="Measures each tier's read and write bandwidth and per-request latency through the tier "
        "itself, prints a table and saves them to the bandwidth profile that OffloadAdamW starts from.",
    )
    ap.add_argument("tiers", nargs="+", help="tier specs, e.g. posix:/local/nvme 'throttle:posix:/tmp/x?read=1GB/s'")
    ap.add_argument("--gb", type=float, default=1.0, help="GiB written then read per tier (default 1)")
    ap.add_argument("--transfer-mb", type=float, default=64, help="bytes per transfer, in MiB (default 64)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help=f"profile file (default {DEFAULT_PROFILE})")
    ap.add_argument("--no-save", action="store_true", help="print only; leave the profile alone")
    args = ap.parse_args(argv)
    if not args.gb > 0 or not args.transfer_mb > 0:
        ap.error(f"--gb={args.gb} and --transfer-mb={args.transfer_mb} must be positive")
    measured: dict[str, TierSpeed] = {}
    width = max(len("tier"), *map(len, args.tiers))
    print(f"{'tier':<{width}} {'read GB/s':>10} {'write GB/s':>11} {'latency ms':>11}")
    for spec in args.tiers:
        try:
            speed = measure_tier(spec, int(args.gb * (1 << 30)), int(args.transfer_mb * (1 << 20)))
        except (TierError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        measured[tier_profile_key(spec)] = speed
        print(f"{spec:<{width}} {speed.read_bps / 1e9:>10.3f} {speed.write_bps / 1e9:>11.3f} {speed.latency_s * 1e3:>11.3f}", flush=True)
    if not args.no_save:
        try:
            profile = BandwidthProfile(args.profile)
            with profile.locked():
                profile.store(measured, "calibrated")
        except (TierError, OSError) as exc:
            print(f"error: cannot save the profile: {exc}", file=sys.stderr)
            return 1
        print(f"saved to {profile.path} (host {profile.host})")
        profile.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
