"""scripts/trace_waits.py on two ranks' hand-made traces: each collective's transfer starts when its
last rank does, and the time before that is the other ranks' wait."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_waits.py"


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def write_trace(path: Path, events: list[dict], base_ns: int = 0) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        json.dump({"baseTimeNanoseconds": base_ns, "traceEvents": events + [{"ph": "i", "name": "marker", "ts": 0}]}, f)


def test_transfer_begins_at_the_last_start_and_the_earlier_ranks_wait(tmp_path):
    # rank 0 starts both collectives first; rank 1 is 5 ms late to the first and 2 ms late to the second
    write_trace(tmp_path / "trace_step3_rank0.json", [
        kernel("ncclDevKernel_AllGather_RING_LL(x)", 1000, 5300), kernel("gemm", 6400, 700),
        kernel("ncclDevKernel_ReduceScatter_Sum_bf16(x)", 8000, 2400)])  # fmt: skip
    write_trace(tmp_path / "trace_step3_rank1.json.gz", [  # its clock's base 1 ms later: the same moments
        kernel("ncclDevKernel_AllGather_RING_LL(x)", 5000, 300), kernel("gemm", 5400, 900),
        kernel("ncclDevKernel_ReduceScatter_Sum_bf16(x)", 9000, 400)], base_ns=1_000_000)  # fmt: skip
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), "--step", "3", "--device-kind", "cpu-test", "--out", str(tmp_path / "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    [path] = (tmp_path / "out").glob("trace_waits_cpu-test_*.json")
    result = json.loads(path.read_text())
    assert result["ranks"] == 2 and result["step"] == 3
    first, second = result["collectives"]
    assert first["name"] == "ncclDevKernel_AllGather_RING_LL" and first["last_rank"] == 1
    assert first["transfer_ms"] == 0.3 and second["transfer_ms"] == 0.4
    assert first["start_ms"] == [0.0, 5.0]
    assert [r["waited_ms"] for r in result["per_rank"]] == [7.0, 0.0]
    assert [r["last_in"] for r in result["per_rank"]] == [0, 2]
    assert [r["compute_kernels_ms"] for r in result["per_rank"]] == [0.7, 0.9]
    assert result["wait_ms_mean"] == 3.5


def test_traces_of_different_steps_or_runs_are_refused(tmp_path):
    write_trace(tmp_path / "trace_step0_rank0.json", [kernel("ncclDevKernel_AllGather(x)", 0, 10)])
    write_trace(tmp_path / "trace_step0_rank1.json", [])
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--step", "0", "--device-kind", "cpu-test",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "different numbers of collectives ([0, 1])" in out.stderr
    missing = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--step", "5", "--device-kind", "cpu-test"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert missing.returncode != 0 and "train.profile_step=5" in missing.stderr
    write_trace(tmp_path / "trace_step0_rank0.json", [kernel("ncclDevKernel_AllGather(x)", 0, 10)])
    write_trace(tmp_path / "trace_step0_rank1.json", [kernel("ncclDevKernel_ReduceScatter(x)", 0, 10)])
    mixed = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--step", "0", "--device-kind", "cpu-test",
                            "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert mixed.returncode != 0 and "cannot be paired by order" in mixed.stderr
    write_trace(tmp_path / "trace_step0_rank0.json", [kernel("gemm", 0, 10)])
    write_trace(tmp_path / "trace_step0_rank1.json", [])
    alone = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--step", "0", "--device-kind", "cpu-test",
                            "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert alone.returncode != 0 and "hold no NCCL collective" in alone.stderr
