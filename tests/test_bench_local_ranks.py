"""scripts/bench_local_ranks.py end to end on CPU with a small state: every rank count is measured
with the divided cores and with one thread per rank, and the JSON says which was which."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fsdp_offload.threads import cpu_threads_per_rank, physical_cores

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_local_ranks.py"


def test_each_rank_count_runs_with_its_share_of_the_cores_and_with_one(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--params", "2000000", "--ranks", "1,2", "--steps", "2", "--kernel", "torch",
           "--subgroup-numel", "1048576", "--device-kind", "cpu-test", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [path] = tmp_path.glob("bench_local_ranks_cpu-test_*.json")
    result = json.loads(path.read_text())
    assert {"command", "device", "commit", "params", "runs"} <= set(result)
    seen = {(r["ranks"], r["threads_per_rank"]) for r in result["runs"]}
    assert seen == {(n, t) for n in (1, 2) for t in (cpu_threads_per_rank(None, n), 1)}
    for r in result["runs"]:
        assert r["params_per_rank"] == 2_000_000 // r["ranks"] and r["update_s"] > 0 and len(r["steps_s"]) == 2


def test_threads_per_rank_divides_the_physical_cores():
    assert cpu_threads_per_rank(None, 1) == physical_cores()
    assert cpu_threads_per_rank(None, 10**6) == 1  # never zero
    assert cpu_threads_per_rank(3, 8) == 3  # an explicit train.cpu_threads wins
