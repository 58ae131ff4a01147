"""Placement benchmark: the learned rule against Eq. 1, timed, on throttled tiers (a serial device of
given speeds each), slow enough that the update phase is I/O-bound on any CPU.

1. Asymmetric tiers: A reads fast and writes slowly (96 / 24 MB/s), B is even (36 / 36 MB/s). Eq. 1
   weighs A by its write bandwidth alone; the learned rule prices reads and writes apart. Reports each
   rule's measured update phase (median of steady-state steps) beside the model's prediction.
2. 2:1 tiers (48 and 24 MB/s), both believed equal at first: the learned split's update phase against
   the ideal makespan (every byte moved at the two tiers' summed bandwidth).

The tests (tests/test_placement.py) assert the model's predictions only; the timings are claimed here.
Writes benchmarks/results/bench_placement_<device>_<time>.json; about a minute:

    python3 scripts/bench_placement.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.bandwidth import expected_step_seconds, steady_traffic
from fsdp_offload.bandwidth import TierSpeed
from fsdp_offload.bandwidth_profile import write_profile
from fsdp_offload.results import record
from fsdp_offload.subgroups import SubgroupLayout

MB = 1e6


def throttled(root: str, name: str, read_mbps: float, write_mbps: float) -> str:
    os.makedirs(os.path.join(root, name))
    return f"throttle:posix:{os.path.join(root, name)}?read={read_mbps}MB/s&write={write_mbps}MB/s"


def slot_bytes(sg: int) -> int:
    """One subgroup's state as the host cache and the tiers hold it (bf16 params: split masters)."""
    return SubgroupLayout([sg], sg, split_masters=True).slot_bytes


def steady_update_s(tiers: list[str], profile: str, sg: int, m: int, c: int, steps: int, **cfg_kw) -> tuple[list[float], OffloadAdamW]:
    """Update phases of `steps` steps after the first, of an optimizer over `m` subgroups of `sg`
    elements whose host cache holds `c`; the optimizer is returned open (the caller closes it)."""
    params = [torch.nn.Parameter(torch.randn(sg)) for _ in range(m)]
    cfg = OffloadConfig(kernel="torch", tiers=tiers, subgroup_numel=sg, host_budget_gb=(2 * m * sg + c * slot_bytes(sg)) / 2**30,
                        bandwidth_profile=profile, **cfg_kw)  # fmt: skip
    opt = OffloadAdamW(params, lr=1e-3, offload=cfg)
    times = []
    for _ in range(steps + 1):
        for p in params:
            p.grad = torch.randn(sg, dtype=torch.bfloat16)
        opt.step()
        times.append(opt.last_metrics.update_s)
    return times[1:], opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/dev/shm", help="where the throttled tiers keep their files")
    ap.add_argument("--subgroup-numel", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device-kind", default="cpu", help="machine kind for the record (e.g. nvidia-h100-x1)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the tiers' I/O threads need the cores: this times placement, not the kernel
    sg, m, c = args.subgroup_numel, 24, 6
    sizes = [slot_bytes(sg)] * m
    result: dict = {"subgroup_numel": sg, "subgroups": m, "cache_subgroups": c}
    with tempfile.TemporaryDirectory(dir=args.root) as root, tempfile.TemporaryDirectory() as scratch:
        speeds = {"a": (96, 24), "b": (36, 36)}
        rules = {}
        for rule in ("eq1", "learned"):
            tiers = [throttled(root, f"{rule}-{n}", r, w) for n, (r, w) in speeds.items()]
            seeds = {t: TierSpeed(r * MB, w * MB, 0.0) for t, (r, w) in zip(tiers, speeds.values())}
            times, opt = steady_update_s(tiers, write_profile(os.path.join(scratch, f"{rule}.json"), seeds), sg, m, c, args.steps,
                                         placement=rule, update_order="alternating")  # fmt: skip
            tier_of = opt.store.placement.tier_of
            predicted = expected_step_seconds(tier_of, list(seeds.values()), sizes, steady_traffic(m, c, "alternating"))
            rules[rule] = {"update_s": statistics.median(times), "predicted_s": predicted, "split": [tier_of.count(i) for i in range(2)]}
            opt.close()
            print(f"asymmetric tiers, {rule:>7}: update {rules[rule]['update_s']:.3f} s/step measured, {predicted:.3f} predicted, "
                  f"A:B = {rules[rule]['split'][0]}:{rules[rule]['split'][1]}", flush=True)  # fmt: skip
        result["asymmetric"] = {**rules, "learned_speedup_measured": rules["eq1"]["update_s"] / rules["learned"]["update_s"],
                                "learned_speedup_predicted": rules["eq1"]["predicted_s"] / rules["learned"]["predicted_s"]}  # fmt: skip
        tiers = [throttled(root, "a", 48, 48), throttled(root, "b", 24, 24)]
        profile = write_profile(os.path.join(scratch, "two_to_one.json"), {t: TierSpeed(30 * MB, 30 * MB, 0.0) for t in tiers})
        times, opt = steady_update_s(tiers, profile, sg, m, c, 6)
        opt.close()
        moved = 2 * (m - c) * slot_bytes(sg)  # read and written each step
        ideal = moved / (72 * MB)
        ratios = [t / ideal for t in times[1:]]  # from the third step: the split has followed the learned speeds
        result["two_to_one"] = {"update_s": times, "ideal_s": ideal, "update_over_ideal_median": statistics.median(ratios)}
        print(f"2:1 tiers: update phase / ideal makespan per step: {', '.join(f'{r:.3f}' for r in ratios)}", flush=True)
    print(f"learned is {result['asymmetric']['learned_speedup_measured']:.2f}x faster than Eq. 1 (model: "
          f"{result['asymmetric']['learned_speedup_predicted']:.2f}x)")  # fmt: skip
    print(record("bench_placement", args.device_kind, args.out, result))


if __name__ == "__main__":
    main()
