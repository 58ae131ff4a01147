"""The disk under a tier dir, raw and through the POSIX tier, at the same queue depths.

For each thread count (and request size): `calibrate.measure_raw_io` (a pre-sized O_DIRECT file,
plain pread/pwrite from that many threads: the ceiling) and `calibrate.tier_passes` through the
POSIX tier with the same threads and request size (its checksums, its queue, transfers of
--transfer-mib as the pipeline's subgroup reads and writes): write, read, and half read while half
written, medians of --samples. What the tier loses against raw at the same depth is the tier's cost;
which depth is best is the disk's.

    python scripts/bench_io.py --dir /var/tmp --threads 4 8 16 --device-kind nvidia-h100-x1
"""

from __future__ import annotations

import argparse
import os
import tempfile

from fsdp_offload.calibrate import measure_raw_io, tier_passes
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
    ap.add_argument("--device-kind", default="cpu")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if min(args.threads) < 1 or min(args.request_mib) < 1 or not args.gib > 0:
        ap.error("--threads, --request-mib and --gib must be positive")

    nbytes = int(args.gib * GIB)
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
    path = record("bench_io", args.device_kind, args.out, {
        "dir": os.path.realpath(args.dir), "pass_gib": args.gib, "transfer_mib": args.transfer_mib, "in_flight": args.in_flight,
        "samples": args.samples, "rows": rows,
        "best_tier_mixed": {"threads": best["threads"], "request_mib": best["request_mib"], "gbps": best["tier"]["mixed_gbps"]},
    })  # fmt: skip
    print(f"best through the tier: threads={best['threads']} request_mb={best['request_mib']} "
          f"({best['tier']['mixed_gbps']:.2f} GB/s mixed); wrote {path}")


if __name__ == "__main__":
    main()
