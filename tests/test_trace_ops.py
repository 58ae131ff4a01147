"""scripts/trace_ops.py on a hand-made trace: the ops directly inside each region, on its own thread,
are summed by name; ops nested in them, on other threads or outside every region are not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_trace_waits import write_trace

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_ops.py"


def op(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def test_the_ops_directly_inside_each_region_are_summed_by_name(tmp_path):
    region = "FSDP::post_backward_reduce"
    write_trace(tmp_path / "trace_step2_rank0.json", [
        op(f"{region} (layers.1)", 100, 1000, cat="user_annotation"),
        op("aten::linalg_vector_norm", 150, 200), op("aten::empty", 160, 20),  # nested in the norm: not its own
        op("aten::copy_", 400, 100), op("aten::linalg_vector_norm", 600, 300),
        op("aten::mm", 300, 50, tid=2),  # another thread
        op(f"{region} (layers.0)", 2000, 500, cat="user_annotation"), op("wrapper", 2000, 500),  # the region's span
        op("aten::copy_", 2100, 50),
        op("overruns", 2300, 400), op("aten::add_", 2350, 20),  # runs past the region; add_ is nested in it
        op("aten::copy_", 3000, 80),  # outside every region
    ])  # fmt: skip
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), "--step", "2", "--device-kind", "cpu-test", "--out", str(tmp_path / "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    [path] = (tmp_path / "out").glob("trace_ops_cpu-test_*.json")
    [rank0] = json.loads(path.read_text())["per_rank"]
    assert rank0["regions"] == 2 and rank0["region_ms"] == 1.5
    ops = {name: (o["count"], round(o["ms"], 6)) for name, o in rank0["ops"].items()}
    assert ops == {"aten::linalg_vector_norm": (2, 0.5), "aten::copy_": (2, 0.15)}
    assert list(rank0["ops"]) == ["aten::linalg_vector_norm", "aten::copy_"]  # the longest first
    assert round(rank0["ops_ms"], 6) == 0.65


def test_a_profiled_step_names_the_updates_phases():
    """What trace_ops --region reads in a real trace: the step's begin, its update, each subgroup's update
    inside it, and each subgroup's copy back into the model."""
    import torch

    from fsdp_offload import OffloadAdamW, OffloadConfig

    params = [torch.nn.Parameter(torch.randn(1000)) for _ in range(3)]
    opt = OffloadAdamW(params, lr=1e-3, offload=OffloadConfig(kernel="torch", subgroup_numel=1024))
    for p in params:
        p.grad = torch.randn_like(p)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    opt.close()
    names = [e.name for e in prof.events() if e.name.startswith("fsdp_offload.")]
    subgroups = len(opt.layout)
    assert subgroups == 3
    counts = {name: names.count(name) for name in set(names)}
    assert counts == {"fsdp_offload.step_begin": 1, "fsdp_offload.update": 1, "fsdp_offload.update_subgroup": subgroups,
                      "fsdp_offload.copy_back": subgroups}, counts  # fmt: skip
    [update] = [e for e in prof.events() if e.name == "fsdp_offload.update"]
    inner = [e for e in prof.events() if e.name == "fsdp_offload.update_subgroup"]
    assert all(update.time_range.start <= e.time_range.start and e.time_range.end <= update.time_range.end for e in inner)


def test_a_region_is_its_whole_name_not_a_prefix_of_another(tmp_path):
    """--region fsdp_offload.update takes that region alone, not fsdp_offload.update_subgroup inside it."""
    write_trace(tmp_path / "trace_step1_rank0.json", [
        op("fsdp_offload.update", 0, 1000, cat="user_annotation"),
        op("fsdp_offload.update_subgroup", 100, 600, cat="user_annotation"), op("aten::slice", 150, 10),
        op("fsdp_offload.copy_back", 800, 100, cat="user_annotation"),
    ])  # fmt: skip
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), "--step", "1", "--region", "fsdp_offload.update",
           "--device-kind", "cpu-test", "--out", str(tmp_path / "out")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    [path] = (tmp_path / "out").glob("trace_ops_cpu-test_*.json")
    [rank0] = json.loads(path.read_text())["per_rank"]
    assert rank0["regions"] == 1 and rank0["region_ms"] == 1.0
    assert set(rank0["ops"]) == {"fsdp_offload.update_subgroup", "fsdp_offload.copy_back"}


def test_a_wrong_region_step_or_dir_is_one_line_that_names_what_is_there(tmp_path):
    write_trace(tmp_path / "trace_step2_rank0.json", [
        op("fsdp_offload.update", 0, 1000, cat="user_annotation"), op("FSDP::post_backward_reduce (layers.0)", 0, 10, cat="user_annotation"),
    ])  # fmt: skip

    def run(path: Path, step: str, *more: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, str(SCRIPT), str(path), "--step", step, "--device-kind", "cpu-test", "--out", str(tmp_path / "out"), *more]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    out = run(tmp_path, "2", "--region", "fsdp_offload.updat")
    assert out.returncode != 0 and "its named regions: FSDP::post_backward_reduce, fsdp_offload.update" in out.stderr, out.stderr
    out = run(tmp_path, "3")
    assert out.returncode != 0 and "(it holds step(s) [2])" in out.stderr, out.stderr
    out = run(tmp_path / "trace_step2_rank0.json", "2")
    assert out.returncode != 0 and "is not a dir: give the run dir" in out.stderr, out.stderr
