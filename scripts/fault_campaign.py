"""Fault campaign: many random fault schedules injected into a tier while OffloadAdamW trains, each
run checked against torch AdamW; one JSON of outcomes per fault kind.

A trial trains a small set of params (11 subgroups, 3 in host memory, the rest on a POSIX tier under
--dir) for --steps steps, with one fault schedule (storage/faults.py: EIO or ENOSPC on a read or a
write, a latency spike, a torn write, a bit flip or truncation of the file, a tier that vanishes) at a
random point. A step that raises is retried up to twice (as a training loop that catches the error would).
Each trial ends in one outcome:

  exact            no error surfaced, or the retry finished the step, and every master, moment and
                   step count equals torch AdamW's, bit for bit (nothing was lost)
  detected         a step failed with an error naming the tier's file (damaged data, a vanished
                   tier): the last good checkpoint is the recovery point
  silent_corruption  the run finished without an error and the state differs: must never happen
  hang             a step outlived --step-timeout-s: must never happen
  undetected_error an error that names neither the subgroup nor the file: must never happen

    python scripts/fault_campaign.py --trials 200 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import random
import shutil
import tempfile
import time

import torch

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.results import record
from fsdp_offload.storage import TierError
from fsdp_offload.storage.faults import Fault, FaultyTier

SHAPES = [(300, 37), (513,), (1000, 29), (7,), (2500,)]  # 43_120 elements over 11 subgroups of 4096
SUBGROUP = 4096
CACHED = 3
KINDS = ("eio_write", "eio_read", "enospc_write", "enospc_read", "latency", "torn_write", "bitflip", "truncate", "vanish")


def make_pair(root: str, seed: int) -> tuple[OffloadAdamW, torch.optim.AdamW, list, list]:
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    staging = 2 * (10 * SUBGROUP + 3072)
    budget = (staging + CACHED * 3 * SUBGROUP * 4) / 2**30
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{root}"], subgroup_numel=SUBGROUP, host_budget_gb=budget)
    return OffloadAdamW(mine, lr=1e-2, weight_decay=0.1, offload=cfg), torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False), mine, ref


def same_as_reference(opt: OffloadAdamW, ref_opt: torch.optim.AdamW, ref: list) -> bool:
    state = opt.state_dict()["state"]
    return all(
        torch.equal(state[i]["master_param"], r.data)
        and torch.equal(state[i]["exp_avg"], ref_opt.state[r]["exp_avg"])
        and torch.equal(state[i]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
        and int(state[i]["step"]) == int(ref_opt.state[r]["step"])
        for i, r in enumerate(ref)
    )


def schedule(kind: str, rng: random.Random) -> tuple[list[Fault], str | None]:
    """The faults of one trial, and the damage to do to the file after the first step (if any)."""
    after = rng.randrange(0, 12)
    if kind in ("bitflip", "truncate"):
        return [], kind
    if kind == "latency":
        return [Fault("latency", op=op, after=after, times=rng.randrange(1, 6), delay_s=rng.uniform(0.001, 0.05)) for op in ("read", "write")], None
    if kind == "torn_write":
        return [Fault("torn_write", after=after, times=1)], None
    if kind == "vanish":
        return [Fault("vanish", op=rng.choice(("read", "write")), after=after)], None
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
        try:  # reads every stored subgroup back: damage no step read yet is found here
            exact = same_as_reference(opt, ref_opt, ref)
        except Exception as exc:  # noqa: BLE001 - classified as a step's error is
            out["errors"].append(f"{type(exc).__name__}: {exc}")
            out["outcome"] = "detected" if names_the_fault(out["errors"][-1], tier) else "undetected_error"
            return out
        out["outcome"] = "exact" if exact else "silent_corruption"
        return out
    finally:
        out["injected"] = tier.injected
        try:
            opt.close()
        except (OSError, TierError):
            pass
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=180, help="trials in all, dealt round-robin over the fault kinds")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the trials' tier dirs go")
    ap.add_argument("--step-timeout-s", type=float, default=60.0)
    ap.add_argument("--device-kind", default="cpu")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.trials < 1 or args.steps < 2:
        ap.error("--trials must be >= 1 and --steps >= 2 (damage lands after the first step)")

    started = time.perf_counter()
    results = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # steps run here so a hang is caught, not waited on
        for i in range(args.trials):
            results.append(trial(KINDS[i % len(KINDS)], args.seed * 100_000 + i, args, pool))
            if results[-1]["outcome"] == "hang":
                break  # the hung step holds the worker: report what ran
    counts = {k: collections.Counter(r["outcome"] for r in results if r["kind"] == k) for k in KINDS}
    bad = sum(c[o] for c in counts.values() for o in ("silent_corruption", "hang", "undetected_error"))
    path = record("fault_campaign", args.device_kind, args.out, {
        "trials": len(results), "steps": args.steps, "seed": args.seed, "wall_s": time.perf_counter() - started,
        "outcomes": {k: dict(c) for k, c in counts.items()}, "bad": bad,
        "examples": {k: next((r["errors"][-1] for r in results if r["kind"] == k and r["errors"]), None) for k in KINDS},
        "trials_detail": results,
    })  # fmt: skip
    print(f"{'fault':<14} {'exact':>6} {'detected':>9} {'silent':>7} {'hang':>5} {'unnamed':>8}")
    for k, c in counts.items():
        print(f"{k:<14} {c['exact']:>6} {c['detected']:>9} {c['silent_corruption']:>7} {c['hang']:>5} {c['undetected_error']:>8}")
    print(f"{len(results)} trials, {bad} bad; wrote {path}")


if __name__ == "__main__":
    main()
