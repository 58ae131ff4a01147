"""scripts/bench_peers.py end to end on CPU with the tiny model: this product's host and disk runs
through scripts/train.py, the FSDP2 CPUOffloadPolicy peer, and the DeepSpeed peers, which cannot run
here (no DeepSpeed, no CUDA) and must say why in the JSON and the table instead of vanishing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_peers.py"
RUN_KEYS = {
    "iteration_s", "forward_s", "backward_s", "update_s", "exposed_update_s", "host_peak_gib", "gpu_peak_gib",
    "effective_io_gbps", "raw_mixed_io_gbps", "physical_limit_s",
}  # fmt: skip
TIMINGS = ("iteration_s", "forward_s", "backward_s", "update_s", "exposed_update_s", "host_peak_gib")
RATIOS = ("ratio_vs_fsdp_cpu_offload_clip", "ratio_vs_fsdp_cpu_offload", "ratio_vs_zero_infinity")
SYSTEMS = ("host", "disk", "fsdp_cpu_offload_clip", "zero_infinity", "zero_offload")


def test_tiny_model_on_cpu_reports_every_system(tmp_path):
    cmd = [
        sys.executable, str(SCRIPT), "--model", "tiny", "--seq", "64", "--device", "cpu", "--steps", "3",
        "--systems", ",".join(SYSTEMS), "--tier-dir", str(tmp_path / "tier"), "--device-kind", "cpu-test",
        "--raw-io-gib", "0.0625", "--raw-io-samples", "1", "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs"),
        # a host cache of a few 16Ki-param subgroups, so the tiny model's state really streams through the disk;
        # the pure-torch kernel, so no C++ build
        "--host-budget-gb", "0.0012", "--train-override", "++offload.subgroup_numel=16384", "--train-override", "++offload.kernel=torch",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [path] = (tmp_path / "out").glob("bench_peers_cpu-test_*.json")
    result = json.loads(path.read_text())
    assert {"command", "device", "commit", "model"} <= set(result)
    assert result["device"] == "cpu-test" and result["model"]["preset"] == "tiny"
    runs = result["runs"]
    assert set(runs) == set(SYSTEMS)

    for name in ("host", "disk"):  # this product, through scripts/train.py
        run = runs[name]
        assert "error" not in run, run
        assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
        assert all(run[k] > 0 for k in TIMINGS), {k: run[k] for k in TIMINGS}
        assert run["steps_averaged"] == [2, 3]
        assert run["exposed_update_note"]
    disk = runs["disk"]
    assert disk["effective_io_gbps"] > 0 and disk["disk_bytes_per_step"] > 0
    assert disk["raw_mixed_io_gbps"] == disk["raw_io"]["mixed_gbps"] > 0
    assert disk["physical_limit_s"] > 0
    assert disk["raw_mixed_io_after_gbps"] == disk["raw_io_after"]["mixed_gbps"] > 0  # measured again after it ran
    assert disk["physical_limit_after_s"] == disk["disk_bytes_per_step"] / (disk["raw_mixed_io_after_gbps"] * 1e9)
    assert runs["host"]["physical_limit_s"] is None  # nothing of it goes through the disk

    fsdp = runs["fsdp_cpu_offload_clip"]
    if "error" in fsdp:  # CPUOffloadPolicy refused on CPU/gloo: the reason must be there
        assert fsdp["error"].strip()
        assert result["ratio_vs_fsdp_cpu_offload_clip"] is None
    else:
        assert RUN_KEYS <= set(fsdp) and all(fsdp[k] > 0 for k in TIMINGS)
        assert fsdp["loss_first"] == runs["host"]["loss_first"] or abs(fsdp["loss_first"] - runs["host"]["loss_first"]) < 0.05
        assert result["ratio_vs_fsdp_cpu_offload_clip"] == fsdp["iteration_s"] / runs["host"]["iteration_s"]

    for name in ("zero_infinity", "zero_offload"):  # no DeepSpeed (or no CUDA) here: a reason, not a gap
        reason = runs[name]["error"]
        assert "deepspeed" in reason.lower() or "cuda" in reason.lower(), reason
        assert f"{name:<22} error: " in out.stdout
    assert set(RATIOS) <= set(result)
    assert result["ratio_vs_zero_infinity"] is None and "zero_infinity failed" in result["ratios_basis"]["ratio_vs_zero_infinity"]
    assert result["ratio_vs_fsdp_cpu_offload"] is None  # neither side was selected
    assert (tmp_path / "logs").is_dir() and all(Path(r["log"]).is_file() for r in runs.values())
    assert not list((tmp_path / "tier").iterdir())  # every system's tier files are gone


def test_rounds_take_turns_and_report_medians(tmp_path):
    cmd = [
        sys.executable, str(SCRIPT), "--model", "tiny", "--seq", "64", "--device", "cpu", "--steps", "3", "--rounds", "3",
        "--systems", "host_noclip,fsdp_cpu_offload", "--tier-dir", str(tmp_path / "tier"), "--device-kind", "cpu-test",
        "--raw-io-gib", "0", "--out", str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs"),
        "--train-override", "++offload.kernel=torch",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [path] = (tmp_path / "out").glob("bench_peers_cpu-test_*.json")
    result = json.loads(path.read_text())
    assert result["rounds"] == 3 and len(result["round_runs"]) == 3
    # each round in the opposite order of the one before, its logs in a dir of its own
    started = [line.split()[1].rstrip(":") for line in out.stdout.splitlines() if line.startswith("== ")]
    assert started == ["host_noclip", "fsdp_cpu_offload", "fsdp_cpu_offload", "host_noclip", "host_noclip", "fsdp_cpu_offload"]
    assert all((tmp_path / "logs").glob(f"bench_peers_*/round{k}/host_noclip.log") for k in range(3))
    for name, run in result["runs"].items():  # the row is the median round, every round's time beside it
        times = [r[name]["iteration_s"] for r in result["round_runs"]]
        assert run["iteration_s_rounds"] == times
        assert run["iteration_s"] == sorted(times)[1] == times[run["round"]]
        assert run == {**result["round_runs"][run["round"]][name], "round": run["round"], "iteration_s_rounds": times}
    each = result["ratio_rounds"]["ratio_vs_fsdp_cpu_offload"]
    if "error" in result["runs"]["fsdp_cpu_offload"]:  # CPUOffloadPolicy refused on CPU/gloo: no ratio, said why
        assert result["ratio_vs_fsdp_cpu_offload"] is None and "failed" in result["ratios_basis"]["ratio_vs_fsdp_cpu_offload"]
    else:  # the median of the ratios taken within one round, not a ratio of medians
        rounds = result["round_runs"]
        assert each == [r["fsdp_cpu_offload"]["iteration_s"] / r["host_noclip"]["iteration_s"] for r in rounds]
        assert result["ratio_vs_fsdp_cpu_offload"] == sorted(each)[1]
        assert "median over 3 rounds" in result["ratios_basis"]["ratio_vs_fsdp_cpu_offload"]
    assert "not selected" in result["ratios_basis"]["ratio_vs_zero_infinity"]
