"""What a training step keeps on its device, resolved once at the entry (train.py, the plan CLI) before
the model is built: every block's activations (`model.activation_checkpointing`, off keeps them), every
FSDP unit's gathered params (`model.reshard_after_forward`, false keeps them) and, with several
micro-batches a step, their grads summed unsharded in FP32 (`model.sum_grads_unsharded`, true keeps
them: one reduce-scatter a unit a step, not one a micro-batch). Each may be `auto`, every preset's default.

Keeping them saves work where the device has the room (the 1.35B at seq 2048, micro-batch 1, all
state in host memory, 4 ranks):
- the activations: no second forward inside backward; on 4 H100s the step took 0.43-0.44 s against
  0.50-0.58 s with checkpointing on (session 26, `bench_scale_nvidia-h200-x4_20261127-021724.json`);
- the gathered units: no second all-gather a unit in backward; on 4 H200s 0.349-0.350 s against
  0.386-0.399 s resharded, the backward 0.114-0.120 s against 0.137-0.151 s (session 28,
  `bench_scale_nvidia-h200-x4_20261127-063152.json`).

`auto` takes the first of these that keeps what is asked of it:
  1. the activations and the gathered units kept;
  2. the activations kept, the units resharded;
  3. the activations recomputed, the gathered units kept;
  4. neither kept (the frugal step: checkpointing on, units resharded);
each first with the unsharded grad sums, then without (FSDP2's reduce-scatter a unit a micro-batch is what
made a step at 4 ranks slower than at 1: docs/benchmarks.md, session 37).
An option is kept only where the plan with it still fits (on the CPU the step is host memory the plan
counts), on a GPU every rank's estimated step stays under its memory less `offload.gpu_headroom_gb`,
and the optimizer's state is placed as with the frugal step: the same subgroups on the GPU, host cache
slots, grad path, grad sums and tier traffic. (With the unsharded sums the optimizer takes one grad a
step and keeps no sums of its own: such an option is held to the frugal step planned that way, and keeps
every subgroup the frugal step has on the GPU and in the host cache, at no more tier bytes.) A stated
value is kept as stated. A job's ranks take one answer: where they differ, the frugal step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from .models import LlamaArgs
from .models.llama import STEP_CHOICES
from .node_plan import ModelShapes, train_gpu_bytes
from .plan_fit import frugal_step_fix
from .plans import Plan, PlanError
from .units import GIB, readable_size

# (activation_checkpointing, reshard_after_forward), the most the step keeps on its device first
PREFERENCE = ((False, False), (False, True), (True, False), (True, True))


def resolved(args: LlamaArgs, checkpointing: bool, reshard: bool, sums: bool = False) -> LlamaArgs:
    return dataclasses.replace(args, activation_checkpointing=checkpointing, reshard_after_forward=reshard, sum_grads_unsharded=sums)


def options(args: LlamaArgs, micro_batches: int = 1) -> list[LlamaArgs]:
    """`args` resolved every way its `auto`s allow, in PREFERENCE order, each with the unsharded grad sums
    first where a step has several micro-batches to sum: the last is the frugal step."""
    stated = lambda value, choice: value == "auto" or value is choice  # noqa: E731
    sums = (True, False) if micro_batches > 1 or args.sum_grads_unsharded is True else (False,)
    return [resolved(args, c, r, g) for c, r in PREFERENCE for g in sums
            if stated(args.activation_checkpointing, c) and stated(args.reshard_after_forward, r) and stated(args.sum_grads_unsharded, g)]  # fmt: skip


def describe(args: LlamaArgs | Plan) -> str:
    """A resolved step (a model's args or the plan of them) in words, as the run's log and the plan say it."""
    units = "units resharded after forward" if args.reshard_after_forward else "units kept gathered from forward to backward"
    sums = ", micro-batch grads summed unsharded in FP32 (one reduce-scatter a step)" if args.sum_grads_unsharded else ""
    return f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}, {units}{sums}"


def kept(args: LlamaArgs, frugal: LlamaArgs) -> str:
    """What step `args` keeps on its device that the frugal step does not."""
    held = [name for name, more in (("the activations", args.activation_checkpointing != frugal.activation_checkpointing),
                                    ("the gathered units", args.reshard_after_forward != frugal.reshard_after_forward),
                                    ("the unsharded grad sums", args.sum_grads_unsharded != frugal.sum_grads_unsharded)) if more]  # fmt: skip
    return ", ".join(held[:-1]) + " and " + held[-1] if len(held) > 1 else "".join(held)


def stated_why(args: LlamaArgs, micro_batches: int) -> str:
    """What of `args` was stated, not `auto`, as the reason gives it ("" where none is stated; the grad
    sums left unsaid where a step of one micro-batch has none to sum)."""
    stated = [f"model.{name}={str(getattr(args, name)).lower()}" for name in STEP_CHOICES if getattr(args, name) != "auto"
              and (name != "sum_grads_unsharded" or micro_batches > 1 or args.sum_grads_unsharded is True)]  # fmt: skip
    return f"set: {', '.join(stated)}" if stated else ""


def auto_why(args: LlamaArgs, micro_batches: int, reasons: list[str]) -> str:
    """The reason an `auto` resolution gives: what was stated beside it, then why."""
    return "; ".join(filter(None, (stated_why(args, micro_batches), "auto: " + "; ".join(reasons))))


def state_placement(plan: Plan) -> list[tuple]:
    """Where a plan keeps the optimizer's state and grads and what it moves, rank by rank: what keeping
    more of the step on the device must leave as it is."""
    return [(r.gpu_subgroups, r.cache_slots, r.grad_path, r.grad_accumulation,
             [(t.subgroups, t.read_bytes_per_step, t.written_bytes_per_step) for t in r.tiers]) for r in plan.ranks]  # fmt: skip


def same_on_every_rank(choice: int, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether every rank of `group` has `choice` (one collective; `device`: the group's backend's)."""
    if group is None:
        return True
    both = torch.tensor([choice, -choice], device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return int(both[0]) == -int(both[1])


def raise_if_short(short: PlanError | None) -> None:
    """plan_step_memory's `settle` for one process: its own PlanError raised."""
    if short is not None:
        raise short


def plan_step_memory(args: LlamaArgs, make: Callable[[LlamaArgs], Plan], headroom_gb: float,
                     agree: Callable[[int], bool] = lambda choice: True,
                     settle: Callable[[PlanError | None], None] = raise_if_short, micro_batches: int = 1) -> tuple[Plan, LlamaArgs]:  # fmt: skip
    """The plan `make` gives for `args` with its `auto`s resolved (see the module's note), and those
    args (`make`: node_plan.make_plan's, which plans the optimizer as `optimizer_config` says).
    `agree(choice)` says whether the job's ranks all made this one (train.py: same_on_every_rank), else
    they take the frugal step. The plan says
    why (`step_memory_why`). Where even the frugal step does not fit, its PlanError goes to `settle` (None
    where it fits), first: train.py raises one rank's on every rank, since a node's own free space or
    memory may leave the others' plans fitting. `micro_batches`: the backwards a step (train.micro_batches)."""
    choices = options(args, micro_batches)
    frugal_args = choices[-1]
    try:
        frugal, short = make(frugal_args), None
    except PlanError as exc:
        short = exc
    settle(short)
    if len(choices) == 1:
        frugal.step_memory_why = stated_why(args, micro_batches)
        return frugal, frugal_args
    mine, plan, reasons = len(choices) - 1, frugal, []
    held_to = {frugal_args.sum_grads_unsharded: frugal}  # the frugal step, planned with the optimizer summing or not
    for i, option in enumerate(choices[:-1]):
        what = kept(option, frugal_args)
        try:
            kept_plan = make(option)
            sums = option.sum_grads_unsharded
            if sums not in held_to:
                held_to[sums] = make(dataclasses.replace(frugal_args, sum_grads_unsharded=sums))
            # the sums' own bytes may not move state off the frugal step's places; the rest, placed as with it
            reason = gpu_overflow(kept_plan, headroom_gb) or (state_lost(frugal, kept_plan) if sums != frugal_args.sum_grads_unsharded
                                                              else None) or refusal(held_to[sums], kept_plan, headroom_gb)  # fmt: skip
        except PlanError as exc:  # the step takes the host memory the state needs (a run on the CPU)
            # (its advice to set the options to auto, which they are, left out)
            reason = "the plan does not fit: " + str(exc).replace(f", or {frugal_step_fix(option)}", "")
        if reason is None:
            mine, plan = i, kept_plan
            reasons.append(holds(plan, what, "at least as near" if sums != frugal_args.sum_grads_unsharded else "as"))
            break
        reasons.append(f"keeping {what}, {reason}")
    else:
        reasons.append("so none of it is kept")
    if not agree(mine):
        mine, plan, reasons = len(choices) - 1, frugal, ["the ranks differ: none of it is kept"]
    plan.step_memory_why = auto_why(args, micro_batches, reasons)
    return plan, choices[mine]


def refusal(frugal: Plan, plan: Plan, headroom_gb: float) -> str | None:
    """Why `plan` (which fits) would not do beside `frugal`, the frugal step's plan: its step above the
    GPU's room, or the optimizer's state placed otherwise; None: it does."""
    if gpu_overflow(plan, headroom_gb) is not None:
        return gpu_overflow(plan, headroom_gb)
    if state_placement(plan) != state_placement(frugal):
        return placement_change(frugal, plan)
    return None


def gpu_overflow(plan: Plan, headroom_gb: float) -> str | None:
    """Where a rank's estimated step is above its GPU's room (its memory less the headroom), said; else None."""
    if plan.gpu_bytes is None:
        return None
    room, step = plan.gpu_bytes - int(headroom_gb * GIB), max(r.gpu_train_bytes for r in plan.ranks)
    if step > room:
        return (f"a rank's step would take about {readable_size(step)}, above the GPU's {readable_size(plan.gpu_bytes)} "
                f"less offload.gpu_headroom_gb={headroom_gb:g}")  # fmt: skip
    return None


def state_lost(frugal: Plan, plan: Plan) -> str | None:
    """Where `plan` (whose optimizer takes one grad a step, the sums FSDP2's) keeps less of the optimizer's
    state near it than `frugal` (whose optimizer sums the micro-batches): a subgroup off the GPU, fewer in
    GPU or host memory, or more tier bytes a step, the first rank's first (None: it keeps as much; a grad
    path moved is let be where none of these is worse)."""
    tier = lambda r: sum(t.read_bytes_per_step + t.written_bytes_per_step for t in r.tiers) / GIB  # noqa: E731
    for a, b in zip(frugal.ranks, plan.ranks):
        if b.gpu_subgroups < a.gpu_subgroups:
            return f"rank {b.rank}'s subgroups on the GPU would go from {a.gpu_subgroups} to {b.gpu_subgroups}"
        if b.gpu_subgroups + b.cache_slots < a.gpu_subgroups + a.cache_slots:
            return (f"rank {b.rank}'s subgroups in GPU or host memory would go from {a.gpu_subgroups + a.cache_slots} "
                    f"to {b.gpu_subgroups + b.cache_slots}")  # fmt: skip
        if tier(b) > tier(a):
            return f"rank {b.rank}'s tier GiB a step would go from {tier(a):.2f} to {tier(b):.2f}"
    return None


def holds(plan: Plan, what: str, placed: str = "as") -> str:
    """Why a kept option was taken; `placed`: how its optimizer's state stands to the frugal step's ("as",
    or "at least as near" where the sums moved the optimizer's own sums off)."""
    if plan.gpu_bytes is None:
        return f"host memory holds the step keeping {what}, the optimizer's state placed {placed} without them"
    step = max(r.gpu_train_bytes for r in plan.ranks)
    return (f"the GPU holds the step keeping {what} (about {readable_size(step)} a rank of {readable_size(plan.gpu_bytes)}), "
            f"the optimizer's state placed {placed} without them")  # fmt: skip


def placement_change(frugal: Plan, plan: Plan) -> str:
    """What `plan` moves against the frugal step's: the first rank's first change."""
    names = ("subgroups on the GPU", "host cache slots", "grad path", "grad sums' place", "tier GiB a step")
    for rank, a, b in zip(frugal.ranks, state_placement(frugal), state_placement(plan)):
        for name, x, y in zip(names, a, b):
            if name == "tier GiB a step":
                x, y = (f"{sum(r + w for _, r, w in t) / GIB:.2f}" for t in (x, y))
            if x != y:
                return f"rank {rank.rank}'s {name} would go from {x} to {y}"
    return "the state would be placed otherwise"


def step_overflow(plan: Plan) -> str | None:
    """A warning where a rank's estimated step is above its GPU's memory (an estimate: never refused on)."""
    if plan.gpu_bytes is None:
        return None
    worst = max(plan.ranks, key=lambda r: r.gpu_train_bytes)
    if worst.gpu_train_bytes <= plan.gpu_bytes:
        return None
    fix = f", or {frugal_step_fix(plan)}" if frugal_step_fix(plan) else ""
    return (f"rank {worst.rank}'s training step is estimated at {readable_size(worst.gpu_train_bytes)} of GPU memory, above "
            f"the GPU's {readable_size(plan.gpu_bytes)}: lower data.micro_batch or data.seq_len, or offload.gpu_fraction{fix}")


def fsdp_step_memory(args: LlamaArgs, step_bytes: Callable[[LlamaArgs], int], room_bytes: int,
                     agree: Callable[[int], bool] = lambda choice: True, micro_batches: int = 1) -> tuple[LlamaArgs, str]:  # fmt: skip
    """`args` resolved for plain FSDP2 (torch AdamW, no planner), and why: the first option (module
    note) whose `step_bytes` (a rank's estimated peak: its state, params, grads and step) fits in
    `room_bytes` (the GPU's memory less its headroom; on the CPU, the host memory available to the rank);
    the frugal step where the job's ranks chose otherwise (`agree`, as plan_step_memory's)."""
    choices = options(args, micro_batches)
    if len(choices) == 1:
        return choices[0], stated_why(args, micro_batches)
    frugal = choices[-1]
    mine = next((i for i, a in enumerate(choices[:-1]) if step_bytes(a) <= room_bytes), len(choices) - 1)
    if not agree(mine):
        return frugal, auto_why(args, micro_batches, ["the ranks differ: none of it is kept"])
    room = readable_size(room_bytes)
    if mine < len(choices) - 1:
        return choices[mine], auto_why(args, micro_batches, [f"about {readable_size(step_bytes(choices[mine]))} a rank keeping "
                                              f"{kept(choices[mine], frugal)}, {room} of room"])  # fmt: skip
    least = choices[-2]  # the option that keeps least
    return frugal, auto_why(args, micro_batches, [f"keeping {kept(least, frugal)} would take about {readable_size(step_bytes(least))} a rank, "
                                   f"above {room} of room; so none of it is kept"])  # fmt: skip


def fsdp_step_bytes(args: LlamaArgs, world: int, seq_len: int, micro_batch: int) -> int:
    """A plain FSDP2 rank's estimated peak: its shard's FP32 params, grads and Adam moments (16 bytes a
    param) and the bf16 step beside them (node_plan.train_gpu_bytes, with the unsharded grad sums)."""
    shapes = ModelShapes.of(args)
    local = sum(shapes.local_numels(world, 0))
    return 16 * local + train_gpu_bytes(args, shapes, local, seq_len, micro_batch, itemsize=2)
