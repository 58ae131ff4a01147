"""Multi-path benchmark: the update phase on one path (disk) versus two (disk + /dev/shm), and 4
processes sharing the disk with node-level exclusive access on versus off.

1. Calibrates both paths through the tiers themselves (the numbers the bandwidth model starts from).
2. One path: OffloadAdamW steps over `--subgroups` subgroups, `--cache-subgroups` of which fit the
   host cache (alternating order, so the rest go to the tier and back every step).
3. Two paths: the same on disk + shm with the learned placement. The ideal speedup is what the
   calibrated bandwidths allow: each moving subgroup costs 1/read + 1/write per byte on its path, so
   two paths at best move bytes at the sum of the two paths' rates.
4. `--procs` processes each step their own optimizer (`--proc-subgroups` subgroups) on the disk, in
   lock step (a barrier before each step, as ranks synchronised by collectives are); a step lasts
   until the slowest process is done. Once with tier_access="shared", once "exclusive".

Writes benchmarks/results/bench_multipath_<device>_<time>.json with command, device, commit,
update_s_one_path, update_s_two_paths, two_path_speedup, ideal_two_path_speedup, exclusive_speedup
and the numbers behind them; prints a table last.

On the GPU machine (16 cores, ~2.5 GB/s virtio disk, /dev/shm tmpfs; about 4 minutes):

    python3 scripts/bench_multipath.py --device-kind nvidia-h100-x1 --disk posix:/var/tmp \\
        --shm posix:/dev/shm --subgroup-numel 52428800 --subgroups 16 --cache-subgroups 4 \\
        --procs 4 --proc-subgroups 6 --steps 3 --calibration-gb 1

(state 9.4 GiB against a 2.3 GiB cache; the 4 processes put 4 x 3.5 GiB on the disk.) Here, small:

    python3 scripts/bench_multipath.py --disk posix:/tmp --shm posix:/dev/shm --subgroup-numel 262144 \\
        --subgroups 12 --cache-subgroups 4 --proc-subgroups 5 --steps 2 --calibration-gb 0.05
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.bandwidth_profile import BandwidthProfile, tier_profile_key
from fsdp_offload.calibrate import TierSpeed, measure_tier
from fsdp_offload.results import record

STATE_BYTES_PER_PARAM = 12  # FP32 master, exp_avg, exp_avg_sq


def offload_config(args: argparse.Namespace, tiers: list[str], subgroups: int, cache: int, **kw) -> OffloadConfig:
    staging = 2 * subgroups * args.subgroup_numel
    budget = (staging + cache * STATE_BYTES_PER_PARAM * args.subgroup_numel) / 2**30
    return OffloadConfig(
        tiers=tiers, subgroup_numel=args.subgroup_numel, prefetch=args.prefetch, host_budget_gb=budget,
        kernel=args.kernel, **kw,
    )  # fmt: skip


def step_times(opt: OffloadAdamW, params: list[torch.Tensor], grads: list[torch.Tensor], steps: int, before=None) -> list[float]:
    times = []
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g
        if before is not None:
            before()
        opt.step()
        times.append(opt.last_metrics.update_s)
    return times


def run_single(args: argparse.Namespace, tiers: list[str], profile: str, label: str) -> dict:
    params = [torch.nn.Parameter(torch.randn(args.subgroup_numel)) for _ in range(args.subgroups)]
    grads = [torch.randn(args.subgroup_numel, dtype=torch.bfloat16) for _ in params]
    cfg = offload_config(args, tiers, args.subgroups, args.cache_subgroups, bandwidth_profile=profile)
    opt = OffloadAdamW(params, lr=1e-4, offload=cfg)
    times = step_times(opt, params, grads, args.warmup + args.steps)
    m = opt.last_metrics
    out = {
        "update_s": statistics.median(times[args.warmup :]),
        "update_s_per_step": times,
        "bytes_moved_per_step": {t: m.bytes_read.get(t, 0) + m.bytes_written.get(t, 0) for t in tiers},
        "subgroups_per_tier": m.subgroups_per_tier,
        "kernel": opt.kernel_name,
    }
    opt.close()
    print(f"  {label}: update {out['update_s']:.2f} s/step (steps {', '.join(f'{t:.2f}' for t in times)})", flush=True)
    return out


def proc_worker(rank: int, args: argparse.Namespace, access: str, barrier, results) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.procs))
    params = [torch.nn.Parameter(torch.randn(args.subgroup_numel)) for _ in range(args.proc_subgroups)]
    grads = [torch.randn(args.subgroup_numel, dtype=torch.bfloat16) for _ in params]
    cfg = offload_config(args, [args.disk], args.proc_subgroups, args.proc_cache_subgroups, tier_access=access)
    opt = OffloadAdamW(params, lr=1e-4, offload=cfg)
    times = step_times(opt, params, grads, args.warmup + args.steps, before=barrier.wait)
    barrier.wait()
    wait = opt.store.tiers[0].lock.wait_s if access != "shared" else 0.0
    opt.close()
    results.put((rank, times, wait))


def run_procs(args: argparse.Namespace, access: str) -> dict:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(args.procs), ctx.Queue()
    procs = [ctx.Process(target=proc_worker, args=(r, args, access, barrier, results)) for r in range(args.procs)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=args.proc_timeout) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a {access} worker exited with {p.exitcode}")
    per_step = [max(times[s] for _, times, _ in got) for s in range(args.warmup + args.steps)]
    out = {"step_s": statistics.median(per_step[args.warmup :]), "step_s_per_step": per_step, "lock_wait_s": [w for *_, w in got]}
    print(f"  {args.procs} processes, {access}: slowest update {out['step_s']:.2f} s/step (steps {', '.join(f'{t:.2f}' for t in per_step)})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--disk", default="posix:/var/tmp", help="the first path: a tier spec on the disk")
    ap.add_argument("--shm", default="posix:/dev/shm", help="the second path")
    ap.add_argument("--subgroup-numel", type=int, default=50 << 20)
    ap.add_argument("--subgroups", type=int, default=16, help="subgroups of the 1- and 2-path runs")
    ap.add_argument("--cache-subgroups", type=int, default=4, help="of which the host cache holds this many")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--proc-subgroups", type=int, default=6, help="subgroups of each process in the 4-process runs")
    ap.add_argument("--proc-cache-subgroups", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--calibration-gb", type=float, default=1.0)
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--proc-timeout", type=float, default=400, help="seconds to wait for the worker processes")
    ap.add_argument("--device-kind", default="cpu", help="machine kind for the record (e.g. nvidia-h100-x1)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.cache_subgroups >= args.subgroups or args.proc_cache_subgroups >= args.proc_subgroups:
        ap.error("the state must be larger than the host cache: --cache-subgroups < --subgroups, --proc-cache-subgroups < --proc-subgroups")
    start = time.perf_counter()

    print("calibrating", flush=True)
    transfer = min(STATE_BYTES_PER_PARAM * args.subgroup_numel, 64 << 20)
    speeds: dict[str, TierSpeed] = {}
    for spec in (args.disk, args.shm):
        speeds[spec] = measure_tier(spec, int(args.calibration_gb * (1 << 30)), transfer)
        s = speeds[spec]
        print(f"  {spec}: read {s.read_bps / 1e9:.2f} GB/s, write {s.write_bps / 1e9:.2f} GB/s, latency {s.latency_s * 1e3:.2f} ms", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        profile_path = os.path.join(scratch, "bandwidth.json")  # this run's calibration, not the user's profile
        profile = BandwidthProfile(profile_path)
        with profile.locked():
            profile.store({tier_profile_key(k): v for k, v in speeds.items()}, "calibrated")
        profile.close()
        print("update phase", flush=True)
        one = run_single(args, [args.disk], profile_path, "one path ")
        two = run_single(args, [args.disk, args.shm], profile_path, "two paths")
    print("node-level access", flush=True)
    shared = run_procs(args, "shared")
    exclusive = run_procs(args, "exclusive")

    # per byte of a moving subgroup (read once and written once a step): 1/read + 1/write seconds
    rate = {k: 1 / (1 / s.read_bps + 1 / s.write_bps) for k, s in speeds.items()}
    ideal = (rate[args.disk] + rate[args.shm]) / rate[args.disk]
    result = {
        "update_s_one_path": one["update_s"],
        "update_s_two_paths": two["update_s"],
        "two_path_speedup": one["update_s"] / two["update_s"],
        "ideal_two_path_speedup": ideal,
        "exclusive_speedup": shared["step_s"] / exclusive["step_s"],
        "calibration": {k: {"read_gbps": s.read_bps / 1e9, "write_gbps": s.write_bps / 1e9, "latency_ms": s.latency_s * 1e3} for k, s in speeds.items()},
        "subgroup_numel": args.subgroup_numel,
        "subgroups": args.subgroups,
        "cache_subgroups": args.cache_subgroups,
        "state_gib": args.subgroups * args.subgroup_numel * STATE_BYTES_PER_PARAM / 2**30,
        "one_path": one,
        "two_paths": two,
        "procs": args.procs,
        "proc_subgroups": args.proc_subgroups,
        "proc_cache_subgroups": args.proc_cache_subgroups,
        "shared": shared,
        "exclusive": exclusive,
        "torch_threads": torch.get_num_threads(),
        "wall_s": time.perf_counter() - start,
    }
    path = record("bench_multipath", args.device_kind, args.out, result)
    print(f"\nwrote {path}")
    print(f"{'':>24} {'update s':>9} {'speedup':>8} {'ideal':>6}")
    print(f"{'one path (disk)':>24} {one['update_s']:>9.2f}")
    print(f"{'two paths (disk + shm)':>24} {two['update_s']:>9.2f} {result['two_path_speedup']:>8.2f} {ideal:>6.2f}")
    print(f"{f'{args.procs} procs, shared':>24} {shared['step_s']:>9.2f}")
    print(f"{f'{args.procs} procs, exclusive':>24} {exclusive['step_s']:>9.2f} {result['exclusive_speedup']:>8.2f}")


if __name__ == "__main__":
    main()
