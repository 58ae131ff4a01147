"""Measuring tiers: the bandwidth model's seeds.

- `measure_tier`: writes, reads, and reads and writes at once through a tier itself (its threads,
  O_DIRECT, any throttle): the read and write bandwidth and per-request latency the offload
  pipeline will see.
- `seed_speeds`: the speeds a run starts from, from the bandwidth profile (bandwidth_profile.py) where
  it has them, else measured once for the node and saved there.

    python -m fsdp_offload.calibrate posix:/local/nvme posix:/pfs/run   # measure, print, save
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from typing import Callable, Iterator

import torch

from .bandwidth import TierSpeed
from .bandwidth_profile import DEFAULT_PROFILE, BandwidthProfile, tier_profile_key
from .cache import aligned_host_buffer
from .storage import TierSpec, make_tier
from .storage.base import ALIGN, Tier, TierError
from .storage.private_files import tier_file_tag, tier_root_problem
from .storage.spec import as_spec

log = logging.getLogger(__name__)



# -- measuring a tier -------------------------------------------------------------------------------


def _timed_transfers(ops: list[Callable[[torch.Tensor], Future]], buffers: list[torch.Tensor]) -> float:
    """Runs each op(buffer) with len(buffers) in flight; returns the elapsed seconds."""
    start = time.perf_counter()
    futures: list[Future] = []
    for i, op in enumerate(ops):
        if i >= len(buffers):
            futures[i - len(buffers)].result()  # its buffer is free again
        futures.append(op(buffers[i % len(buffers)]))
    for f in futures:
        f.result()
    return time.perf_counter() - start


MAX_SMALL_TRANSFERS = 256  # transfers under PROFILE_MIN_TRANSFER_BYTES a measuring pass makes at most
# Transfers under this time each request's own costs (threads, checksums, calls) more than the device:
# speeds measured or learned with them are used by the run that has them, never saved to the profile.
PROFILE_MIN_TRANSFER_BYTES = 8 << 20


def tier_passes(
    spec: TierSpec | str, nbytes: int = 1 << 30, transfer_bytes: int = 64 << 20, in_flight: int = 4, samples: int = 1
) -> dict[str, float]:
    """Through the tier itself (its threads, O_DIRECT, checksums, any throttle): writes `nbytes` (at most
    half the free space, and MAX_SMALL_TRANSFERS small transfers; at least two) in transfers of
    `transfer_bytes`, `in_flight` at a time, reads them back, then reads half while writing the other
    half, as the pipeline's fetches do; `samples` times. Returns the median seconds
    of each pass ("write", "read", "mixed"), the bytes of one pass ("bytes"), the transfers per pass
    ("count") and the fastest one-page read ("latency")."""
    transfer_bytes = max(ALIGN, transfer_bytes // ALIGN * ALIGN)
    tier: Tier = make_tier(spec)  # (checks the dir; its close takes the dir away where nothing else is in it)
    # At most half the file system's free space (a small tier is measured, not filled); small transfers at
    # most MAX_SMALL_TRANSFERS a pass (a small model's are thousands to a GiB, and as many tell no more).
    room = shutil.disk_usage(as_spec(spec).dir).free // 2
    count = max(2, min(nbytes, room) // transfer_bytes // 2 * 2)
    if transfer_bytes < PROFILE_MIN_TRANSFER_BYTES:
        count = min(count, MAX_SMALL_TRANSFERS)
    times: dict[str, list[float]] = {"read": [], "write": [], "mixed": []}
    try:
        tier.attach(tier_file_tag("calibrate"), [ALIGN] + [transfer_bytes] * count)
        buffers = [aligned_host_buffer(transfer_bytes) for _ in range(min(in_flight, count))]
        for b in buffers:  # incompressible, so a compressing file system cannot flatter itself
            b.copy_(torch.randint(0, 256, (transfer_bytes,), dtype=torch.uint8))
        keys = list(range(1, count + 1))
        half = count // 2

        def ops(kind: str, ks: list[int]) -> list[Callable[[torch.Tensor], Future]]:
            return [lambda b, k=k: getattr(tier, kind)(k, b) for k in ks]

        mixed = [op for pair in zip(ops("read", keys[:half]), ops("write", keys[half:])) for op in pair]
        _timed_transfers(ops("write", keys), buffers)  # every block allocated before timing
        for _ in range(samples):
            times["write"].append(_timed_transfers(ops("write", keys), buffers))
            times["read"].append(_timed_transfers(ops("read", keys), buffers))
            times["mixed"].append(_timed_transfers(mixed, buffers))
        page = aligned_host_buffer(ALIGN)
        tier.write(0, page).result()
        latencies = []
        for _ in range(5):
            t0 = time.perf_counter()
            tier.read(0, page).result()
            latencies.append(time.perf_counter() - t0)
    except OSError as exc:
        hint = "the file system is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "check the file system"
        what = os.strerror(exc.errno) if exc.errno else str(exc)  # (the tier's own text speaks of a step's subgroups)
        raise TierError(
            f"calibrating {spec}: {count} x {transfer_bytes} bytes failed: {what} ({hint}; free "
            "space, lower offload.calibration_gb, or pick another path)"
        ) from exc
    finally:
        tier.close()
    # the fastest page read: scheduling noise only ever adds to a latency
    return {**{k: statistics.median(v) for k, v in times.items()}, "bytes": count * transfer_bytes, "count": count,
            "latency": min(latencies)}  # fmt: skip


def measure_tier(
    spec: TierSpec | str, nbytes: int = 1 << 30, transfer_bytes: int = 64 << 20, in_flight: int = 4, samples: int = 3
) -> TierSpeed:
    """The tier's read and write bandwidth and per-request latency, from `tier_passes` (the median of
    `samples` passes each way: one pass of a shared disk has been seen 1.7x off the next).

    The model charges a step's reads and writes one after the other; where the tier is slower with
    both under way (a disk), read and write bandwidth are scaled down together so that the model's
    time for equal bytes each way is the mixed pass's."""
    passes = tier_passes(spec, nbytes, transfer_bytes, in_flight, samples)
    total, count, latency = passes["bytes"], passes["count"], passes["latency"]

    def bandwidth(kind: str) -> float:
        # The model charges latency + bytes / bandwidth per request, so the latency of each transfer
        # comes off (as on a serial device); the floor keeps a device that overlaps requests finite.
        return total / max(passes[kind] - count * latency, 0.1 * passes[kind])

    read, write = bandwidth("read"), bandwidth("write")
    scale = min(1.0, bandwidth("mixed") / (2 / (1 / read + 1 / write)))  # only down: a faster mixed pass leaves them
    speed = TierSpeed(read * scale, write * scale, latency)
    if not speed.valid:
        raise TierError(f"calibrating {spec} gave {speed}: not a usable bandwidth; measure again with more bytes")
    log.info("measured %s: read %.2f GB/s, write %.2f GB/s, latency %.2f ms", spec, speed.read_bps / 1e9, speed.write_bps / 1e9,
             speed.latency_s * 1e3)  # fmt: skip
    return speed


@contextlib.contextmanager
def node_turn() -> Iterator[None]:
    """Holds this user's calibration lock on this node (an flock on a file in the temp dir, dropped by
    the kernel even if the holder is killed): one measurement at a time."""
    path = os.path.join(tempfile.gettempdir(), f"fsdp-offload-calibrate-{os.getuid()}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def seed_speeds(specs: list[TierSpec], profile: BandwidthProfile | None, nbytes: int, transfer_bytes: int) -> list[TierSpeed]:
    """Each tier's speed from the profile, measuring (and saving) those it lacks. Ranks of one node
    take turns on the profile's lock, so a tier is measured once and never by two ranks at a time.
    Without a profile each rank measures, in turns (at once, each would see a share of the device)."""
    if profile is None:
        with node_turn():
            return [measure_tier(s, nbytes, transfer_bytes) for s in specs]
    with profile.locked():
        known = profile.load([s.key for s in specs])  # (another tier's entry is no concern of this run)
        measured: dict[str, TierSpeed] = {}
        for spec in specs:
            if spec.key not in known:
                log.info("measuring %s (%d bytes in transfers of %d) for the bandwidth profile %s", spec, nbytes, transfer_bytes, profile.path)
                known[spec.key] = measured[spec.key] = measure_tier(spec, nbytes, transfer_bytes)
        if measured and transfer_bytes >= PROFILE_MIN_TRANSFER_BYTES:
            profile.store(measured, "calibrated")
        elif measured:
            log.info("the bandwidth profile keeps none of these: transfers of %d bytes (a small model's) time each "
                     "request's own costs more than the tier; this run uses them", transfer_bytes)  # fmt: skip
        return [known[s.key] for s in specs]


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
    try:  # every tier's dir before any is measured: a typo in the last must not cost the first's minutes
        problems = [tier_root_problem(TierSpec.parse(spec).dir, spec) for spec in args.tiers]
    except ValueError as exc:
        problems = [str(exc)]
    if any(problems):
        print(f"error: {'; '.join(p for p in problems if p)}", file=sys.stderr)
        return 1
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
