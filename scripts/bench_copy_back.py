"""What copying a subgroup's new params back into the model costs the update's thread, a segment (a
param's part in a subgroup): `LowpStaging.copy_params_to_model` over every subgroup of many small
params, on the CPU (what a GPU run adds is its copies' own launches). Run it from two checkouts
(PYTHONPATH) to compare them.

    python scripts/bench_copy_back.py --device-kind cpu-2core

One JSON under --out (result keys: params, subgroups, segments, us_per_segment, passes); a line on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fsdp_offload.results import record
from fsdp_offload.staging import LowpStaging
from fsdp_offload.subgroups import SubgroupLayout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=int, default=2000, help="params of 1000 elements (every 200th of 4000: split)")
    ap.add_argument("--subgroup-numel", type=int, default=50176)
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--device-kind", required=True)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    numels = [4000 if i % 200 == 0 else 1000 for i in range(args.params)]
    layout = SubgroupLayout(numels, args.subgroup_numel)
    staging = LowpStaging(layout, torch.bfloat16, pin=False)
    staging.staged = [True] * len(numels)
    staging.buffer.copy_(torch.randn(staging.buffer.numel()).to(torch.bfloat16))
    params = [torch.zeros(n, dtype=torch.bfloat16) for n in numels]
    times = []
    for _ in range(args.passes):
        t0 = time.perf_counter()
        for sg in range(len(layout)):
            staging.copy_params_to_model(sg, params)
        times.append(time.perf_counter() - t0)
    for sg, subgroup in enumerate(layout.subgroups):  # the copies are right, or the timing means nothing
        for seg in subgroup.segments:
            if not torch.equal(params[seg.param].view(-1)[seg.in_param], staging.view(sg)[seg.in_subgroup]):
                raise SystemExit(f"param {seg.param}'s part in subgroup {sg} was not copied back")
    segments = sum(len(s.segments) for s in layout.subgroups)
    per_segment = statistics.median(times) / segments * 1e6
    path = record("bench_copy_back", args.device_kind, args.out, {"params": len(numels), "subgroups": len(layout),
                  "segments": segments, "us_per_segment": per_segment, "passes": args.passes})  # fmt: skip
    print(f"{len(layout)} subgroups, {segments} segments: {per_segment:.2f} us a segment; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
