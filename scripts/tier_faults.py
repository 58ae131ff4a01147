"""The fault campaign's tier trials (scripts/fault_campaign.py --trials N), in the campaign's own
process: a small set of params (11 subgroups, 3 in host memory, the rest on a `posix:` or `kvikio:`
tier under --dir; the params on the CPU) trains for --steps steps with one fault schedule
(storage/faults.py) at a random point of one place (the update, a checkpoint save, a checkpoint load
into a fresh optimizer on another tier dir), against torch AdamW. See fault_campaign.py for the
outcomes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import shutil
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.dcp_reader import SafeFileSystemReader
from fsdp_offload.optimizer_state import OffloadOptimizerState, StreamingLoadPlanner, StreamingSavePlanner
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


def make_optimizer(tier: str, params: list) -> OffloadAdamW:
    """OffloadAdamW over `params`, 3 subgroups in host memory, the rest on `tier` (a spec)."""
    staging = 2 * (10 * SUBGROUP + 3072)
    budget = (staging + CACHED * 3 * SUBGROUP * 4) / 2**30
    cfg = OffloadConfig(kernel="torch", tiers=[tier], subgroup_numel=SUBGROUP, host_budget_gb=budget)
    return OffloadAdamW(params, lr=1e-2, weight_decay=0.1, offload=cfg)


def make_pair(tier: str, seed: int) -> tuple[OffloadAdamW, torch.optim.AdamW, list, list]:
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    return make_optimizer(tier, mine), torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False), mine, ref


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
    opt, ref_opt, mine, ref = make_pair(f"{args.tier_scheme}:{root}", seed)
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
    opt, ref_opt, mine, ref = make_pair(f"{args.tier_scheme}:{roots[0]}", seed)
    fresh_params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    fresh = make_optimizer(f"{args.tier_scheme}:{roots[1]}", fresh_params)
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


# every (place, fault kind) a trial can be: trial i is CELLS[i % len(CELLS)]
CELLS = [("update", k) for k in KINDS] + [(p, k) for p in PLACES[1:] for k in CHECKPOINT_KINDS[p]]


def run_trial(i: int, args: argparse.Namespace, pool: concurrent.futures.ThreadPoolExecutor) -> dict:
    """Tier trial `i` (its cell and seed from `i` and --seed); its record row."""
    place, kind = CELLS[i % len(CELLS)]
    seed = args.seed * 100_000 + i
    row = trial(kind, seed, args, pool) if place == "update" else checkpoint_trial(kind, place, seed, args)
    row["place"] = place
    return row
