"""The planner's prediction beside the run: for each case (train.py overrides), plans it
(fsdp_offload.plan, on this machine), trains it for a few steps with train.py (torchrun when
--nproc > 1), and records the predicted and built placement, the predicted and measured update time,
the start-up and training GPU peaks, the host peak and the bytes on each tier.

    python scripts/bench_scale.py --device-kind nvidia-h100-x1 --steps 4 \\
        --case "model=1b offload=host" --case "model=7b offload=disk offload.host_budget_gb=64"

One JSON under --out with a row per case (result keys: command, device, commit, model,
params_billion, world_size, gpu_peak_gib, gpu_peak_startup_gib, host_peak_gib, tier_bytes, update_s,
predicted_update_s, iteration_s; cpu_kernel_s, the slowest rank's time in the CPU kernel, beside
predicted_cpu_s, and predicted_cpu_over_kernel; cpu_rate_source, where the planner's CPU rate came from:
"timed" before the case, or "learned" where offload.bandwidth_profile holds an earlier run's on this
host for the same ranks and threads; cpu_rate_detail, the plan's note on that rate (for a timed one, where other
processes or the hypervisor took the node's CPUs while it was timed); the update's fixed costs as predicted, predicted_walk_s and
predicted_step_s, beside the slowest rank's norm_s; update_s_median and predicted_over_median, the
median step's, which a shared machine's bursts move less than the mean, and iteration_s_median likewise; activation_checkpointing,
reshard_after_forward and sum_grads_unsharded, as the run resolved them, beside planned_activation_checkpointing,
planned_reshard_after_forward and planned_sum_grads_unsharded, as the plan here did), the logs under --log-dir.
Steps after the first are averaged. A case with offload=none (plain FSDP2, torch's AdamW on the device) is the
control beside them (`control`: true): nothing planned or predicted, its row the model, the step's times, peaks and
losses.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fsdp_offload.models import num_params, preset_name
from fsdp_offload.plans import PlanError
from fsdp_offload.plan import compose_plan_config, plan_from_config
from fsdp_offload.recipe import read_config
from fsdp_offload.results import record
from fsdp_offload.storage.base import TierError
from fsdp_offload.units import format_seconds

TRAIN = str(Path(__file__).resolve().parent / "train.py")


def run_case(case: str, args: argparse.Namespace, index: int) -> dict:
    overrides = shlex.split(case)
    nproc = args.nproc
    if overrides and overrides[0].startswith("nproc="):  # this case's own rank count
        nproc = int(overrides.pop(0).split("=", 1)[1])
    row: dict = {"case": case, "nproc": nproc}
    t0 = time.perf_counter()
    try:  # a case the planner or the config refuses is a row with its error; the other cases still run
        cfg, machine = compose_plan_config(overrides + [f"machine.ranks_per_node={nproc}"])
        _, margs, _, recipe, _ = read_config(cfg)
        control = recipe.optimizer != "offload"  # plain FSDP2 (offload=none): the control, nothing to plan
        plan = None if control else plan_from_config(cfg, machine)[0]
    except (PlanError, ValueError, TierError) as exc:  # TierError: a tier's dir is missing or unusable
        row["error"] = f"plan: {exc}"
        return row
    row["plan_s"] = time.perf_counter() - t0
    mine = None if plan is None else plan.ranks[0]
    if plan is None:
        row.update(control=True, model=preset_name(margs), params_billion=num_params(margs) / 1e9, world_size=nproc)
    else:
        row.update(model=plan.model, params_billion=plan.params / 1e9, world_size=plan.world_size,
                   predicted_update_s=plan.predicted_update_s, predicted_io_s=mine.io_s, predicted_cpu_s=mine.cpu_s,
                   predicted_walk_s=mine.walk_s, predicted_step_s=mine.step_s,
                   predicted_gpu_startup_gib=mine.gpu_startup_bytes / 2**30, predicted_gpu_train_gib=mine.gpu_train_bytes / 2**30,
                   planned=dataclasses.asdict(mine), cpu_mparams_per_s=plan.cpu_mparams_per_s, cpu_rate_source=plan.cpu_rate_source,
                   cpu_rate_detail=plan.cpu_rate_detail, split_cpu_mparams_per_s=plan.split_cpu_mparams_per_s,
                   split_cpu_rate_source=plan.split_cpu_rate_source)  # fmt: skip
    out_dir = os.path.join(args.log_dir, f"case{index}")
    os.makedirs(out_dir, exist_ok=True)
    launch = [sys.executable, TRAIN] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), TRAIN]  # fmt: skip
    cmd = launch + overrides + [f"train.steps={args.steps}", f"train.out_dir={out_dir}", "train.progress=false",
                                f"hydra.run.dir={out_dir}/hydra"]  # fmt: skip
    row["train_command"] = " ".join(cmd[1:])
    t0 = time.perf_counter()
    with open(os.path.join(out_dir, "train.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, check=False).returncode
    row["wall_s"] = time.perf_counter() - t0
    if rc != 0:
        tail = Path(out_dir, "train.log").read_text().strip().splitlines()[-3:]
        row["error"] = f"train.py exited {rc}: " + " | ".join(tail)
        return row
    rows = [json.loads(line) for line in Path(out_dir, "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    mean = lambda key: statistics.fmean(r[key] for r in steady)  # noqa: E731
    # A step's update is its slowest rank's (with exclusive access the ranks take the disk in turns).
    per_rank = [rows] + [[json.loads(line) for line in Path(out_dir, f"rank{r}.metrics.jsonl").read_text().splitlines()]
                         for r in range(1, nproc)]  # fmt: skip

    def slowest(key: str, average=statistics.fmean) -> float:  # a step's value is its slowest rank's
        return average([max(rank[i][key] for rank in per_rank) for i in range(1, len(rows))] or [0])

    slowest_update = slowest("update_s")
    placement = json.loads(Path(out_dir, "placement.json").read_text())
    row.update(iteration_s=mean("step_s"), iteration_s_median=statistics.median(r["step_s"] for r in steady),
               update_s=slowest_update, exposed_update_s=mean("exposed_update_s"),
               forward_s=mean("forward_s"), backward_s=mean("backward_s"),
               gpu_peak_gib=max(r.get("gpu_peak_gib", 0.0) for r in rows), host_peak_gib=max(r["host_peak_gib"] for r in rows),
               gpu_peak_startup_gib=placement.get("gpu_peak_startup_gib"), startup_s=placement["startup_s"],
               activation_checkpointing=placement.get("activation_checkpointing"),  # as the run resolved it
               reshard_after_forward=placement.get("reshard_after_forward"),
               sum_grads_unsharded=placement.get("sum_grads_unsharded"),
               update_s_median=slowest("update_s", statistics.median), losses=[r["loss"] for r in rows])  # fmt: skip
    if mine is None:  # torch's AdamW on the device: no placement, tiers or CPU kernel to set beside a plan
        return row
    built = placement["built"]
    row.update(effective_io_gbps=mean("effective_io_gbps"), subgroups_on_gpu=rows[-1]["subgroups_on_gpu"], built=built,
               planned_activation_checkpointing=plan.activation_checkpointing,  # as this plan did (its budget may differ)
               planned_reshard_after_forward=plan.reshard_after_forward, planned_sum_grads_unsharded=plan.sum_grads_unsharded,
               tier_bytes={t.spec: t.bytes for t in mine.tiers},
               bytes_read_per_step=statistics.fmean(sum(r["bytes_read"].values()) for r in steady),
               bytes_written_per_step=statistics.fmean(sum(r["bytes_written"].values()) for r in steady))  # fmt: skip
    row["placement_equal"] = (built["gpu_subgroups"] == mine.gpu_subgroups and built["cache_slots"] == mine.cache_slots
                              and list(built["tier_subgroups"].values()) == [t.subgroups for t in mine.tiers])  # fmt: skip
    row["norm_s"] = slowest("norm_s")
    if plan.predicted_update_s:
        row["predicted_over_measured"] = plan.predicted_update_s / row["update_s"]
        row["predicted_over_median"] = plan.predicted_update_s / row["update_s_median"]
    # the part of the update the planner's CPU rate predicts, timed inside the step: the kernel alone
    row["cpu_kernel_s"] = slowest("cpu_kernel_s")
    if mine.cpu_s and row["cpu_kernel_s"]:
        row["predicted_cpu_over_kernel"] = mine.cpu_s / row["cpu_kernel_s"]
    return row


def table_line(r: dict) -> str:
    """A row of the table printed at the end; a control (offload=none) says so where a plan's figures would be."""
    if "error" in r:
        return f"{r['case'][:58]:58} error: {r['error'][:300]}"
    if r.get("control"):
        pred = ratios = "control"
        placed = "-"
    else:
        pred = format_seconds(r["predicted_update_s"] or float("nan"))
        ratios = f"{r.get('predicted_over_measured') or float('nan'):9.2f} {r.get('predicted_over_median') or float('nan'):8.2f}"
        placed = "equal" if r["placement_equal"] else "differs"
    return (f"{r['case'][:58]:58} {pred:>8} {format_seconds(r['update_s']):>8} {ratios:>18} {placed:>9} "
            f"{r['gpu_peak_startup_gib'] or 0:9.1f}/{r['gpu_peak_gib']:<9.1f} {r['host_peak_gib']:8.1f} {format_seconds(r['iteration_s']):>8}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", required=True,
                    help="train.py overrides, one run (repeat for more); a leading nproc=N sets its rank count")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=1, help="ranks on this node (torchrun when > 1)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per training run")
    ap.add_argument("--device-kind", required=True)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--log-dir", default="benchmarks/logs/bench_scale")
    args = ap.parse_args()
    omp_env = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}  # the runs inherit them
    rows: list[dict] = []
    path = None
    for i, case in enumerate(args.case):  # recorded after each case: a call cut short keeps the cases it finished
        rows.append(run_case(case, args, i))
        reference, r = rows[0].get("losses"), rows[-1]
        alike = r.get("control") == rows[0].get("control")  # a control's optimizer is torch's: its losses differ by more
        if i and alike and reference and r.get("losses") and len(r["losses"]) == len(reference):
            # the same data and global batch on another layout: equal losses up to reduction order
            r["loss_max_abs_diff_vs_case0"] = max(abs(a - b) for a, b in zip(r["losses"], reference))
        path = record("bench_scale", args.device_kind, args.out,
                      {"steps": args.steps, "nproc": args.nproc, "env": omp_env, "runs": rows}, path=path)  # fmt: skip
    print(f"{'case':58} {'pred':>8} {'update':>8} {'pred/meas':>9} {'pred/med':>8} {'placement':>9} {'GPU start/train GiB':>19} "
          f"{'host GiB':>8} {'iter':>8}")  # fmt: skip
    for r in rows:
        print(table_line(r))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
