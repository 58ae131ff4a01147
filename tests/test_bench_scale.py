"""scripts/bench_scale.py: a case the planner cannot plan is a row with its error; the other cases still run."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from fsdp_offload.units import format_seconds

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_scale.py"


def load_bench_scale():
    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_case_whose_tier_dir_is_missing_is_a_row_with_the_error(tmp_path):
    bench_scale = load_bench_scale()
    missing = tmp_path / "no-such-dir"
    case = (f"model=tiny offload=disk offload.tiers=[posix:{missing}] offload.host_budget_gb=0.001 train.device=cpu "
            "machine.cpu_mparams_per_s=1000")  # fmt: skip
    args = argparse.Namespace(nproc=1, log_dir=str(tmp_path / "logs"), steps=1, timeout=60)
    row = bench_scale.run_case(case, args, 0)
    assert row["error"].startswith("plan: ") and str(missing) in row["error"] and "does not exist" in row["error"], row


def test_a_row_puts_the_kernel_time_inside_the_step_beside_the_planners_cpu_time(tmp_path):
    """The planner's CPU rate predicts the kernel alone: the row carries the slowest rank's time in the
    CPU kernel, within its update, and the prediction's ratio to it; and the fixed costs predicted beside it."""
    bench_scale = load_bench_scale()
    case = "model=tiny offload=host train.device=cpu offload.subgroup_numel=1048576"
    args = argparse.Namespace(nproc=1, log_dir=str(tmp_path / "logs"), steps=3, timeout=120)
    row = bench_scale.run_case(case, args, 0)
    assert "error" not in row, row
    assert 0 < row["cpu_kernel_s"] < row["update_s"], row
    assert row["predicted_cpu_over_kernel"] == row["predicted_cpu_s"] / row["cpu_kernel_s"]
    # the update's fixed costs as predicted, beside the norm the run took; the median step's beside the mean
    assert row["predicted_walk_s"] >= 0 and row["predicted_step_s"] >= 0 and row["norm_s"] >= 0
    assert row["predicted_over_median"] == row["predicted_update_s"] / row["update_s_median"]
    assert "control" not in row and f"{row['predicted_over_measured']:9.2f}" in bench_scale.table_line(row)


def test_a_plain_fsdp2_case_is_the_control_with_no_plan(tmp_path):
    """offload=none (torch's AdamW on the device): nothing is planned or predicted; the row holds the step's times,
    peaks and losses beside the planned cases'."""
    bench_scale = load_bench_scale()
    args = argparse.Namespace(nproc=1, log_dir=str(tmp_path / "logs"), steps=2, timeout=120)
    row = bench_scale.run_case("model=tiny offload=none train.device=cpu", args, 0)
    assert "error" not in row, row
    assert "predicted_update_s" not in row and "placement_equal" not in row and "cpu_kernel_s" not in row, row
    assert row["control"] is True and row["model"] == "tiny" and row["world_size"] == 1 and row["params_billion"] > 0, row
    assert row["iteration_s"] > 0 and row["iteration_s_median"] > 0 and row["backward_s"] > 0 and len(row["losses"]) == 2, row
    assert row["reshard_after_forward"] in (True, False), row
    line = bench_scale.table_line(row)  # the printed table names it where a plan's figures would be
    assert line[58:].split()[:5] == ["control", *format_seconds(row["update_s"]).split(), "control", "-"], line
