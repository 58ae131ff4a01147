"""scripts/bench_peers.py on CPU with the tiny model: GPU-only (train.py offload=none) and this product's
host and disk runs through scripts/train.py, the FSDP2 CPUOffloadPolicy peer, and the DeepSpeed peers,
which cannot run here (no DeepSpeed, no CUDA) and must say why in the JSON and the table instead of
vanishing; every system accumulating 2 micro-batches, on one rank and under torchrun on two (gloo).
The comparisons across systems and rounds are checked on made-up rows. No speed is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_peers.py"
sys.path.insert(0, str(SCRIPT.parent))

from bench_peers_launch import DirPeak, failure_reason  # noqa: E402
from bench_peers_report import against_gpu_only, median_round, round_ratios, turn  # noqa: E402

ROW_KEYS = {  # issue #33's result keys, on every system that ran
    "command", "device", "commit", "system", "micro_batches", "iteration_s", "forward_s", "backward_s", "exposed_update_s",
    "tokens_per_s", "share_of_gpu_only", "compute_limit_s", "compute_limit_from", "model_tflops", "first_steps_s",
    "gpu_peak_gib", "host_peak_gib", "grad_accumulation",
}  # fmt: skip
IO_KEYS = {"effective_io_gbps", "raw_mixed_io_gbps", "physical_limit_s", "update_s"}
POSITIVE = ("iteration_s", "forward_s", "backward_s", "update_s", "exposed_update_s", "host_peak_gib", "tokens_per_s",
            "compute_limit_s", "model_tflops")  # fmt: skip


def bench(tmp_path: Path, *flags: str) -> tuple[dict, str]:
    """Runs the bench on the tiny model on CPU; returns its JSON and its stdout."""
    cmd = [
        sys.executable, str(SCRIPT), "--model", "tiny", "--seq", "64", "--device", "cpu", "--micro-batches", "2",
        "--tier-dir", str(tmp_path / "tier"), "--device-kind", "cpu-test", "--out", str(tmp_path / "out"),
        "--log-dir", str(tmp_path / "logs"), "--train-override", "++offload.kernel=torch", *flags,  # torch kernel: no C++ build
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [path] = (tmp_path / "out").glob("bench_peers_cpu-test_*.json")
    return json.loads(path.read_text()), out.stdout


def check_row(run: dict, steps: int, ranks: int, gpu_only: dict | None) -> None:
    """Issue #33's keys with sane values; share and compute limit against `gpu_only`'s row if it ran."""
    assert "error" not in run, run
    assert ROW_KEYS | IO_KEYS <= set(run), (ROW_KEYS | IO_KEYS) - set(run)
    assert all(run[k] > 0 for k in POSITIVE), {k: run[k] for k in POSITIVE}
    assert run["micro_batches"] == 2 and run["device"] == "cpu-test" and run["commit"]
    assert len(run["step_s_all"]) == steps and run["first_steps_s"] == run["step_s_all"][:2]
    assert run["tokens_per_step"] == ranks * 2 * 64
    assert run["tokens_per_s"] == run["tokens_per_step"] / run["iteration_s"]
    assert len(run["host_peak_gib_per_rank"]) == ranks and run["host_peak_gib"] == sum(run["host_peak_gib_per_rank"])
    assert run["gpu_peak_gib"] is None  # no GPU here
    if gpu_only is None:  # no share, and the system's own forward + backward as its compute limit
        assert run["share_of_gpu_only"] is None and "not selected" in run["share_of_gpu_only_note"]
        assert "own" in run["compute_limit_from"]
        if "first_forward_s" in run:  # this product at 2 micro-batches: the second forward stands for both
            assert run["compute_limit_s"] == pytest.approx((run["forward_s"] - run["first_forward_s"]) * 2 + run["backward_s"])
        else:
            assert run["compute_limit_s"] == run["forward_s"] + run["backward_s"]
    else:
        assert run["share_of_gpu_only"] == run["tokens_per_s"] / gpu_only["tokens_per_s"] > 0
        assert run["compute_limit_s"] == gpu_only["forward_s"] + gpu_only["backward_s"]
    assert run["iteration_over_compute_limit"] == run["iteration_s"] / run["compute_limit_s"]
    assert run["exposed_update_note"]


def test_tiny_model_on_cpu_reports_every_system(tmp_path):
    systems = ("host", "disk", "multipath_gpu0", "fsdp_cpu_offload_clip", "zero_infinity", "zero_offload")  # gpu_only: see the next test
    (tmp_path / "shm").mkdir()
    result, stdout = bench(
        tmp_path, "--steps", "3", "--systems", ",".join(systems), "--raw-io-gib", "0.0625", "--raw-io-samples", "1",
        "--shm-dir", str(tmp_path / "shm"),
        # a host cache of a few 16Ki-param subgroups, so the tiny model's state really streams through the disk
        "--host-budget-gb", "0.0018", "--train-override", "++offload.subgroup_numel=16384",
    )  # fmt: skip
    assert {"command", "device", "commit", "model"} <= set(result)
    assert result["device"] == "cpu-test" and result["model"]["preset"] == "tiny" and result["model"]["micro_batches"] == 2
    runs = result["runs"]
    assert set(runs) == set(systems)

    for name in ("host", "disk"):  # through scripts/train.py
        check_row(runs[name], steps=3, ranks=1, gpu_only=None)
        assert runs[name]["steps_averaged"] == [2, 3]
        assert runs[name]["grad_accumulation"] == "host", runs[name]["grad_accumulation_from"]  # on CPU: the host
        assert runs[name]["grad_path"] == "host_bf16"  # "auto" on CPU
    disk = runs["disk"]
    assert disk["effective_io_gbps"] > 0 and disk["disk_bytes_per_step"] > 0
    assert disk["raw_mixed_io_gbps"] == disk["raw_io"]["mixed_gbps"] > 0
    assert disk["physical_limit_s"] > 0
    assert disk["raw_mixed_io_after_gbps"] == disk["raw_io_after"]["mixed_gbps"] > 0  # measured again after it ran
    assert disk["physical_limit_after_s"] == disk["disk_bytes_per_step"] / (disk["raw_mixed_io_after_gbps"] * 1e9)
    assert runs["host"]["physical_limit_s"] is None  # nothing of it goes through the disk
    multipath = runs["multipath_gpu0"]  # its state on the tier dir and the shm dir: the RAM the second one held is counted
    check_row(multipath, steps=3, ranks=1, gpu_only=None)
    assert multipath["shm_peak_gib"] >= 0 and multipath["physical_limit_note"]  # (sampled: DirPeak's own test below)
    assert multipath["host_peak_with_shm_gib"] == multipath["host_peak_gib"] + multipath["shm_peak_gib"]
    assert "shm path:" in stdout and "shm_peak_gib" not in disk

    fsdp = runs["fsdp_cpu_offload_clip"]
    if "error" in fsdp:  # CPUOffloadPolicy refused on CPU/gloo: the reason must be there
        assert fsdp["error"].strip()
        assert result["ratio_vs_fsdp_cpu_offload_clip"] is None
    else:
        check_row(fsdp, steps=3, ranks=1, gpu_only=None)
        assert fsdp["grad_accumulation"] is None
        assert abs(fsdp["loss_first"] - runs["host"]["loss_first"]) < 0.05
        assert result["ratio_vs_fsdp_cpu_offload_clip"] == fsdp["iteration_s"] / runs["host"]["iteration_s"]

    for name in ("zero_infinity", "zero_offload"):  # no DeepSpeed (or no CUDA) here: a reason, not a gap
        reason = runs[name]["error"]
        assert "deepspeed" in reason.lower() or "cuda" in reason.lower(), reason
        assert f"{name:<22}   2 error: " in stdout
    assert result["ratio_vs_zero_infinity"] is None and "zero_infinity failed" in result["ratios_basis"]["ratio_vs_zero_infinity"]
    assert result["ratio_vs_fsdp_cpu_offload"] is None  # neither side was selected
    assert (tmp_path / "logs").is_dir() and all(Path(r["log"]).is_file() for r in runs.values())
    assert not list((tmp_path / "tier").iterdir()) and not list((tmp_path / "shm").iterdir())  # every system's tier files are gone
    table = stdout[stdout.index("\nsystem ") :]  # the table comes last
    assert all(word in table.splitlines()[1] for word in ("mb", "iteration", "tokens/s", "share gpu_only", "x compute", "host GiB"))


def test_two_ranks_under_torchrun(tmp_path):
    result, stdout = bench(tmp_path, "--nproc", "2", "--steps", "2", "--systems", "gpu_only,host,zero_offload", "--raw-io-gib", "0")
    runs = result["runs"]
    assert result["model"]["nproc"] == 2 and result["model"]["tokens_per_step"] == 2 * 2 * 64
    gpu = runs["gpu_only"]
    for name in ("gpu_only", "host"):
        check_row(runs[name], steps=2, ranks=2, gpu_only=gpu)
        assert "torch.distributed.run" in runs[name]["command"] and "--nproc-per-node=2" in runs[name]["command"]
    assert gpu["share_of_gpu_only"] == 1.0 and gpu["grad_accumulation"] is None
    assert runs["host"]["grad_accumulation"] == "host"
    assert abs(runs["host"]["loss_first"] - gpu["loss_first"]) < 0.05  # the same model and tokens
    assert "share gpu_only" in stdout[stdout.index("\nsystem ") :]
    assert "deepspeed" in runs["zero_offload"]["error"].lower()


def ran(iteration_s: float, forward_s: float = 0.1, backward_s: float = 0.2) -> dict:
    return {"iteration_s": iteration_s, "forward_s": forward_s, "backward_s": backward_s, "tokens_per_s": 100 / iteration_s}


def test_share_and_compute_limit_are_taken_within_a_round():
    got = against_gpu_only({"gpu_only": ran(0.5, 0.1, 0.3), "host": ran(1.0), "zero_offload": {"error": "no deepspeed"}})
    assert got["host"]["share_of_gpu_only"] == 0.5 and got["gpu_only"]["share_of_gpu_only"] == 1.0
    assert got["host"]["compute_limit_s"] == 0.1 + 0.3 and got["host"]["iteration_over_compute_limit"] == 1.0 / 0.4
    assert got["zero_offload"] == {"error": "no deepspeed"}
    for runs, why in (({"host": ran(1.0)}, "not selected"), ({"gpu_only": {"error": "OOM"}, "host": ran(1.0)}, "gpu_only failed")):
        host = against_gpu_only(runs)["host"]  # no GPU-only figure: no share, the system's own forward+backward
        assert host["share_of_gpu_only"] is None and why in host["share_of_gpu_only_note"]
        assert host["compute_limit_s"] == 0.1 + 0.2 and "own" in host["compute_limit_from"] and why in host["compute_limit_from"]


def test_rounds_take_turns_and_report_medians():
    assert turn(["a", "b", "c"], 0) == ["a", "b", "c"] and turn(["a", "b", "c"], 1) == ["c", "b", "a"]
    rounds = [
        {"host_noclip": ran(1.0), "fsdp_cpu_offload": ran(3.0)},
        {"host_noclip": ran(2.0), "fsdp_cpu_offload": ran(2.0)},
        {"host_noclip": ran(1.5), "fsdp_cpu_offload": {"error": "refused"}},
    ]
    runs = median_round(rounds)
    assert runs["host_noclip"] == {**rounds[2]["host_noclip"], "round": 2, "iteration_s_rounds": [1.0, 2.0, 1.5]}
    assert runs["fsdp_cpu_offload"]["round"] == 1  # the lower middle (the faster) of the two rounds it ran
    values, basis, each = round_ratios(rounds)
    assert each["ratio_vs_fsdp_cpu_offload"] == [3.0, 1.0, None]
    assert values["ratio_vs_fsdp_cpu_offload"] == 1.0  # the median of ratios taken within one round
    assert "median over 3 rounds" in basis["ratio_vs_fsdp_cpu_offload"]
    assert values["ratio_vs_zero_infinity"] is None and "not selected" in basis["ratio_vs_zero_infinity"]


def test_failure_reason_is_the_ranks_not_torchruns(tmp_path):
    log = tmp_path / "system.log"
    log.write_text(
        "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 1, in <module>\n"
        "[rank1]: RuntimeError: No backend type associated with device type cpu\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "============================================================\nscripts/bench_peers.py FAILED\n"
        "  error_file: <N/A>\n============================================================\n"
    )  # fmt: skip
    assert failure_reason(str(log)) == "RuntimeError: No backend type associated with device type cpu"
    log.write_text("BENCH_ERROR: import deepspeed failed\n" + log.read_text())
    assert failure_reason(str(log)) == "import deepspeed failed"


def test_the_shm_path_s_peak_counts_the_ranks_tier_files_alone(tmp_path):
    """What a multipath run's state holds on the shm path: the ranks' tier files, not the start-up
    measurement's file, sampled from the block's start (so a file there then is always seen)."""
    private = tmp_path / "fsdp-offload-0"
    private.mkdir()
    (private / "rank0-host-pid1-0123abcd.subgroups").write_bytes(b"x" * 65536)
    (private / "calibrate-host-pid1-0123abcd.subgroups").write_bytes(b"x" * 1048576)
    with DirPeak(str(tmp_path)) as peak:
        pass
    assert peak.peak_bytes == (private / "rank0-host-pid1-0123abcd.subgroups").stat().st_blocks * 512 >= 65536
    with DirPeak(None) as none:  # no shm path (not a multipath run): nothing sampled
        pass
    assert none.peak_bytes == 0
