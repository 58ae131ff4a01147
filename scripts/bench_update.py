"""Update-phase benchmark: effective I/O of the offload pipeline against the tier's raw bandwidth.

First measures the raw bandwidth of the tier dir (same request size and thread count as the tier),
then runs OffloadAdamW steps over N subgroups whose state lives on the tier (fixed order and a minimal
host cache, so every subgroup is read and written every step) and reports update throughput and
effective I/O = bytes moved / I/O busy time, as a fraction of raw, and the update against the physical
limit (bytes moved / raw mixed rate). `--cache-slots` and `--update-order` give it a host cache that
keeps subgroups between steps, as training runs; a `throttle:` tier is a serial device of the speeds it
names (its rate is the raw one), which shows what the pipeline loses on a device that shares its
bandwidth between reads and writes perfectly.

    python scripts/bench_update.py --tier posix:/mnt/nvme --subgroups 8 --subgroup-numel 104857600
"""

from __future__ import annotations

import argparse

import torch

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.rawio import measure_raw_io
from fsdp_offload.results import record
from fsdp_offload.storage import TierSpec
from fsdp_offload.storage.spec import io_settings
from fsdp_offload.storage.throttle import ThrottledTier


def run_update(spec: str, args: argparse.Namespace) -> dict:
    n = args.subgroups * args.subgroup_numel
    params = [torch.nn.Parameter(torch.randn(args.subgroup_numel)) for _ in range(args.subgroups)]
    slot = 3 * args.subgroup_numel * 4
    slots = args.cache_slots or args.prefetch + 1  # default: the pipeline's minimum, nothing cached between steps
    budget = (2 * n + 4096 * args.subgroups + slots * slot) / 2**30
    cfg = OffloadConfig(
        tiers=[spec], subgroup_numel=args.subgroup_numel, prefetch=args.prefetch, update_order=args.update_order,
        host_budget_gb=budget, kernel=args.kernel, grad_path=args.grad_path, overlap="none",
    )  # fmt: skip
    opt = OffloadAdamW(params, lr=1e-4, offload=cfg)
    rows = []
    for step in range(args.warmup + args.steps):
        for p in params:
            p.grad = torch.randn(p.shape, dtype=torch.bfloat16)
        opt.step()
        m = opt.last_metrics
        if step >= args.warmup:
            rows.append(m)
        print(
            f"  step {step}: update {m.update_s:.2f}s, {m.update_mparams_per_s:.0f} Mparam/s, "
            f"effective I/O {m.effective_io_gbps:.2f} GB/s, read {m.subgroups_read} / wrote {m.subgroups_written} subgroups",
            flush=True,
        )
    kernel = opt.kernel_name
    tier = opt.store.tiers[0]
    while hasattr(tier, "inner"):  # through the lock / throttle wrappers to the storage tier
        tier = tier.inner
    gds = getattr(tier, "gds", None)  # KvikIO tiers say whether GDS (not compat mode) was used
    throttled = opt.store.tiers[0]
    while not isinstance(throttled, ThrottledTier) and hasattr(throttled, "inner"):
        throttled = throttled.inner
    limits = throttled.limits if isinstance(throttled, ThrottledTier) else None
    cache_slots = opt.store.cache.num_slots
    opt.close()
    moved = sum(sum(m.bytes_read.values()) + sum(m.bytes_written.values()) for m in rows)
    busy = sum(m.io_busy_s for m in rows)
    update_s = sum(m.update_s for m in rows) / len(rows)
    return {
        "kernel": kernel,
        "gds": gds,
        "update_s": update_s,
        "update_mparams_per_s": n / update_s / 1e6,
        "effective_io_gbps": moved / busy / 1e9,
        "bytes_moved_per_step": moved / len(rows),
        "cache_slots": cache_slots,
        # a throttled tier is a serial device of known speeds: its rate for equal bytes each way
        "device_mixed_gbps": None if limits is None else 2 / (1 / limits.read_bps + 1 / limits.write_bps) / 1e9,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", default="posix:/tmp", help="tier spec, e.g. posix:/mnt/nvme?threads=8")
    ap.add_argument("--subgroups", type=int, default=8)
    ap.add_argument("--subgroup-numel", type=int, default=100 * (1 << 20))
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--cache-slots", type=int, default=None, help="host cache slots (default: the minimum, prefetch + 1)")
    ap.add_argument("--update-order", default="fixed", help="fixed (default: every subgroup read and written each step), "
                    "alternating or forward (the cache keeps subgroups between steps)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--grad-path", default="host_bf16", help="host_bf16 (default) or tier_fp32 (DeepSpeed-style)")
    ap.add_argument("--device-kind", default="cpu", help="machine kind for the record (e.g. nvidia-h100-x1)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    spec = TierSpec.parse(args.tier)
    root = spec.dir
    threads, request = io_settings(spec)
    state_bytes = args.subgroups * 3 * args.subgroup_numel * 4
    raw = None
    if spec.scheme != "throttle":  # a throttled tier's speeds are its own: no disk to measure
        raw = measure_raw_io(root, min(state_bytes, 4 << 30), request_bytes=request, threads=threads)
        print(f"raw {root}: write {raw.write_gbps:.2f}, read {raw.read_gbps:.2f}, mixed {raw.mixed_gbps:.2f} GB/s, "
              f"O_DIRECT={raw.direct}", flush=True)  # fmt: skip
    upd = run_update(args.tier, args)
    mixed = upd["device_mixed_gbps"] if raw is None else raw.mixed_gbps
    limit = upd["bytes_moved_per_step"] / (mixed * 1e9)  # the disk's bytes at its own rate

    result = {
        "tier": args.tier,
        "grad_path": args.grad_path,
        "subgroups": args.subgroups,
        "subgroup_numel": args.subgroup_numel,
        "threads": threads,
        "request_bytes": request,
        "torch_threads": torch.get_num_threads(),
        "update_order": args.update_order,
        "raw_io": None if raw is None else raw.as_dict(),
        **upd,
        "raw_mixed_io_gbps": mixed,
        "effective_io_fraction": upd["effective_io_gbps"] / mixed,
        "physical_limit_s": limit,
        "update_over_physical_limit": upd["update_s"] / limit,
    }
    path = record(f"bench_update_{spec.scheme}", args.device_kind, args.out, result)
    print(f"\n{'raw mixed GB/s':>14} {'effective GB/s':>15} {'fraction':>9} {'update s':>9} {'limit s':>8} {'x limit':>8} {'Mparam/s':>9}")
    print(
        f"{mixed:>14.2f} {upd['effective_io_gbps']:>15.2f} {result['effective_io_fraction']:>9.2f} "
        f"{upd['update_s']:>9.2f} {limit:>8.2f} {result['update_over_physical_limit']:>8.3f} {upd['update_mparams_per_s']:>9.0f}"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
