"""Load run: several ranks of one node sharing two tiers for hundreds of steps, with checkpoints; is
anything leaking, and does it ever hang?

Runs `scripts/train.py` under torchrun (--ranks gloo ranks on CPU, or one GPU each with
--device cuda) on the tiny model with its state streaming through two tiers that every rank shares
(a dir under --dir and one under /dev/shm, exclusive node-level access), a DCP checkpoint every
--checkpoint-every steps. Each rank's per-step rows carry its resident memory and open file
descriptors (`host_rss_gib`, `open_fds`); the script compares, per rank, the median over the first
tenth of the steps after --settle with the median over the last tenth, and records the growth, the
step times, and whether the run finished within --timeout-s. After the run, no tier file, lock file or
/dev/shm entry of the run may be left.

    python scripts/bench_load.py --ranks 4 --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_offload.results import record

TRAIN = str(Path(__file__).resolve().parent / "train.py")


def rank_rows(out_dir: Path, rank: int) -> list[dict]:
    name = "metrics.jsonl" if rank == 0 else f"rank{rank}.metrics.jsonl"
    return [json.loads(line) for line in (out_dir / name).read_text().splitlines()]


def growth(rows: list[dict], key: str, settle: int) -> dict:
    steady = rows[settle:]
    tenth = max(1, len(steady) // 10)
    first, last = statistics.median(r[key] for r in steady[:tenth]), statistics.median(r[key] for r in steady[-tenth:])
    return {"first": first, "last": last, "growth": last - first, "max": max(r[key] for r in steady)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--settle", type=int, default=20, help="steps left out before the first window (allocator warm-up)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the first tier and the run dir go")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--timeout-s", type=int, default=1800)
    ap.add_argument("--device-kind", default="cpu")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.ranks < 1 or args.steps < 10 * 2 + args.settle:
        ap.error("--ranks must be >= 1 and --steps at least --settle + 20")

    work = Path(tempfile.mkdtemp(prefix="bench-load-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="bench-load-", dir="/dev/shm"))
    locks = Path(tempfile.mkdtemp(prefix="bench-load-locks-", dir="/dev/shm"))
    (work / "tier").mkdir()
    out_dir = work / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
           TRAIN, "model=tiny", "offload=tiny_disk", f"offload.tiers=['posix:{work / 'tier'}','posix:{shm}']",
           "offload.placement=fixed", f"offload.tier_lock_dir={locks}", f"train.steps={args.steps}", f"train.device={args.device}",
           "train.progress=false", "train.log_every=1", f"train.out_dir={out_dir}", f"hydra.run.dir={out_dir}/hydra",
           f"checkpoint.dir={work / 'ckpt'}", f"checkpoint.every={args.checkpoint_every}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    try:
        with open(work / "train.log", "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout_s, check=False)
        finished, code = True, proc.returncode
    except subprocess.TimeoutExpired:
        finished, code = False, None
    wall = time.perf_counter() - t0
    result: dict = {"ranks": args.ranks, "steps": args.steps, "checkpoint_every": args.checkpoint_every, "device": args.device,
                    "finished": finished, "exit_code": code, "wall_s": wall, "train_command": " ".join(cmd[1:])}  # fmt: skip
    if finished and code == 0:
        per_rank = []
        for rank in range(args.ranks):
            rows = rank_rows(out_dir, rank)
            per_rank.append({"rank": rank, "steps_logged": len(rows), "rss_gib": growth(rows, "host_rss_gib", args.settle),
                             "open_fds": growth(rows, "open_fds", args.settle),
                             "rss_mib_every_10_steps": [round(r["host_rss_gib"] * 1024, 1) for r in rows[::10]],
                             "step_s_median": statistics.median(r["step_s"] for r in rows[args.settle:]),
                             "step_s_max": max(r["step_s"] for r in rows[args.settle:])})  # fmt: skip
        result["per_rank"] = per_rank
        result["rss_growth_mib"] = max(r["rss_gib"]["growth"] for r in per_rank) * 1024  # the worst rank's
        result["fd_growth"] = max(r["open_fds"]["growth"] for r in per_rank)
    else:
        result["log_tail"] = (work / "train.log").read_text().splitlines()[-20:]
    left = [str(p) for d in (work / "tier", shm, locks) for p in d.rglob("*") if p.is_file()]
    result["files_left"] = left
    shutil.rmtree(work, ignore_errors=True)
    for d in (shm, locks):
        shutil.rmtree(d, ignore_errors=True)
    path = record("bench_load", args.device_kind, args.out, result)
    if "per_rank" in result:
        print(f"{'rank':>4} {'steps':>6} {'RSS first/last MiB':>19} {'fds first/last':>15} {'step s med/max':>15}")
        for r in result["per_rank"]:
            print(f"{r['rank']:>4} {r['steps_logged']:>6} {r['rss_gib']['first'] * 1024:>9.1f}/{r['rss_gib']['last'] * 1024:<9.1f} "
                  f"{r['open_fds']['first']:>7.0f}/{r['open_fds']['last']:<7.0f} {r['step_s_median']:>7.3f}/{r['step_s_max']:<7.3f}")  # fmt: skip
    print(f"finished={finished} exit={code} wall {wall:.0f} s; files left: {len(left)}; wrote {path}")


if __name__ == "__main__":
    main()
