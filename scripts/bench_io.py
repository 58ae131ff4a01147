"""The disk under a tier dir, raw and through the POSIX tier, at the same queue depths.

For each thread count (and request size): `rawio.measure_raw_io` (a pre-sized O_DIRECT file,
plain pread/pwrite from that many threads: the ceiling) and `calibrate.tier_passes` through the
POSIX tier with the same threads and request size (its checksums, its queue, transfers of
--transfer-mib as the pipeline's subgroup reads and writes): write, read, and half read while half
written, medians of --samples. What the tier loses against raw at the same depth is the tier's cost;
which depth is best is the disk's.

--sustained-s N then holds the mixed load N seconds without a pause (`rawio.mixed_io_timeline`,
at the first --threads and --request-mib), rests --rest-s, and holds it again: the GB/s of each
--window-s window say whether the disk keeps its rate under a training run's load, or bursts on
credits that the load drains (and the rest refills).

    python scripts/bench_io.py --dir /var/tmp --threads 4 8 16 --device-kind nvidia-h100-x1
    python scripts/bench_io.py --dir /var/tmp --threads 4 --no-sweep --sustained-s 120 --rest-s 30
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from fsdp_offload.calibrate import tier_passes
from fsdp_offload.rawio import measure_raw_io, mixed_io_timeline
from fsdp_offload.results import record

GIB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp", help="the tier dir (its file system is measured)")
    ap.add_argument("--threads", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--request-mib", type=int, nargs="+", default=[8])
    ap.add_argument("--gib", type=float, default=2.0, help="bytes of one pass")
    ap.add_argument("--transfer-mib", type=int, default=256, help="one tier transfer (a subgroup is ~1.2 GB)")
    ap.add_argument("--in-flight", type=int, default=3, help="tier transfers under way at once (the pipeline's prefetch + 1)")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True, help="raw vs tier at each depth")
    ap.add_argument("--sustained-s", type=float, default=0.0, help="then the mixed load held this long (0: not)")
    ap.add_argument("--rest-s", type=float, default=30.0, help="idle between the two sustained runs")
    ap.add_argument("--window-s", type=float, default=5.0)
    ap.add_argument("--device-kind", default="cpu")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if min(args.threads) < 1 or min(args.request_mib) < 1 or not args.gib > 0:
        ap.error("--threads, --request-mib and --gib must be positive")

    if not (args.sweep or args.sustained_s > 0):
        ap.error("nothing to measure: --no-sweep without --sustained-s")
    if args.sustained_s < 0 or not args.window_s > 0 or args.rest_s < 0:
        ap.error("--sustained-s and --rest-s must be >= 0 and --window-s > 0")
    nbytes = int(args.gib * GIB)
    result: dict = {"dir": os.path.realpath(args.dir), "pass_gib": args.gib}
    if args.sweep:
        result.update(sweep(args, nbytes))
    if args.sustained_s > 0:
        result["sustained"] = sustained(args, nbytes)
    path = record("bench_io", args.device_kind, args.out, result)
    print(f"wrote {path}")


def sweep(args: argparse.Namespace, nbytes: int) -> dict:
    """Raw pread/pwrite and the POSIX tier at each thread count and request size."""
    rows = []
    print(f"{'threads':>7} {'req MiB':>7} | {'raw write':>9} {'read':>6} {'mixed':>6} | {'tier write':>10} {'read':>6} {'mixed':>6} | {'tier/raw mixed':>14}")
    for request in args.request_mib:
        for threads in args.threads:
            raw = measure_raw_io(args.dir, nbytes, request << 20, threads, args.samples)
            with tempfile.TemporaryDirectory(dir=args.dir) as d:
                spec = f"posix:{d}?threads={threads}&request_mb={request}"
                p = tier_passes(spec, nbytes, args.transfer_mib << 20, args.in_flight, args.samples)
            tier = {k: p["bytes"] / p[k] / 1e9 for k in ("write", "read", "mixed")}
            row = {"threads": threads, "request_mib": request, "raw": raw.as_dict(),
                   "tier": {f"{k}_gbps": v for k, v in tier.items()}, "tier_bytes": p["bytes"],
                   "tier_over_raw_mixed": tier["mixed"] / raw.mixed_gbps}  # fmt: skip
            rows.append(row)
            print(f"{threads:>7} {request:>7} | {raw.write_gbps:>9.2f} {raw.read_gbps:>6.2f} {raw.mixed_gbps:>6.2f} | "
                  f"{tier['write']:>10.2f} {tier['read']:>6.2f} {tier['mixed']:>6.2f} | {row['tier_over_raw_mixed']:>14.2f}", flush=True)  # fmt: skip
    best = max(rows, key=lambda r: r["tier"]["mixed_gbps"])
    print(f"best through the tier: threads={best['threads']} request_mb={best['request_mib']} ({best['tier']['mixed_gbps']:.2f} GB/s mixed)")
    return {
        "transfer_mib": args.transfer_mib, "in_flight": args.in_flight, "samples": args.samples, "rows": rows,
        "best_tier_mixed": {"threads": best["threads"], "request_mib": best["request_mib"], "gbps": best["tier"]["mixed_gbps"]},
    }  # fmt: skip


def sustained(args: argparse.Namespace, nbytes: int) -> dict:
    """The mixed load held --sustained-s, a rest, and held again: the rate window by window."""
    threads, request = args.threads[0], args.request_mib[0] << 20
    runs = []
    for k in range(2):
        if k:
            time.sleep(args.rest_s)
        t = mixed_io_timeline(args.dir, args.sustained_s, args.window_s, nbytes, request, threads)
        runs.append(t)
        rates = [w["mixed_gbps"] for w in t["windows"]]
        print(f"sustained mixed load {'after a ' + format(args.rest_s, '.0f') + ' s rest' if k else ''}: GB/s per "
              f"{args.window_s:.0f} s window: {' '.join(f'{r:.2f}' for r in rates)}", flush=True)  # fmt: skip
    return {"rest_s": args.rest_s, "runs": runs}


if __name__ == "__main__":
    main()
