"""Crash harness: SIGKILL a multi-rank training run at random moments, resume it, again and again,
and check that it ends where an uninterrupted run ends, bit for bit.

One uninterrupted run of `scripts/train.py` (torchrun, --ranks gloo ranks, the tiny model streaming
its state through a tier dir, a DCP checkpoint every --every steps) is the reference. Then each
trial starts the same run with `checkpoint.resume=auto` and kills the whole process group (every rank,
SIGKILL) after a random delay, which lands anywhere: start-up, a checkpoint load, forward, backward,
the update, a flush to the tier, a checkpoint save. It restarts until a run finishes, killing at most
--kills times. A trial passes when the final checkpoint's model and every rank's optimizer bytes
(masters and moments) equal the reference's and every step's loss equals the reference's loss of
that step (the last time the step ran).

    python scripts/crash_harness.py --trials 20 --ranks 2 --steps 12 --every 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsdp_offload.dcp_reader import read_dcp_metadata
from fsdp_offload.results import record

TRAIN = str(Path(__file__).resolve().parent / "train.py")


def command(args: argparse.Namespace, run: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks), "--master-port", str(port), TRAIN,
            "model=tiny", f"offload.tiers=['posix:{run / 'tier'}']", "offload.host_budget_gb=0.0008", f"train.steps={args.steps}", "train.progress=false",
            f"train.out_dir={run / 'out'}", f"hydra.run.dir={run / 'out' / 'hydra'}", f"checkpoint.dir={run / 'ckpt'}",
            f"checkpoint.every={args.every}", "checkpoint.resume=auto", f"checkpoint.keep={args.steps}"]  # fmt: skip


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def kill_tree(pid: int) -> None:
    """SIGKILLs `pid` and every process under it, as a scheduler ending the job does (torchrun starts
    each rank in a session of its own, so killing torchrun's group alone would leave the ranks)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def final_state(ckpt: Path, scratch: Path) -> dict:
    """The final checkpoint's model (DCP's own converter) and every rank's subgroup bytes."""
    dcp_to_torch_save(str(ckpt / "model"), scratch)
    model = torch.load(scratch, weights_only=True)["model"]
    subgroups = {}
    for index, where in read_dcp_metadata(str(ckpt / "optimizer" / ".metadata")).storage_data.items():
        if ".subgroup_" in index.fqn:
            with open(ckpt / "optimizer" / where.relative_path, "rb") as f:
                f.seek(where.offset)
                subgroups[index.fqn] = f.read(where.length)
    return {"model": model, "subgroups": subgroups}


def losses(run: Path) -> dict[int, float]:
    """Each step's loss, the last time the step ran (a resumed run repeats the steps after its checkpoint)."""
    out = {}
    for line in (run / "out" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["loss"]
    return out


def same(a: dict, b: dict) -> bool:
    return a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and (
        a["subgroups"] == b["subgroups"]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3, help="checkpoint every this many steps")
    ap.add_argument("--kills", type=int, default=3, help="kills per trial at most; the run after the last finishes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--run-timeout-s", type=float, default=300)
    ap.add_argument("--device-kind", default="cpu")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.steps % args.every:
        ap.error(f"--steps {args.steps} must be a multiple of --every {args.every}, so that the last step is checkpointed")
    if not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir} is not a directory: create it, or give one where the trials' run dirs may go")
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="crash-harness-", dir=args.dir))
    port = 29600 + os.getpid() % 300
    started = time.perf_counter()

    ref = root / "reference"
    (ref / "tier").mkdir(parents=True)
    t0 = time.perf_counter()
    proc = launch(command(args, ref, port), ref / "log")
    if proc.wait(timeout=args.run_timeout_s) != 0:
        sys.exit(f"error: the reference run failed; see {ref / 'log'}")
    run_s = time.perf_counter() - t0
    reference = final_state(ref / "ckpt" / f"step_{args.steps:08d}", root / "ref.pt")
    ref_losses = losses(ref)

    trials = []
    for i in range(args.trials):
        run = root / f"trial{i}"
        (run / "tier").mkdir(parents=True)
        kills = []
        for attempt in range(args.kills + 1):
            proc = launch(command(args, run, port), run / "log")
            if attempt < args.kills:
                delay = rng.uniform(0.2, run_s)
                try:
                    proc.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    kill_tree(proc.pid)
                    proc.wait()
                    kills.append(round(delay, 2))
                    continue
            code = proc.wait(timeout=args.run_timeout_s)
            if code == 0:
                break
        else:
            code = None
        row = {"trial": i, "kills_at_s": kills, "exit_code": code}
        final = run / "ckpt" / f"step_{args.steps:08d}"
        if code == 0 and final.exists():
            mine = final_state(final, run / "final.pt")
            got = losses(run)
            row["state_equal"] = same(mine, reference)
            row["losses_equal"] = got == ref_losses
            row["steps_differing"] = sorted(k for k in ref_losses if got.get(k) != ref_losses[k])
        else:
            row["state_equal"] = row["losses_equal"] = False
            row["log_tail"] = (run / "log").read_text().splitlines()[-10:]
        row["passed"] = row["state_equal"] and row["losses_equal"]
        trials.append(row)
        print(f"trial {i}: killed at {kills} s -> {'pass' if row['passed'] else 'FAIL'}", flush=True)
        if row["passed"]:
            shutil.rmtree(run, ignore_errors=True)
        else:  # kept for a look: its log, metrics and checkpoints
            row["kept"] = str(run.rename(Path(args.dir) / f"{root.name}-{run.name}"))
    shutil.rmtree(root, ignore_errors=True)
    passed = sum(t["passed"] for t in trials)
    path = record("crash_harness", args.device_kind, args.out, {
        "ranks": args.ranks, "steps": args.steps, "checkpoint_every": args.every, "seed": args.seed, "reference_run_s": run_s,
        "trials": len(trials), "kills": sum(len(t["kills_at_s"]) for t in trials), "resumes_bit_exact": passed,
        "wall_s": time.perf_counter() - started,
        "trials_detail": trials,
    })  # fmt: skip
    print(f"{passed} of {len(trials)} trials end bit for bit where the uninterrupted run ends "
          f"({sum(len(t['kills_at_s']) for t in trials)} kills); wrote {path}")


if __name__ == "__main__":
    main()
