"""What fits where, before anything is built: the planner.

    python -m fsdp_offload.plan model=1b offload=disk                   # this machine
    python -m fsdp_offload.plan model=70b offload=multipath offload.host_budget_gb=auto \\
        machine.ranks_per_node=8 machine.gpu_gib=80 machine.host_gib=1000    # an 8-GPU node

Takes the same Hydra recipes as train.py (an offload recipe: OffloadAdamW's state is what it places),
plus `machine.*` (MachineConfig: this machine unless stated; with train.device=auto, a stated
machine.gpu_gib > 0 is a CUDA run), and says, for each rank: where its FP32 state goes (GPU-resident
subgroups, host cache slots, each tier), the host memory beside it (grad staging, page-locked; the
FP32 grad buffer), the GPU memory (low-precision params, the resident state, start-up and training
estimates), the bytes a step moves through each tier, and the predicted update time; then the largest
preset that fits the same recipe.

The placement is computed by the functions the optimizer runs, so it is the placement the run
reports. The update time is a model: the busiest tier's I/O (from the tiers' speeds in the bandwidth
profile, measured when it lacks them, each shared by the node's ranks) against the update thread's
work, whichever is longer: the CPU kernel (`machine.cpu_mparams_per_s`; else the rate an earlier run's
steps on this host saved in the bandwidth profile; else the kernel timed here as the node's ranks run it,
side by side: update_rate.py) and beside it a fixed cost per subgroup and per tier read or write; plus
the grad norm once a step and the first read. The fixed costs are timed here on a real OffloadAdamW over
small subgroups (update_costs.py): most of a tiny model's update, a few percent of a large one's. A
plan that does not fit raises `PlanError` naming the level that is short and by how much; train.py runs
the same check before it builds the model.

This module is the command and the plan's text; machine.py reads the machine, node_plan.py plans.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys

import torch
from hydra.errors import HydraException

from .command_errors import did_you_mean, hydra_error_line
from .config import OffloadConfig
from .machine import (SHARED_FILE_SYSTEM_NOTE, TIER_FIELDS, MachineConfig, cpu_rate, planned_gpu_bytes, split_step_rate,
                      planned_host_bytes, tier_speeds, tiers_sharing_a_file_system)
from .step_memory import describe, plan_step_memory, step_overflow
from .models import MODEL_PRESETS, num_params, preset_name
from .node_plan import make_plan, optimizer_config, plan_speeds
from .plans import Plan, PlanError, RankPlan
from .recipe import read_config, read_host_memory
from .storage import TierError
from .units import GIB, SIZE_UNITS, format_count, format_seconds, parse_size, readable_size
from .update_costs import measured_costs


def split_rate_words(plan: Plan) -> str:
    """What the plan's split masters were predicted at ("" where no rank splits them)."""
    if not plan.splits:
        return ""
    if plan.split_cpu_mparams_per_s is None:
        return " (on split masters too: their step's rate is not known here)"
    source = f", {plan.split_cpu_rate_source}" if plan.split_cpu_rate_source else ""
    return f" ({plan.split_cpu_mparams_per_s:.0f} on split masters{source})"


def format_plan(plan: Plan, cfg: OffloadConfig) -> str:
    g = lambda n: f"{n / GIB:.1f}"  # noqa: E731
    # training on the CPU, the model's columns are host memory
    device = "GPU" if plan.gpu_bytes is not None else "model on the CPU"
    memory = f"GPU {g(plan.gpu_bytes)} GiB per rank" if plan.gpu_bytes is not None else "trains on the CPU"
    lines = [
        (f"{plan.model}: {format_count(plan.params)} params over {plan.world_size} rank(s); CPU update "
         f"{plan.cpu_mparams_per_s:.0f} M params/s per rank{split_rate_words(plan)}; {memory}, host {g(plan.host_bytes)} GiB "
         "for the node"),
        "",
        f"rank  params  subgroups  state GiB | {device}: subgroups GiB  params GiB  start-up~ train~ | host: staging "
        "cache(slots) GiB | " + "".join(f"{t}: placed sg, file GiB at most (read/written GiB a step) | " for t in cfg.tiers)
        + "update (io / kernel + fixed, + norm)",
    ]
    for r in plan.ranks:
        tiers = " | ".join(f"{t.subgroups} sg {g(t.bytes)} ({g(t.read_bytes_per_step)}/{g(t.written_bytes_per_step)})"
                           for t in r.tiers)  # fmt: skip
        lines.append(
            f"{r.rank:>4}  {format_count(r.params):>6}  {r.subgroups:>9}  {g(r.state_bytes):>9} | {r.gpu_subgroups:>13} "
            f"{g(r.gpu_state_bytes):>4}  {g(r.gpu_params_bytes):>10}  {g(r.gpu_startup_bytes):>9} {g(r.gpu_train_bytes):>6}"
            f" | {g(r.staging_bytes):>13} {g(r.cache_bytes)}({r.cache_slots})"
            + (f" | {tiers}" if tiers else "") + f" | {format_seconds(r.update_s)} ({format_seconds(r.io_s)} / {format_seconds(r.cpu_s)}"
            f" + {format_seconds(r.walk_s)}, + {format_seconds(r.step_s)}"
            + (f", + FP32 grads {format_seconds(r.grad_io_s)})" if r.grad_io_s else ")")
        )
    if cfg.micro_batches > 1:
        r = plan.ranks[0]
        where = "on the GPU (in train~)" if r.grad_accumulation == "gpu" else "in host memory (in the host columns' total)"
        lines.append(f"grad accumulation: {cfg.micro_batches} micro-batches summed in FP32 {where}, "
                     f"{(r.grad_sums_gpu_bytes + r.grad_sums_host_bytes) / GIB:.2f} GiB a rank (offload.grad_accumulation={cfg.grad_accumulation!r})")  # fmt: skip
    split = [r.rank for r in plan.ranks if r.split_masters]
    if split:  # (the kernel predicted at the split step's rate: the first line's)
        which = "every rank" if len(split) == len(plan.ranks) else "rank(s) " + ", ".join(map(str, split))
        lines.append(f"split masters on {which}: the subgroups off the GPU held as their masters' low halves, 10 bytes a "
                     f"param in the cache and on the tiers (offload.split_masters={cfg.split_masters!r})")  # fmt: skip
    if cfg.grad_path == "auto" and plan.ranks[0].grad_path == "gpu_bf16":
        lines.append("grad path: the low-precision grads wait for their update in GPU memory (offload.grad_path='auto': "
                     "their host memory goes to the cache, which would spill subgroups to the tiers otherwise)")  # fmt: skip
    budgets = sorted({(r.host_budget_bytes, r.budget_name) for r in plan.ranks if r.host_budget_bytes is not None})
    if budgets:  # as resolved for this node: "auto" says what it came to
        lines.append("host budget a rank: " + ", ".join(name if name.endswith(")") else f"{name} ({readable_size(nbytes)})"
                                                        for nbytes, name in budgets))  # fmt: skip
    lines.append(f"step: {describe(plan)} ({plan.step_memory_why})")
    if step_overflow(plan):
        lines.append(f"warning: {step_overflow(plan)}")
    lines.append(f"predicted update phase: {format_seconds(plan.predicted_update_s)} a step (~: estimates)")
    if plan.predicted_update_s is not None:  # what the prediction is made of
        costs = (f"fixed costs timed here ({plan.update_costs.describe()})" if plan.update_costs is not None
                 else "no fixed costs (not timed: the CPU rate is stated)")  # fmt: skip
        lines.append("  = the grad norm + the longer of the busiest tier's I/O and the update thread's work (the CPU kernel, "
                     f"params / rate, and beside it each subgroup's and each tier read's and write's fixed cost) + the first "
                     f"read nothing hides; {costs}")  # fmt: skip
    return "\n".join(lines)


def plan_summary(r: RankPlan, cfg: OffloadConfig) -> str:
    """One rank's placement in a line (train.py logs it before building the model)."""
    tiers = ", ".join(f"{t.subgroups} placed on {t.spec}" for t in r.tiers)  # (where each spills when out of the cache)
    return (f"rank {r.rank}: {r.subgroups} subgroups ({readable_size(r.state_bytes)} of FP32 state"
            + ("; held split off the GPU, 10 bytes a param" if r.split_masters else "") + f"): {r.gpu_subgroups} on the GPU"
            + f", {r.cache_slots} host cache slots" + (f", {tiers}" if tiers else "")
            + f"; host memory {readable_size(r.host_bytes)} (staging {readable_size(r.staging_bytes)}); grads {r.grad_path}"
            + (f"; {cfg.micro_batches} micro-batches summed in FP32 on the {'GPU' if r.grad_accumulation == 'gpu' else 'host'} "
               f"({readable_size(r.grad_sums_gpu_bytes + r.grad_sums_host_bytes)})" if cfg.micro_batches > 1 else ""))  # fmt: skip


def compose_plan_config(overrides: list[str]):
    """The train.py config composed from `overrides` (machine.* ones apart) and the MachineConfig (its host_gib,
    where not stated, train.host_memory_gb's)."""
    from hydra import compose, initialize_config_module

    from .config import register_recipe_resolvers

    register_recipe_resolvers()
    machine_kw = {}
    rest = []
    names = [f.name for f in dataclasses.fields(MachineConfig)]
    for o in overrides:
        if o.startswith("machine."):
            key, _, value = o[len("machine."):].partition("=")
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                raise ValueError(f"{o}: unknown machine option; known: {sorted(names)}"
                                 + (f"; did you mean machine.{close[0]}?" if close else ""))  # fmt: skip
            machine_kw[key] = machine_value(key, value)
        else:
            rest.append(o)
    with initialize_config_module("fsdp_offload.recipes", version_base="1.3"):
        cfg = compose("train", overrides=rest)
    stated = read_host_memory(cfg.train.host_memory_gb)
    if "host_gib" not in machine_kw and stated is not None:  # the train command's statement of the node's memory
        machine_kw["host_gib"] = stated / GIB
    return cfg, MachineConfig(**machine_kw)


def machine_value(key: str, value: str) -> int | float | list[float] | None:
    """A machine.* override's value: a whole number of ranks or nodes; GPU and host memory, and a tier's
    free space, in GiB or as a size ('80GB', '512GiB', as offload.host_budget_gb takes them); speeds as
    numbers; the tier_* ones a list, one per offload.tiers ('[2.0,12]'); null: this machine's."""
    if value in ("null", "None"):
        return None
    def gib(text: str) -> float:
        size, unit = parse_size(text)
        return size * SIZE_UNITS[unit] / GIB

    try:
        if key in ("ranks_per_node", "nodes"):
            return int(value)
        if key in ("gpu_gib", "host_gib"):
            return gib(value)
        if key in TIER_FIELDS:
            items = value.strip().removeprefix("[").removesuffix("]").split(",")
            return [gib(v) if key == "tier_free_gib" else float(v) for v in items]
        return float(value)
    except ValueError:
        kind, example = {"ranks_per_node": ("a whole number", "8"), "nodes": ("a whole number", "2"),
                         "gpu_gib": ("GiB or a size ('80GB', '96GiB')", "80"),
                         "host_gib": ("GiB or a size ('1000GB', '512GiB')", "1000"),
                         "tier_read_gbps": ("a list of GB/s, one per offload.tiers", "[2.0,12]"),
                         "tier_write_gbps": ("a list of GB/s, one per offload.tiers", "[2.6,10]"),
                         "tier_free_gib": ("a list of GiB or sizes, one per offload.tiers", "[3500,200GB]")}.get(key, ("a number", "500"))  # fmt: skip
        null = "" if key in ("ranks_per_node", "nodes") else " (null: measured on this machine)"
        raise ValueError(f"machine.{key}={value!r} must be {kind}{null}, e.g. machine.{key}={example}") from None


def target_device(train_device: str, machine: MachineConfig) -> str:
    """The device the planned run trains on: train.device, where 'auto' is the stated machine's choice
    (a GPU where machine.gpu_gib > 0, as train.py would find one there), else this machine's."""
    if train_device != "auto":
        return train_device
    if machine.gpu_gib is not None:
        return "cuda" if machine.gpu_gib > 0 else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def plan_from_config(cfg, machine: MachineConfig) -> tuple[Plan, OffloadConfig]:
    """The plan of a composed train.py config (its model, offload, data and train groups)."""
    train, args, data, recipe, _ = read_config(cfg)
    if recipe.optimizer != "offload":
        raise ValueError(
            f"offload.optimizer={recipe.optimizer!r} (offload=none: plain FSDP2 with torch AdamW, its 16 bytes a param "
            "on the device) is not what the planner plans: it places OffloadAdamW's state; choose an offload recipe "
            "(offload=host, disk or multipath)"
        )
    ocfg = recipe.config
    device = target_device(train.device, machine)
    planned_gpu_bytes(ocfg, machine, device)  # a GPU option without a GPU fails before anything is measured
    machine.check_tiers(ocfg.tiers)
    if machine.tier_free_gib is None:  # (read here: a dir of another machine's would get this one's free space)
        missing = [str(spec) for spec in ocfg.tier_specs if not os.path.isdir(spec.dir)]
        if missing:  # (planning for another machine: its tiers are stated, one entry per tier)
            unstated = " ".join(f"machine.{n}=[...]" for n in TIER_FIELDS if getattr(machine, n) is None)
            raise ValueError(f"offload.tiers {', '.join(missing)}: the dir does not exist on this machine, so what it holds cannot "
                             f"be read here (planning for another machine?); state its tiers: {unstated} (one entry per tier), or "
                             "make the dir")  # fmt: skip
    speeds = tier_speeds(ocfg, machine)
    planned = lambda costs, args, rate=None, split=None: make_plan(  # noqa: E731
        preset_name(args), args, ocfg, machine, data.seq_len, data.micro_batch, device, None if rate is None else rate.params_per_s, speeds,
        costs=costs, split_cpu_rate=None if split is None else split.params_per_s)  # fmt: skip
    # what the step keeps, from memory alone (nothing predicted yet): one that does not fit says so before
    # seconds of timing; one that writes no tier times none
    plan, args = plan_step_memory(args, lambda a: planned(None, a), ocfg.gpu_headroom_gb, micro_batches=train.micro_batches)
    ocfg = optimizer_config(ocfg, args)  # the optimizer's, as the plan has it (one grad a step where FSDP2 sums them)
    rate = cpu_rate(ocfg, machine, train.cpu_threads)  # (the kernel's rate for the grads it takes: bf16 or FP32 sums)
    # the split step's rate where a rank splits its masters (which does not depend on the rates: predicted again below)
    split = split_step_rate(ocfg, machine, train.cpu_threads) if plan.splits else None
    streams = any(t.read_bytes_per_step or t.written_bytes_per_step for r in plan.ranks for t in r.tiers)
    # the fixed costs beside the rate the kernel is predicted at: a timed one leaves out a call's cost, a learned one
    # holds it and may hold its run's walk (where only some ranks split, beside the whole step's)
    kernel_rate = split if split is not None and all(r.split_masters for r in plan.ranks) else rate
    costs = measured_costs(ocfg, machine, train.cpu_threads, kernel_rate, streams=streams)
    # the same plan, predicted with the rates and the fixed costs
    plan = dataclasses.replace(planned(costs, args, rate, split), step_memory_why=plan.step_memory_why)
    plan.cpu_rate_source, plan.cpu_rate_detail = rate.source, rate.detail
    plan.split_cpu_rate_source, plan.split_cpu_rate_detail = (split.source, split.detail) if split else (None, "")
    return plan, ocfg


def largest_for(cfg, machine: MachineConfig, speeds: list | None = None) -> str | None:
    """The largest preset that fits a composed config's recipe on `machine` (None: not even the smallest),
    up to the first that does not (every level's need grows with the size). `auto` activation
    checkpointing, resharding and grad sums are planned as the frugal step (a run resolves them to what fits)."""
    train, step, data, recipe, _ = read_config(cfg)
    speeds, device, best = plan_speeds(recipe.config, speeds), target_device(train.device, machine), None  # speeds once
    for name, args in sorted(MODEL_PRESETS.items(), key=lambda kv: num_params(kv[1])):
        args = dataclasses.replace(args, activation_checkpointing=step.activation_checkpointing is not False,
                                   reshard_after_forward=step.reshard_after_forward is not False,
                                   sum_grads_unsharded=step.sum_grads_unsharded is True)
        try:
            make_plan(name, args, recipe.config, machine, data.seq_len, data.micro_batch, device, speeds=speeds)
        except PlanError:
            break
        best = name
    return best


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        cfg, machine = compose_plan_config(argv)
        plan, ocfg = plan_from_config(cfg, machine)
    except PlanError as exc:
        print(f"does not fit: {exc}", file=sys.stderr)
        print(f"largest preset that fits this recipe and machine: {largest_for(cfg, machine) or 'none'}", file=sys.stderr)
        return 2
    except HydraException as exc:  # a recipe or an option that is not there, an override that does not parse
        machine_keys = [f.name for f in dataclasses.fields(MachineConfig)]
        print(f"error: {hydra_error_line(exc)}{did_you_mean(exc, argv, {'machine': machine_keys})}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, TierError) as exc:  # a bad option, or a tier dir that is not there
        missing = isinstance(exc, TierError) and "does not exist" in str(exc)  # a tier dir not on this machine
        other = " (planning for another machine whose dirs are not here? state its tiers: machine.tier_read_gbps, " \
                "machine.tier_write_gbps and machine.tier_free_gib, one per tier)" if missing else ""  # fmt: skip
        print(f"error: {exc}{other}", file=sys.stderr)
        return 2
    print(format_plan(plan, ocfg))
    budget, host = ocfg.host_budget, planned_host_bytes(machine)
    if not budget.auto and budget.nbytes is not None and budget.nbytes * machine.ranks_per_node > host:
        print(f"note: {budget.option} over {machine.ranks_per_node} rank(s) is {readable_size(budget.nbytes * machine.ranks_per_node)}, "
              f"more than the {readable_size(host)} of host memory planned for; it fits because the ranks take only what "
              f"their state needs ({readable_size(sum(r.host_bytes for r in plan.ranks))} for the node)")  # fmt: skip
    if plan.cpu_rate_source == "learned":
        print(f"CPU update rate: learned from an earlier run's steps on this host ({plan.cpu_rate_detail})")
    elif plan.cpu_rate_source == "timed":  # a rented machine's update needs that machine's rate
        print(f"CPU update rate: timed on this machine ({os.cpu_count()} cores) as the node's ranks run it; for "
              "another machine, state its rate a rank: machine.cpu_mparams_per_s=<M params/s>")  # fmt: skip
        if plan.cpu_rate_detail:
            print(f"  {plan.cpu_rate_detail}")
    if plan.split_cpu_rate_detail:  # (learned: the run it came from; timed: what would give a learned one)
        print(f"CPU update rate on split masters, {plan.split_cpu_rate_source}: {plan.split_cpu_rate_detail}")
    if machine.tier_read_gbps is None and all(os.path.isdir(spec.dir) for spec in ocfg.tier_specs):  # measured here
        for shared in tiers_sharing_a_file_system(ocfg.tier_specs):
            print(f"note: offload.tiers {' and '.join(shared)} {SHARED_FILE_SYSTEM_NOTE}")
    unstated = [n for n in TIER_FIELDS if getattr(machine, n) is None] if ocfg.tiers else []
    if unstated:  # a rented machine's disk is not this one's (read and write speeds are stated together)
        speeds = "speeds" if ocfg.bandwidth_profile is None else f"speeds (from offload.bandwidth_profile={ocfg.bandwidth_profile} where it has them)"
        what = " and ".join(w for w, n in ((speeds, "tier_read_gbps"), ("free space", "tier_free_gib")) if n in unstated)
        print(f"tiers: {what} of the given dirs on this machine; for another machine, state them, one per tier: "
              f"{' '.join(f'machine.{n}=[...]' for n in unstated)} (GB/s; GiB)")  # fmt: skip
    print(f"largest preset that fits this recipe and machine: {largest_for(cfg, machine, plan.tier_speeds) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
