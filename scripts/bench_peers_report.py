"""bench_peers: each system's row from its ranks' per-step rows, the comparisons across systems within
one round (share of GPU-only, compute limit, the peer ratios), the median round, and the table."""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass

from bench_peers_systems import SYSTEMS, ZERO_INFINITY_BYTES_PER_PARAM, System

# ratio name -> (peer, ours): the peer's iteration time over ours, like for like
RATIOS = {
    "ratio_vs_fsdp_cpu_offload_clip": ("fsdp_cpu_offload_clip", "host"),
    "ratio_vs_fsdp_cpu_offload": ("fsdp_cpu_offload", "host_noclip"),
    "ratio_vs_zero_infinity": ("zero_infinity", "disk"),
    "ratio_disk_grads_on_gpu_vs_zero_infinity": ("zero_infinity", "disk_grads_on_gpu"),
    "ratio_vs_zero_offload": ("zero_offload", "host"),
    "ratio_multipath_vs_zero_infinity": ("zero_infinity", "multipath"),
    "ratio_multipath_gpu0_vs_zero_infinity": ("zero_infinity", "multipath_gpu0"),
    "ratio_host_gpu0_vs_fsdp_cpu_offload_clip": ("fsdp_cpu_offload_clip", "host_gpu0"),
    "ratio_host_gpu0_vs_zero_offload": ("zero_offload", "host_gpu0"),
    "ratio_disk_gpu0_vs_zero_infinity": ("zero_infinity", "disk_gpu0"),
    "ratio_disk_gpu0_host_grads_vs_zero_infinity": ("zero_infinity", "disk_gpu0_host_grads"),
    "ratio_disk_gpu0_whole_vs_zero_infinity": ("zero_infinity", "disk_gpu0_whole"),
    "ratio_split_vs_whole_disk_gpu0": ("disk_gpu0_whole", "disk_gpu0"),
}
MODEL_TFLOPS_FORMULA = "(6 * params + 12 * n_layers * dim * seq) * tokens_per_step / iteration_s / 1e12"


@dataclass(frozen=True)
class Workload:
    """What one step computes, the same for every system."""

    params: int
    tokens_per_step: int  # all ranks, all micro-batches
    flops_per_token: float  # model FLOPs: 6 per param (forward + backward) plus attention's scores


def workload(margs, args: argparse.Namespace) -> Workload:
    from fsdp_offload.models import num_params

    params = num_params(margs)
    return Workload(params, args.nproc * args.micro_batches * args.batch * args.seq, 6 * params + 12 * margs.n_layers * margs.dim * args.seq)


def mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def disk_bytes(by_tier: dict, tier_dir: str) -> int:
    """Bytes of a JSONL bytes_read/bytes_written dict ({tier spec: bytes}) that went to `tier_dir`."""
    root = os.path.realpath(tier_dir)
    total = 0
    for spec, n in (by_tier or {}).items():
        path = spec[spec.find("/") :].split("?")[0] if "/" in spec else ""
        if path and os.path.realpath(path).startswith(root):
            total += n
    return total


def grad_accumulation(system: System, rows: list[dict], logged: str | None, micro_batches: int) -> tuple[str | None, str]:
    """The product's resolved offload.grad_accumulation and where it was read."""
    if not system.is_product:
        return None, "not this product's optimizer"
    from_rows = [r["grad_accumulation"] for r in rows if "grad_accumulation" in r]
    if from_rows:
        return from_rows[-1], "train.py's metrics rows"
    if logged:
        return logged, "the log line offload.grad_accumulation=..."
    if micro_batches == 1:
        return None, "one micro-batch: nothing is summed, and train.py logs no choice"
    return None, "train.py reported no choice (neither a metrics key nor its log line)"


def summarize(system: System, ranks: list[tuple[dict, list[dict]]], args: argparse.Namespace, sys_dir: str, raw_io: dict,
              work: Workload, host_peak: float, base: dict) -> dict:  # fmt: skip
    """One system's row: rank 0's step times averaged after --warmup-steps, the node's memory and I/O."""
    info, rows = ranks[0]
    measured = rows[args.warmup_steps :] or rows[-1:]  # the first steps warm up
    out: dict = {
        **base,
        "steps_run": len(rows),
        "steps_averaged": [r["step"] + 1 for r in measured],  # 1-based, as "steps 2+"
        "step_s_all": [r["step_s"] for r in rows],
        "first_steps_s": [r["step_s"] for r in rows[:2]],
        "iteration_s": mean(measured, "step_s"),
        "forward_s": mean(measured, "forward_s"),
        "backward_s": mean(measured, "backward_s"),
        "update_s": mean(measured, "update_s"),
    }
    if any("exposed_update_s" in r for r in measured):
        out["exposed_update_s"] = mean(measured, "exposed_update_s")
        out["exposed_update_note"] = "from the step's own exposed_update_s (update time not hidden behind forward/backward)"
    else:
        out["exposed_update_s"] = out["update_s"]
        out["exposed_update_note"] = "= update_s: this system's update does not overlap forward/backward"
    for key in ("overlap_s", "norm_s", "first_forward_s"):  # this product: time overlapped; the norm's; micro-batch 0's forward
        if any(key in r for r in measured):
            out[key] = mean(measured, key)
    out["tokens_per_step"] = work.tokens_per_step
    out["tokens_per_s"] = work.tokens_per_step / out["iteration_s"]
    out["model_tflops"] = work.flops_per_token * out["tokens_per_s"] / 1e12
    out["model_tflops_per_gpu"] = out["model_tflops"] / args.nproc
    # Each rank's own ru_maxrss (RUSAGE_SELF, logged after each step: start-up included), summed over
    # the node's ranks: a bound on the node's peak (the ranks need not peak at once). wait4's figure
    # is the largest single process of the tree (a rank, or the compilers of a first DeepSpeed op build).
    per_rank = [max((r["host_peak_gib"] for r in rank_rows if "host_peak_gib" in r), default=None) for _, rank_rows in ranks]
    out["host_peak_gib_per_rank"] = per_rank
    out["host_peak_gib"] = sum(p for p in per_rank if p is not None) if any(p is not None for p in per_rank) else host_peak
    out["host_peak_gib_with_children"] = host_peak
    rss = [r["host_rss_gib"] for r in rows if "host_rss_gib" in r]  # this product: resident memory at each step's end
    out["host_rss_end_gib"] = rss[-1] if rss else None
    gpu = [r["gpu_peak_gib"] for _, rank_rows in ranks for r in rank_rows if "gpu_peak_gib" in r]
    out["gpu_peak_gib"] = max(gpu) if gpu else None  # the fullest GPU's
    out["loss_first"], out["loss_last"] = rows[0].get("loss"), rows[-1].get("loss")
    out["max_grad_norm"] = args.max_grad_norm if system.clip else None
    out["grad_accumulation"], out["grad_accumulation_from"] = grad_accumulation(system, rows, base.get("logged_grad_accumulation"), args.micro_batches)
    paths = {r["grad_path"] for _, rank_rows in ranks for r in rank_rows if "grad_path" in r}  # this product's, as resolved
    out["grad_path"] = paths.pop() if len(paths) == 1 else sorted(paths) or None  # a list where ranks differ

    # I/O: what moved through the tier dir per step (the node's: every rank's), and how fast
    out["effective_io_gbps"] = out["raw_mixed_io_gbps"] = out["physical_limit_s"] = None
    if system.is_product and system.disk:
        moved = on_disk = 0.0
        for _, rank_rows in ranks:
            tail = rank_rows[args.warmup_steps :] or rank_rows[-1:]
            moved += sum(sum(r.get("bytes_read", {}).values()) + sum(r.get("bytes_written", {}).values()) for r in tail) / len(tail)
            on_disk += sum(disk_bytes(r.get("bytes_read", {}), sys_dir) + disk_bytes(r.get("bytes_written", {}), sys_dir) for r in tail) / len(tail)
        out["io_bytes_per_step"], out["disk_bytes_per_step"] = moved, on_disk
        out["effective_io_gbps"] = mean(measured, "effective_io_gbps")
        out["io_gbps_over_update"] = out["io_bytes_per_step"] / out["update_s"] / 1e9 if out["update_s"] else None
        out["effective_io_note"] = ("measured: rank 0's bytes read + written by the update over the time its I/O was under way "
                                    "(the JSONL's effective_io_gbps); io/disk bytes per step are all ranks'; grads never touch the tier")  # fmt: skip
    elif system.name == "zero_infinity":
        moved = ZERO_INFINITY_BYTES_PER_PARAM * work.params
        out["io_bytes_per_step"] = out["disk_bytes_per_step"] = moved
        busy = (out["update_s"] or 0) + (out["backward_s"] or 0)
        out["effective_io_gbps"] = moved / busy / 1e9 if busy else None
        out["effective_io_note"] = (f"estimated: {ZERO_INFINITY_BYTES_PER_PARAM} bytes/param/step (FP32 p, m, v, grad read; "
                                    "p, m, v written; FP32 grad written in backward) over backward_s + update_s")  # fmt: skip
    if system.disk:
        out["raw_io"] = raw_io
    if system.disk and raw_io.get("mixed_gbps"):
        out["raw_mixed_io_gbps"] = raw_io["mixed_gbps"]
        if out.get("disk_bytes_per_step") is not None:
            out["physical_limit_s"] = out["disk_bytes_per_step"] / (raw_io["mixed_gbps"] * 1e9)
            if system.offload == "multipath":
                out["physical_limit_note"] = "disk bytes only: what went to the shm path is not charged to the disk"
    out.update({k: v for k, v in info.items() if k != "params"})
    return out


def with_raw_after(out: dict, raw_after: dict) -> dict:
    """`out` with the disk as measured right after the system ran: the limit its steps met, on a disk
    whose rate moves with the load it just had (a cloud disk bursts on credits that a run drains)."""
    out = {**out, "raw_io_after": raw_after}
    if raw_after.get("mixed_gbps"):
        out["raw_mixed_io_after_gbps"] = raw_after["mixed_gbps"]
        if out.get("disk_bytes_per_step") is not None:
            out["physical_limit_after_s"] = out["disk_bytes_per_step"] / (raw_after["mixed_gbps"] * 1e9)
    return out


def turn(systems: list, k: int) -> list:
    """Round k's order: each round in the opposite order of the one before, so no system is always first."""
    return systems if k % 2 == 0 else systems[::-1]


def against_gpu_only(runs: dict[str, dict]) -> dict[str, dict]:
    """One round's runs with each one's share of gpu_only's tokens/s and its iteration over the compute
    limit (forward + backward alone: gpu_only's in this round where it ran, else the system's own)."""
    gpu = runs.get("gpu_only")
    gpu_ok = gpu is not None and "error" not in gpu
    why_not = "gpu_only was not selected" if gpu is None else f"gpu_only failed in this round: {gpu.get('error')}"
    out = {}
    for name, run in runs.items():
        if "error" in run:
            out[name] = run
            continue
        run = dict(run)
        if gpu_ok:
            run["share_of_gpu_only"] = run["tokens_per_s"] / gpu["tokens_per_s"]
            run["compute_limit_s"] = gpu["forward_s"] + gpu["backward_s"]
            run["compute_limit_from"] = "gpu_only's forward_s + backward_s in the same round"
        else:
            run["share_of_gpu_only"] = None
            run["share_of_gpu_only_note"] = f"not computed: {why_not}"
            n, first = run.get("micro_batches") or 1, run.get("first_forward_s")
            if n > 1 and first is not None:  # the first micro-batch's forward waits for the update: leave it out
                run["compute_limit_s"] = (run["forward_s"] - first) * n / (n - 1) + run["backward_s"]
                run["compute_limit_from"] = (f"this system's own backward_s + forward_s of micro-batches 2..{n} scaled to {n} "
                                             f"(the first waits for the last update; {why_not})")  # fmt: skip
            else:
                run["compute_limit_s"] = run["forward_s"] + run["backward_s"]
                run["compute_limit_from"] = f"this system's own forward_s + backward_s ({why_not})"
        run["iteration_over_compute_limit"] = run["iteration_s"] / run["compute_limit_s"] if run["compute_limit_s"] else None
        out[name] = run
    return out


def ratios(runs: dict) -> tuple[dict, dict]:
    values, basis = {}, {}
    for name, (peer, ours) in RATIOS.items():
        p, o = runs.get(peer), runs.get(ours)
        basis[name] = f"{peer}.iteration_s / {ours}.iteration_s"
        if p is None or o is None:
            values[name] = None
            basis[name] += f" (not computed: {peer if p is None else ours} was not selected)"
        elif "error" in p or "error" in o:
            values[name] = None
            basis[name] += f" (not computed: {peer if 'error' in p else ours} failed or was not run)"
        else:
            values[name] = p["iteration_s"] / o["iteration_s"]
    return values, basis


def median_round(rounds: list[dict]) -> dict:
    """Each system's run from its median round by iteration time (the lower middle of an even count),
    with every round's iteration time beside it; a system that failed in every round keeps its first
    error."""
    out = {}
    for name in (n for n in SYSTEMS if any(n in r for r in rounds)):
        tried = [(k, r[name]) for k, r in enumerate(rounds) if name in r]
        good = sorted(((k, run) for k, run in tried if "error" not in run), key=lambda kr: kr[1]["iteration_s"])
        k, run = good[(len(good) - 1) // 2] if good else tried[0]
        out[name] = {**run, "round": k}
        if len(rounds) > 1:
            out[name]["iteration_s_rounds"] = [run.get("iteration_s") for _, run in tried]
    return out


def round_ratios(rounds: list[dict]) -> tuple[dict, dict, dict]:
    """Each ratio as the median of the ratios taken within one round (the lower middle of an even
    count; None where no round has both sides), its basis, and every round's value."""
    per_round = [ratios(r) for r in rounds]
    values, basis, each = {}, dict(per_round[0][1]), {}
    for name in RATIOS:
        each[name] = [v[name] for v, _ in per_round]
        taken = sorted(x for x in each[name] if x is not None)
        values[name] = statistics.median_low(taken) if taken else None  # one round's ratio, as the rows are
        if len(rounds) > 1 and taken:  # else the first round's reason stands
            basis[name] = f"median over {len(rounds)} rounds of {RATIOS[name][0]}.iteration_s / {RATIOS[name][1]}.iteration_s, each within one round"
    return values, basis, each


def fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(runs: dict, ratio_values: dict, basis: dict, ratio_each: dict) -> None:
    head = (f"{'system':<22} {'mb':>3} {'iteration':>9} {'tokens/s':>10} {'share gpu_only':>14} {'x compute':>9} "
            f"{'exposed upd':>11} {'host GiB':>8} {'GPU GiB':>8}")  # fmt: skip
    print("\n" + head)
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:<22} {r.get('micro_batches', '-'):>3} error: {r['error']}")
            continue
        print(f"{name:<22} {r['micro_batches']:>3} {fmt(r['iteration_s']):>9} {fmt(r['tokens_per_s'], '.0f'):>10} "
              f"{fmt(r.get('share_of_gpu_only'), '.1%'):>14} {fmt(r.get('iteration_over_compute_limit'), '.2f'):>9} "
              f"{fmt(r['exposed_update_s']):>11} {fmt(r['host_peak_gib'], '.1f'):>8} {fmt(r['gpu_peak_gib'], '.1f'):>8}")  # fmt: skip
        if r.get("effective_io_gbps") is not None or r.get("raw_mixed_io_gbps") is not None:
            print(f"{'':<22}     I/O: effective {fmt(r['effective_io_gbps'], '.2f')} GB/s, raw disk before/after "
                  f"{fmt(r.get('raw_mixed_io_gbps'), '.2f')}/{fmt(r.get('raw_mixed_io_after_gbps'), '.2f')} GB/s, "
                  f"physical limit {fmt(r.get('physical_limit_s'))} s")  # fmt: skip
        if "shm_peak_gib" in r:
            print(f"{'':<22}     shm path: {fmt(r['shm_peak_gib'], '.1f')} GiB at most, host peak with it "
                  f"{fmt(r['host_peak_with_shm_gib'], '.1f')} GiB")  # fmt: skip
        if "iteration_s_rounds" in r:
            print(f"{'':<22}     rounds: {', '.join(fmt(x) for x in r['iteration_s_rounds'])} (the row is round {r['round']})")
    compute = next((r["compute_limit_from"] for r in runs.values() if "compute_limit_from" in r), None)
    if compute:
        print(f"x compute: iteration_s over the compute limit, {compute}")
    for name, v in ratio_values.items():
        if "not selected" in basis[name]:
            continue
        rounds = f"; rounds: {', '.join(fmt(x, '.2f') for x in ratio_each[name])}" if len(ratio_each[name]) > 1 else ""
        print(f"{name} = {fmt(v, '.2f')}  ({basis[name]}{rounds})")
