"""Crash harness: SIGKILL a multi-rank training run at random moments, resume it, again and again,
and check that it ends where an uninterrupted run ends, bit for bit.

One uninterrupted run of `scripts/train.py` (torchrun, --ranks ranks: gloo on the CPU, or with
--device cuda NCCL and one GPU per rank; the tiny model streaming its state through a `posix:` or
`kvikio:` tier dir; a DCP checkpoint every --every steps) is the reference. Then each trial starts the
same run with `checkpoint.resume=auto` and kills the whole process tree (every rank, SIGKILL) after a
random delay, half of them drawn over the whole run and half over its training, which lands anywhere:
start-up, a checkpoint load, forward, backward, the update, a flush to the tier, a checkpoint save. It
restarts until a run finishes, killing at most --kills times. A trial passes when the final
checkpoint's model and every rank's optimizer bytes (masters and moments) equal the reference's and
every step's loss equals the reference's loss of that step (the last time the step ran). The runs are
campaign_runs.py's, which `fault_campaign.py --kill-trials` runs too.

    python scripts/crash_harness.py --trials 20 --ranks 2 --steps 12 --every 3
    python scripts/crash_harness.py --device cuda --ranks 4 --tier-scheme kvikio --trials 5 --device-kind nvidia-h100-x4
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from campaign_runs import DEVICES, TIER_SCHEMES, Launch, RunFailed, Runs, keep_logs, kill_trial, reference

from fsdp_offload.results import record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=DEVICES, default="cpu", help="train.device (cuda: NCCL, one GPU per rank)")
    ap.add_argument("--tier-scheme", choices=TIER_SCHEMES, default="posix")
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
    launch = Launch(args.device, args.ranks, args.tier_scheme)
    if launch.unavailable():
        ap.error(launch.unavailable())
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="crash-harness-", dir=args.dir)).resolve()  # as /proc/*/fd shows paths
    runs = Runs(root, launch, args.steps, args.every, args.run_timeout_s, 29600 + os.getpid() % 300)
    started = time.perf_counter()
    try:
        ref = reference(runs, repeat=args.device == "cuda")
    except RunFailed as exc:
        shutil.rmtree(root, ignore_errors=True)
        raise SystemExit(f"error: {exc}") from None

    trials = []
    for i in range(args.trials):
        trials.append(kill_trial(runs, i, ref, rng, args.kills))
        print(f"trial {i}: killed at {trials[-1]['kills_at_s']} s -> {trials[-1]['outcome']}", flush=True)
    kept = keep_logs([d for t in trials for d in t.get("dirs", [])], Path(args.out) / f"crash_harness_kept_{time.strftime('%Y%m%d-%H%M%S')}")
    shutil.rmtree(root, ignore_errors=True)
    exact = sum(t["outcome"] in ("resumed_bit_exact", "missed") for t in trials)
    kills = sum(len(t["kills_at_s"]) for t in trials)
    path = record("crash_harness", args.device_kind, args.out, {
        **launch.describe(), "ranks": args.ranks, "steps": args.steps, "checkpoint_every": args.every, "seed": args.seed,
        "reference_run_s": ref.run_s, "reference_repeat_bit_exact": ref.repeat_bit_exact, "trials": len(trials), "kills": kills,
        "resumes_bit_exact": exact, "outcomes": dict(collections.Counter(t["outcome"] for t in trials)), "kept_logs": kept,
        "wall_s": time.perf_counter() - started, "trials_detail": trials,
    })  # fmt: skip
    print(f"{exact} of {len(trials)} trials end bit for bit where the uninterrupted run ends ({kills} kills); wrote {path}")


if __name__ == "__main__":
    main()
