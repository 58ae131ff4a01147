"""Fault campaign: faults injected into the optimizer's tier while it trains, and whole training runs
killed or faced with faulty checkpoint and run dirs; each trial classified, one JSON record of all.

Tier trials (--trials N, tier_faults.py, in this process, params on the CPU, the tier `posix:` or
`kvikio:` under --dir): 11 subgroups, 3 in host memory, one fault schedule (storage/faults.py: EIO or
ENOSPC on a read or a write, a latency spike, a torn write, a bit flip or truncation of the file, a
tier that vanishes) at a random point of the update, a checkpoint save or a checkpoint load into a
fresh optimizer, against torch AdamW; a failed step, save or load is retried up to twice. Outcomes:

  exact            no error surfaced, or the retry finished the step, and every master, moment and
                   step count equals torch AdamW's, bit for bit (nothing was lost)
  detected         a step failed with an error naming the tier's file (damaged data, a vanished
                   tier): the last good checkpoint is the recovery point
  silent_corruption  the run finished without an error and the state differs: must never happen
  hang             a step outlived --step-timeout-s: must never happen
  undetected_error an error that names neither the subgroup nor the file: must never happen

Whole runs of scripts/train.py under torchrun (campaign_runs.py; --device cpu: gloo ranks; --device
cuda: NCCL, one GPU per rank; --nproc 2 4 runs each case at each rank count; the tier as
--tier-scheme says), judged against an uninterrupted run of the same command (on a GPU run twice, to
show the kernels repeat bit for bit):
  --kill-trials M  every rank SIGKILLed at random moments (up to --kills-per-trial times), resumed with
                   checkpoint.resume=auto: resumed_bit_exact (state and every step's loss) or bad
  --run-trials R   run_faults.py's cases: kills during a save and a load, a damaged trainer state, a
                   part of another step, two writers, full checkpoint and run dirs: resumed_bit_exact
                   or refused_named, or skipped where the machine cannot make the fault (said why)

--budget-s caps the wall time: the trials of every kind are interleaved, and one starts only while
the mean time of its kind still fits; the record says how many of each kind were asked and ran.

    python scripts/fault_campaign.py --trials 600 --run-trials 28 --kill-trials 10 --doc docs/reliability.md
    python scripts/fault_campaign.py --device cuda --nproc 2 4 --tier-scheme kvikio --trials 150 \\
        --kill-trials 8 --run-trials 14 --budget-s 330 --device-kind nvidia-h100-x4 --out $OUT
    python scripts/fault_campaign.py --doc-from $OUT/fault_campaign_....json --doc docs/reliability.md
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import campaign_doc
from campaign_runs import DEVICES, TIER_SCHEMES, Launch, Reference, RunFailed, Runs, keep_logs, kill_trial, reference
from run_faults import CASES, run_case
from tier_faults import CELLS, run_trial

from fsdp_offload.results import record

TIER_BAD = campaign_doc.TIER_BAD  # and campaign_error, a trial the campaign could not run or judge
BAD = ("bad", "campaign_error")


def interleave(asked: dict[str, int]) -> list[tuple[str, int]]:
    """Every kind's trials in one order that spreads each kind evenly over the campaign, so that a
    budget that runs out cuts a little of each kind rather than all of the last."""
    jobs = [((i + 0.5) / n, k, kind, i) for k, (kind, n) in enumerate(asked.items()) for i in range(n)]
    return [(kind, i) for _, _, kind, i in sorted(jobs)]


class Budget:
    """The campaign's wall time: a trial starts only if the mean time of its kind's finished trials
    (`prior` before any) still fits."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds, self.started = seconds, time.perf_counter()
        self.took: dict[str, list[float]] = collections.defaultdict(list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def fits(self, kind: str, prior: float) -> bool:
        done = self.took[kind]
        return self.seconds is None or self.elapsed() + (sum(done) / len(done) if done else prior) <= self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=180, help="tier trials, dealt round-robin over the places and fault kinds")
    ap.add_argument("--steps", type=int, default=5, help="steps of a tier trial")
    ap.add_argument("--kill-trials", type=int, default=0, help="whole runs SIGKILLed at random moments and resumed")
    ap.add_argument("--kills-per-trial", type=int, default=2)
    ap.add_argument("--run-trials", type=int, default=0, help="whole runs faced with checkpoint and run dir faults (run_faults.py)")
    ap.add_argument("--run-cases", nargs="+", choices=CASES, default=list(CASES), help="the run-level cases, dealt round-robin")
    ap.add_argument("--device", choices=DEVICES, default="cpu", help="train.device of the whole runs (cuda: NCCL, one GPU per rank)")
    ap.add_argument("--nproc", type=int, nargs="+", default=[2], help="ranks of the whole runs; several: each case at each count")
    ap.add_argument("--tier-scheme", choices=TIER_SCHEMES, default="posix", help="the tier of every trial: posix:DIR or kvikio:DIR")
    ap.add_argument("--run-steps", type=int, default=6)
    ap.add_argument("--run-every", type=int, default=2, help="a whole run's checkpoint interval")
    ap.add_argument("--run-timeout-s", type=float, default=None, help="a whole run that outlives this is killed and counted bad "
                    "(default: 6 times the uninterrupted run, at least 60 s)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=None, help="wall time for everything; trials that would not fit are not started")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the trials' tier, checkpoint and run dirs go")
    ap.add_argument("--step-timeout-s", type=float, default=60.0)
    ap.add_argument("--device-kind", default=None, help="the machine, for the record's name (default: cpu, or the GPU's name)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--doc", default=None, help="a markdown file whose campaign sections get this record (docs/reliability.md)")
    ap.add_argument("--doc-from", default=None, help="fill --doc from this record (made here or on another machine) and exit")
    args = ap.parse_args(argv)
    if args.doc_from:
        if not args.doc:
            ap.error("--doc-from needs --doc, the file to fill")
        return args
    if min(args.trials, args.kill_trials, args.run_trials, args.kills_per_trial) < 0 or args.trials + args.kill_trials + args.run_trials < 1:
        ap.error("--trials, --kill-trials, --run-trials and --kills-per-trial must be >= 0, and one of the first three >= 1")
    if args.trials and args.steps < 3:
        ap.error("--steps must be >= 3 (damage lands after the first step; a checkpoint after the second)")
    if args.run_every < 1 or args.run_steps <= 2 * args.run_every:
        ap.error("--run-steps must exceed twice --run-every (a resume goes on from the second checkpoint)")
    if len(set(args.nproc)) < len(args.nproc) or min(args.nproc) < 1:
        ap.error(f"--nproc {args.nproc}: distinct rank counts, each >= 1")
    if not Path(args.dir).is_dir():
        ap.error(f"--dir {args.dir} is not a directory: create it, or give one where the trials' dirs may go")
    for launch in (Launch(args.device, n, args.tier_scheme) for n in args.nproc):
        why = launch.unavailable()
        if why:
            ap.error(why)
    return args


def machine_kind(args: argparse.Namespace) -> str:
    if args.device_kind:
        return args.device_kind
    if args.device == "cpu":
        return "cpu"
    return "-".join(torch.cuda.get_device_name(0).lower().split()) + f"-x{torch.cuda.device_count()}"


def whole_runs(args: argparse.Namespace, root: Path) -> dict[int, tuple[Runs, Reference | str]]:
    """Per rank count: its Runs and its uninterrupted reference, or why there is none."""
    out: dict[int, tuple[Runs, Reference | str]] = {}
    for k, n in enumerate(args.nproc):
        (root / f"nproc{n}").mkdir()
        port = 20000 + os.getpid() % 900 * 10 + 2 * k  # two_writers' second job takes the port after it
        runs = Runs(root / f"nproc{n}", Launch(args.device, n, args.tier_scheme), args.run_steps, args.run_every,
                    args.run_timeout_s or 300, port)  # fmt: skip
        try:
            ref: Reference | str = reference(runs, repeat=args.device == "cuda")
            runs.timeout_s = args.run_timeout_s or max(60.0, 6 * ref.run_s)
            print(f"{n} ranks: the uninterrupted run took {ref.run_s:.1f} s (training from {ref.train_start_s:.1f} s); "
                  f"rerun bit for bit: {ref.repeat_bit_exact}", flush=True)  # fmt: skip
        except RunFailed as exc:
            ref = str(exc)
            print(f"{n} ranks: {ref}", flush=True)
        out[n] = (runs, ref)
    return out


def tier_summary(results: list[dict]) -> dict:
    counts = {f"{p}/{k}": dict(collections.Counter(r["outcome"] for r in results if (r["place"], r["kind"]) == (p, k))) for p, k in CELLS}
    counts = {c: v for c, v in counts.items() if v}
    injected = sum(r["injected"] + (r["damage"] is not None) for r in results)
    recovered = sum(r["injected"] + (r["damage"] is not None) for r in results if r["outcome"] in ("exact", "detected"))
    examples = {c: next((r["errors"][-1] for r in results if f"{r['place']}/{r['kind']}" == c and r["errors"]), None) for c in counts}
    return {"trials": len(results), "faults_injected": injected, "faults_recovered": recovered, "outcomes": counts,
            "table": campaign_doc.tier_table(counts) if results else "", "examples": examples, "trials_detail": results}  # fmt: skip


def guarded(trial, row: dict) -> dict:
    """The trial's row; when the campaign's own code fails judging it (a final checkpoint it cannot
    read, a tier it cannot build), `row` with that error, counted as bad: the rest of the campaign
    still runs and the record is written."""
    try:
        return trial()
    except Exception as exc:  # noqa: BLE001 - recorded, counted as bad
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return {**row, "outcome": "campaign_error", "errors": [f"{type(exc).__name__}: {exc} ({where.filename}:{where.lineno})"]}


def by(rows: list[dict], key: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        slot = out.setdefault(str(row[key]), {})
        slot[row["outcome"]] = slot.get(row["outcome"], 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.doc_from:
        campaign_doc.fill(args.doc, args.doc_from)
        return 0
    budget = Budget(args.budget_s)
    asked = {"tier": args.trials, "kill": args.kill_trials, "run": args.run_trials}
    root = Path(tempfile.mkdtemp(prefix="fault-campaign-runs-", dir=args.dir)).resolve()  # as /proc/*/fd shows paths
    setups = whole_runs(args, root) if args.kill_trials or args.run_trials else {}
    rng = random.Random(args.seed)
    rows: dict[str, list[dict]] = {"tier": [], "kill": [], "run": []}
    cut, hung = collections.Counter(), False
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # tier steps run here so a hang is caught, not waited on
        for kind, i in interleave(asked):
            if kind == "tier":
                if hung or not budget.fits("tier", 1.0):
                    cut[kind] += 1
                    continue
                started = time.perf_counter()
                rows["tier"].append(guarded(lambda: run_trial(i, args, pool), {"place": CELLS[i % len(CELLS)][0],
                                    "kind": CELLS[i % len(CELLS)][1], "seed": i, "injected": 0, "damage": None}))  # fmt: skip
                budget.took["tier"].append(time.perf_counter() - started)
                hung = rows["tier"][-1]["outcome"] == "hang"  # the hung step holds the worker: no more tier trials
                continue
            n = args.nproc[i % len(args.nproc)]
            runs, ref = setups[n]
            name = args.run_cases[(i // len(args.nproc)) % len(args.run_cases)] if kind == "run" else "kill"
            if isinstance(ref, str):  # no reference to judge by: the trial is bad, and says why
                rows[kind].append({"trial": i, "nproc": n, "case": name, "outcome": "bad", "error": [ref]})
                continue
            kills = args.kills_per_trial
            if not budget.fits(kind, ref.run_s * ((kills + 1) if kind == "kill" else 2)):
                cut[kind] += 1
                continue
            started = time.perf_counter()
            trial_dir = runs.root / (f"kill{i}" if kind == "kill" else f"{name}{i}")
            row = guarded(lambda: kill_trial(runs, i, ref, rng, kills) if kind == "kill" else run_case(name, i, runs, ref, rng),
                          {"trial": i, "nproc": n, "case": name, "dirs": [str(trial_dir)]})  # fmt: skip
            budget.took[kind].append(time.perf_counter() - started)
            rows[kind].append(row)
            print(f"[{budget.elapsed():.0f} s] {kind} #{i} ({n} ranks{'' if kind == 'kill' else ', ' + name}): {row['outcome']}", flush=True)
    if hung:
        cut["tier"] = 0  # what did not run after a hang is said by tier_stopped_by_hang, not as cut for time
    stem = f"fault_campaign_kept_{time.strftime('%Y%m%d-%H%M%S')}"
    kept = keep_logs([d for kind in ("kill", "run") for r in rows[kind] for d in r.get("dirs", [])], Path(args.out) / stem)
    shutil.rmtree(root, ignore_errors=True)

    tier = tier_summary(rows["tier"])
    kill_rows, run_rows = rows["kill"], rows["run"]
    tier_bad = sum(r["outcome"] in TIER_BAD for r in rows["tier"])
    run_bad = sum(r["outcome"] in BAD for r in run_rows)
    kill_bad = sum(r["outcome"] in BAD for r in kill_rows)
    launch = Launch(args.device, args.nproc[0], args.tier_scheme)
    references = {str(n): ({"error": ref} if isinstance(ref, str) else {"run_s": round(ref.run_s, 2), "train_start_s": round(ref.train_start_s, 2),
                   "repeat_bit_exact": ref.repeat_bit_exact, "notes": ref.notes}) for n, (_, ref) in setups.items()}  # fmt: skip
    result = {
        "campaign": {**launch.describe(), "nproc": args.nproc}, "budget_s": args.budget_s, "seed": args.seed,
        "asked": asked, "ran": {k: len(v) for k, v in rows.items()}, "cut_for_time": {k: cut[k] for k in asked},
        "tier_stopped_by_hang": hung, "bad": tier_bad + run_bad + kill_bad,
        "counts": {k: dict(collections.Counter(r["outcome"] for r in v)) for k, v in rows.items()},
        "steps": args.steps, **tier,
        "references": references, "run_steps": args.run_steps, "run_every": args.run_every, "kills_per_trial": args.kills_per_trial,
        "kill_trials": len(kill_rows), "kills": sum(len(r.get("kills_at_s", [])) for r in kill_rows),
        "kill_outcomes": {f"{n} ranks": c for n, c in by(kill_rows, "nproc").items()}, "kill_trials_detail": kill_rows,
        "run_trials": len(run_rows), "run_bad": run_bad, "run_outcomes": by(run_rows, "case"),
        "run_outcomes_by_nproc": {f"{n} ranks": c for n, c in by(run_rows, "nproc").items()}, "run_trials_detail": run_rows,
        "kept_logs": kept, "wall_s": budget.elapsed(),
    }  # fmt: skip
    path = record("fault_campaign", machine_kind(args), args.out, result)
    print(campaign_doc.tables({**result, "commit": ""}))
    ran = ", ".join(f"{len(rows[k])} of {asked[k]} {k} trials" for k in asked if asked[k])
    print(f"{ran}; {result['bad']} bad; {dict(result['cut_for_time'])} cut for time; wrote {path}")
    if args.doc:
        campaign_doc.fill(args.doc, path)
    return 1 if result["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
