"""Fault campaign: many random fault schedules injected into a tier while OffloadAdamW trains, each
run checked against torch AdamW; one JSON of outcomes per fault kind.

A trial trains a small set of params (11 subgroups, 3 in host memory, the rest on a POSIX tier under
--dir) for --steps steps, with one fault schedule (storage/faults.py: EIO or ENOSPC on a read or a
write, a latency spike, a torn write, a bit flip or truncation of the file, a tier that vanishes) at a
random point of one place: the update, a checkpoint save (DCP, streaming the stored subgroups out) or
a checkpoint load into a fresh optimizer on another tier dir (streaming them in), after which training
goes on from the loaded copy. A step, save or load that raises is retried up to twice (as a training
loop that catches the error would). Kills are scripts/crash_harness.py's. Each trial ends in one outcome:

  exact            no error surfaced, or the retry finished the step, and every master, moment and
                   step count equals torch AdamW's, bit for bit (nothing was lost)
  detected         a step failed with an error naming the tier's file (damaged data, a vanished
                   tier): the last good checkpoint is the recovery point
  silent_corruption  the run finished without an error and the state differs: must never happen
  hang             a step outlived --step-timeout-s: must never happen
  undetected_error an error that names neither the subgroup nor the file: must never happen

    python scripts/fault_campaign.py --trials 600 --seed 0 --doc docs/reliability.md

With --run-trials N it also runs N whole training runs faced with faults of the checkpoint and run
dirs (kills during a save and a load, a damaged trainer state, a part of another step, two writers,
full dirs: scripts/run_faults.py), each refused with a named cause or resumed bit for bit.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import run_faults

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.dcp_reader import SafeFileSystemReader
from fsdp_offload.optimizer_state import OffloadOptimizerState, StreamingLoadPlanner, StreamingSavePlanner
from fsdp_offload.results import record
from fsdp_offload.storage import TierError
from fsdp_offload.storage.faults import Fault, FaultyTier

SHAPES = [(300, 37), (513,), (1000, 29), (7,), (2500,)]  # 43_120 elements over 11 subgroups of 4096
SUBGROUP = 4096
CACHED = 3
KINDS = ("eio_write", "eio_read", "enospc_write", "enospc_read", "latency", "torn_write", "bitflip", "truncate", "vanish")
# where a trial's fault strikes: the update's reads and writes, a checkpoint save (it reads the stored
# subgroups), a checkpoint load into a fresh optimizer (it writes them to that one's tier)
PLACES = ("update", "checkpoint_save", "checkpoint_load")
# what a save (it reads the tier) and a load (it writes the tier) can meet
CHECKPOINT_KINDS = {"checkpoint_save": ("eio_read", "enospc_read", "latency", "vanish"),
                    "checkpoint_load": ("eio_write", "enospc_write", "latency", "vanish")}  # fmt: skip


def make_optimizer(root: str, params: list) -> OffloadAdamW:
    staging = 2 * (10 * SUBGROUP + 3072)
    budget = (staging + CACHED * 3 * SUBGROUP * 4) / 2**30
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{root}"], subgroup_numel=SUBGROUP, host_budget_gb=budget)
    return OffloadAdamW(params, lr=1e-2, weight_decay=0.1, offload=cfg)


def make_pair(root: str, seed: int) -> tuple[OffloadAdamW, torch.optim.AdamW, list, list]:
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    return make_optimizer(root, mine), torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False), mine, ref


def same_as_reference(opt: OffloadAdamW, ref_opt: torch.optim.AdamW, ref: list) -> bool:
    state = opt.state_dict()["state"]
    return all(
        torch.equal(state[i]["master_param"], r.data)
        and torch.equal(state[i]["exp_avg"], ref_opt.state[r]["exp_avg"])
        and torch.equal(state[i]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
        and int(state[i]["step"]) == int(ref_opt.state[r]["step"])
        for i, r in enumerate(ref)
    )


def final_outcome(opt: OffloadAdamW, ref_opt: torch.optim.AdamW, ref: list, tier: FaultyTier, out: dict) -> dict:
    """Sets the trial's outcome from `opt` against torch AdamW. Reading the state back reads every
    stored subgroup, so damage that no step read is found here, and classified as a step's error is."""
    try:
        exact = same_as_reference(opt, ref_opt, ref)
    except Exception as exc:  # noqa: BLE001 - classified here
        out["errors"].append(f"{type(exc).__name__}: {exc}")
        out["outcome"] = "detected" if names_the_fault(out["errors"][-1], tier) else "undetected_error"
        return out
    out["outcome"] = "exact" if exact else "silent_corruption"
    return out


def schedule(kind: str, rng: random.Random, place: str = "update") -> tuple[list[Fault], str | None]:
    """The faults of one trial, and the damage to do to the file after the first step (if any). At a
    checkpoint the fault strikes among its first few transfers."""
    after = rng.randrange(0, 12) if place == "update" else rng.randrange(0, 4)
    if kind in ("bitflip", "truncate"):
        return [], kind
    if kind == "latency":
        return [Fault("latency", op=op, after=after, times=rng.randrange(1, 6), delay_s=rng.uniform(0.001, 0.05)) for op in ("read", "write")], None
    if kind == "torn_write":
        return [Fault("torn_write", after=after, times=1)], None
    if kind == "vanish":
        op = {"checkpoint_save": "read", "checkpoint_load": "write"}.get(place) or rng.choice(("read", "write"))
        return [Fault("vanish", op=op, after=after)], None
    errno_name, op = kind.split("_")
    return [Fault(errno_name, op=op, after=after, times=rng.randrange(1, 3))], None


def names_the_fault(message: str, tier: FaultyTier) -> bool:
    """Whether an error says where: the tier's file, the subgroup, or the injected errno's own text."""
    return tier.path in message or "subgroup " in message or "injected" in message


def trial(kind: str, seed: int, args: argparse.Namespace, pool: concurrent.futures.ThreadPoolExecutor) -> dict:
    rng = random.Random(seed)
    root = tempfile.mkdtemp(prefix="fault-campaign-", dir=args.dir)
    opt, ref_opt, mine, ref = make_pair(root, seed)
    faults, damage = schedule(kind, rng)
    tier = FaultyTier.around(opt.store, 0, faults)
    out = {"kind": kind, "seed": seed, "faults": [f.__dict__ for f in faults], "damage": damage, "errors": []}
    try:
        for step in range(args.steps):
            g = torch.Generator().manual_seed(seed * 1000 + step)
            grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]
            for p, r, gr in zip(mine, ref, grads):
                p.grad, r.grad = gr, gr.float()
            if damage and step == 1:
                stored = sorted(opt.store.stored_locations())
                tier.damage(stored[rng.randrange(len(stored))], damage)
            for attempt in range(3):
                try:
                    pool.submit(opt.step).result(timeout=args.step_timeout_s)
                    break
                except concurrent.futures.TimeoutError:
                    out["outcome"] = "hang"
                    out["hang_at_step"] = step
                    return out
                except Exception as exc:  # noqa: BLE001 - classified below
                    out["errors"].append(f"{type(exc).__name__}: {exc}")
                    if not names_the_fault(out["errors"][-1], tier):
                        out["outcome"] = "undetected_error"
                        return out
                    if attempt == 2:  # the fault outlived two retries: the run stops, the error names it
                        out["outcome"] = "detected"
                        return out
            ref_opt.step()
        return final_outcome(opt, ref_opt, ref, tier, out)
    finally:
        out["injected"] = tier.injected
        try:
            opt.close()
        except (OSError, TierError):
            pass
        shutil.rmtree(root, ignore_errors=True)


def retried(op, tier: FaultyTier, out: dict, attempts: int = 3) -> str | None:
    """Runs `op` up to `attempts` times while it raises an error that names the fault; returns the
    outcome that ends the trial ("undetected_error" or "detected") or None when `op` went through."""
    for attempt in range(attempts):
        try:
            op()
            return None
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - classified here (DCP's is a BaseException)
            out["errors"].append(f"{type(exc).__name__}: {exc}")
            if not names_the_fault(out["errors"][-1], tier):
                return "undetected_error"
    return "detected"


def checkpoint_trial(kind: str, place: str, seed: int, args: argparse.Namespace) -> dict:
    """Trains 2 steps, saves a checkpoint (through the faulty tier when place is checkpoint_save),
    loads it into a fresh optimizer on another tier dir (faulty when checkpoint_load), trains on
    from it, and compares with torch AdamW."""
    rng = random.Random(seed)
    roots = [tempfile.mkdtemp(prefix="fault-campaign-", dir=args.dir) for _ in range(3)]  # tier, tier of the copy, checkpoint
    opt, ref_opt, mine, ref = make_pair(roots[0], seed)
    fresh_params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    fresh = make_optimizer(roots[1], fresh_params)
    faults, _ = schedule(kind, rng, place)
    out = {"kind": kind, "place": place, "seed": seed, "faults": [f.__dict__ for f in faults], "damage": None, "errors": [],
           "injected": 0}  # fmt: skip
    tier: FaultyTier | None = None

    def step(o: OffloadAdamW, params: list, step_index: int, with_ref: bool) -> None:
        g = torch.Generator().manual_seed(seed * 1000 + step_index)
        grads = [torch.randn(sh, generator=g).to(torch.bfloat16) for sh in SHAPES]
        for p, r, gr in zip(params, ref, grads):
            p.grad = gr
            if with_ref:
                r.grad = gr.float()
        o.step()
        if with_ref:
            ref_opt.step()

    try:
        for i in range(2):
            step(opt, mine, i, with_ref=True)
        tier = FaultyTier.around((opt if place == "checkpoint_save" else fresh).store, 0, faults)  # from here on
        path = os.path.join(roots[2], "ckpt")

        def save() -> None:
            shutil.rmtree(path, ignore_errors=True)  # a failed save leaves a partial dir: it is written anew
            dcp.save({"optim": OffloadOptimizerState(opt)}, checkpoint_id=path, planner=StreamingSavePlanner())

        def load() -> None:
            dcp.load({"optim": OffloadOptimizerState(fresh)}, storage_reader=SafeFileSystemReader(path), planner=StreamingLoadPlanner())

        for op in (save, load):
            ended = retried(op, tier, out)
            if ended is not None:
                out["outcome"] = ended
                return out
        tier.faults = []  # the fault was the checkpoint's: the steps after it run on a healthy tier
        with torch.no_grad():  # the copy's model params, from its masters (as a resumed run's model would be)
            for p, r in zip(fresh_params, ref):
                p.copy_(r)
        for i in range(2, args.steps):
            step(fresh, fresh_params, i, with_ref=True)
        return final_outcome(fresh, ref_opt, ref, tier, out)
    finally:
        out["injected"] = tier.injected if tier is not None else 0
        for o in (opt, fresh):
            try:
                o.close()
            except (OSError, TierError):
                pass
        for r in roots:
            shutil.rmtree(r, ignore_errors=True)


def doc_table(counts: dict[tuple[str, str], collections.Counter]) -> str:
    """The campaign's table, as docs/reliability.md shows it."""
    lines = ["| place | fault | trials | exact | detected | silent corruption | hang | unnamed error |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for (place, kind), c in counts.items():
        lines.append(f"| {place} | {kind} | {sum(c.values())} | {c['exact']} | {c['detected']} | {c['silent_corruption']} | "
                     f"{c['hang']} | {c['undetected_error']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=180, help="trials in all, dealt round-robin over the fault kinds")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the trials' tier dirs go")
    ap.add_argument("--step-timeout-s", type=float, default=60.0)
    ap.add_argument("--device-kind", default="cpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--run-trials", type=int, default=0, help="whole training runs faced with checkpoint and run dir faults (run_faults.py)")
    ap.add_argument("--doc", default=None, help="a markdown file whose fault_campaign section gets this run's table (docs/reliability.md)")
    args = ap.parse_args()
    if args.trials < 0 or args.run_trials < 0 or args.trials + args.run_trials < 1 or args.steps < 3:
        ap.error("--trials and --run-trials must be >= 0, one of them >= 1, and --steps >= 3 (damage lands after the first "
                 "step; a checkpoint after the second)")

    started = time.perf_counter()
    cells = [("update", k) for k in KINDS] + [(p, k) for p in PLACES[1:] for k in CHECKPOINT_KINDS[p]]
    results = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # steps run here so a hang is caught, not waited on
        for i in range(args.trials):
            place, kind = cells[i % len(cells)]
            seed = args.seed * 100_000 + i
            results.append(trial(kind, seed, args, pool) if place == "update" else checkpoint_trial(kind, place, seed, args))
            results[-1]["place"] = place
            if results[-1]["outcome"] == "hang":
                break  # the hung step holds the worker: report what ran
    counts = {c: collections.Counter(r["outcome"] for r in results if (r["place"], r["kind"]) == c) for c in cells}
    bad = sum(c[o] for c in counts.values() for o in ("silent_corruption", "hang", "undetected_error"))
    injected = sum(r["injected"] + (r["damage"] is not None) for r in results)
    recovered = sum(r["injected"] + (r["damage"] is not None) for r in results if r["outcome"] in ("exact", "detected"))
    table = doc_table(counts) if results else ""
    runs = run_faults.campaign(args.run_trials, args.seed, args.dir) if args.run_trials else {}
    if runs:
        bad += runs["run_bad"]
    path = record("fault_campaign", args.device_kind, args.out, {**runs,
        "trials": len(results), "steps": args.steps, "seed": args.seed, "wall_s": time.perf_counter() - started,
        "faults_injected": injected, "faults_recovered": recovered, "bad": bad,
        "outcomes": {f"{p}/{k}": dict(c) for (p, k), c in counts.items()}, "table": table,
        "examples": {f"{p}/{k}": next((r["errors"][-1] for r in results if (r["place"], r["kind"]) == (p, k) and r["errors"]), None)
                     for p, k in cells},
        "trials_detail": results,
    })  # fmt: skip
    print(table + ("\n\n" + run_table(runs["run_outcomes"]) if runs else ""))
    print(f"{len(results)} trials, {injected} faults injected, {recovered} ended exact or with a named error; {bad} bad; wrote {path}")
    if args.doc and results:
        write_doc_section(args.doc, table, path, len(results), injected, recovered, bad)
    if args.doc and runs:
        write_run_section(args.doc, run_table(runs["run_outcomes"]), path, runs)


def run_table(counts: dict[str, dict[str, int]]) -> str:
    """The run-level cases as a markdown table."""
    cols = ["resumed_bit_exact", "refused_named", "missed", "skipped", "bad"]
    rows = ["| run case | trials | " + " | ".join(c.replace("_", " ") for c in cols) + " |", "| --- " * (len(cols) + 2) + "|"]
    rows += [f"| {case} | {sum(c.values())} | " + " | ".join(str(c.get(col, 0)) for col in cols) + " |" for case, c in counts.items()]
    return "\n".join(rows)


def write_doc_section(doc: str, table: str, json_path: str, trials: int, injected: int, recovered: int, bad: int) -> None:
    """Replaces the text between the campaign markers of `doc` with this run's table."""
    begin, end = "<!-- fault_campaign: begin -->", "<!-- fault_campaign: end -->"
    text = Path(doc).read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"error: --doc {doc} has no '{begin}' ... '{end}' section to fill")
    section = (f"{begin}\n`{os.path.basename(json_path)}`: {trials} trials, {injected} faults injected, {recovered} of them "
               f"ended bit-exact or with an error naming the file; {bad} trials lost state silently, hung or failed "
               f"without saying where.\n\n{table}\n{end}")  # fmt: skip
    Path(doc).write_text(text[: text.index(begin)] + section + text[text.index(end) + len(end):])
    print(f"updated {doc}")


def write_run_section(doc: str, table: str, json_path: str, runs: dict) -> None:
    """Replaces the text between the run_faults markers of `doc` with this run's table."""
    begin, end = "<!-- run_faults: begin -->", "<!-- run_faults: end -->"
    text = Path(doc).read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"error: --doc {doc} has no '{begin}' ... '{end}' section to fill")
    counts: collections.Counter = collections.Counter()
    for case_counts in runs["run_outcomes"].values():
        counts.update(case_counts)
    commit = json.loads(Path(json_path).read_text())["commit"][:7]
    section = (f"{begin}\n`{os.path.basename(json_path)}` (commit {commit}): {runs['run_trials']} runs, "
               f"{counts['resumed_bit_exact']} resumed bit for bit, {counts['refused_named']} refused in one named line, "
               f"{counts['missed']} kills that came too late (still bit for bit), {counts['skipped']} skipped, "
               f"{runs['run_bad']} bad.\n\n{table}\n{end}")  # fmt: skip
    Path(doc).write_text(text[: text.index(begin)] + section + text[text.index(end) + len(end):])
    print(f"updated {doc}")


if __name__ == "__main__":
    main()
