"""`model.activation_checkpointing: auto`, resolved once at the entry (train.py, the plan CLI) before the
model is built: recompute each block's forward in backward only where the device cannot hold the
step's activations.

Checkpointing costs a second forward inside every backward: on nvidia-h100-x4, the 1.35B at seq 2048
ran its 4-rank step in 0.43-0.44 s without it against 0.50-0.58 s with it
(`bench_scale_nvidia-h200-x4_20261127-021724.json`). It saves the activations of every block but its
input, which a big model or a long sequence needs. So `auto` keeps it off only where, without it:
- the plan still fits (on the CPU the step's activations are host memory the plan counts);
- on a GPU, every rank's estimated step peak stays under its memory less `offload.gpu_headroom_gb`;
- the optimizer's state is placed as with checkpointing: the same subgroups on the GPU, host cache
  slots, grad path, grad sums and tier traffic (`offload.gpu_fraction=auto` and `grad_path=auto` size
  themselves from the room the step leaves on the GPU).
A job's ranks take one answer: checkpointing is on for all where any rank needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from .models import LlamaArgs
from .node_plan import ModelShapes, Plan, PlanError, train_gpu_bytes
from .units import GIB, readable_size


def resolved(args: LlamaArgs, checkpointing: bool) -> LlamaArgs:
    return dataclasses.replace(args, activation_checkpointing=checkpointing)


def set_why(args: LlamaArgs) -> str:
    """The reason a stated (not "auto") choice gives."""
    return f"set: model.activation_checkpointing={str(args.activation_checkpointing).lower()}"


def state_placement(plan: Plan) -> list[tuple]:
    """Where a plan keeps the optimizer's state and grads and what it moves, rank by rank: what turning
    checkpointing off must leave as it is."""
    return [(r.gpu_subgroups, r.cache_slots, r.grad_path, r.grad_accumulation,
             [(t.subgroups, t.read_bytes_per_step, t.written_bytes_per_step) for t in r.tiers]) for r in plan.ranks]  # fmt: skip


def any_rank(value: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True on every rank where it is True on any (one collective; `device`: the group's backend's)."""
    if group is None:
        return value
    flag = torch.tensor([int(value)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def plan_checkpointing(args: LlamaArgs, make: Callable[[LlamaArgs], Plan], headroom_gb: float,
                       agree: Callable[[bool], bool] = lambda on: on) -> tuple[Plan, LlamaArgs]:  # fmt: skip
    """The plan `make` gives for `args`, and `args` with activation checkpointing resolved: as set, or
    for 'auto' off where the plan without it places the state alike and fits (see the module's note);
    `agree` makes the job's ranks' answers one (train.py: any_rank). The plan says why
    (`checkpointing_why`). A plan that does not fit even with checkpointing raises its PlanError."""
    if args.activation_checkpointing != "auto":
        plan = make(args)
        plan.checkpointing_why = set_why(args)
        return plan, args
    on = make(resolved(args, True))
    try:
        off = make(resolved(args, False))
        needed, why = needs_checkpointing(on, off, headroom_gb)
    except PlanError as exc:  # the step's activations take the host memory the state needs (a run on the CPU)
        off, needed, why = None, True, f"without it the plan does not fit: {exc}"
    agreed = agree(needed)
    if agreed and not needed:
        why = "another rank needs it"
    plan = on if agreed else off
    plan.checkpointing_why = f"auto: {why}"
    return plan, resolved(args, agreed)


def needs_checkpointing(on: Plan, off: Plan, headroom_gb: float) -> tuple[bool, str]:
    """Whether the plan without checkpointing (`off`, which fits) would not do on a GPU beside `on`, the
    plan with it, and why (see the module's note)."""
    if off.gpu_bytes is None:
        return False, "host memory holds the step without it, the state placed alike"
    room, step = off.gpu_bytes - int(headroom_gb * GIB), max(r.gpu_train_bytes for r in off.ranks)
    if step > room:
        return True, (f"without it a rank's step would take about {readable_size(step)}, above the GPU's "
                      f"{readable_size(off.gpu_bytes)} less offload.gpu_headroom_gb={headroom_gb:g}")  # fmt: skip
    if state_placement(off) != state_placement(on):
        return True, f"without it {placement_change(on, off)}"
    return False, f"the GPU holds the step without it (about {readable_size(step)} a rank of {readable_size(off.gpu_bytes)}), the state placed alike"


def placement_change(on: Plan, off: Plan) -> str:
    """What the plan without checkpointing (`off`) moves, against `on`: the first rank's first change."""
    names = ("subgroups on the GPU", "host cache slots", "grad path", "grad sums' place", "tier GiB a step")
    for rank, a, b in zip(on.ranks, state_placement(on), state_placement(off)):
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
    fix = "" if plan.activation_checkpointing else ", or set model.activation_checkpointing=auto"
    return (f"rank {worst.rank}'s training step is estimated at {readable_size(worst.gpu_train_bytes)} of GPU memory, above "
            f"the GPU's {readable_size(plan.gpu_bytes)}: lower data.micro_batch or data.seq_len, or offload.gpu_fraction{fix}")


def fsdp_checkpointing(args: LlamaArgs, step_bytes: Callable[[LlamaArgs], int], room_bytes: int,
                       agree: Callable[[bool], bool] = lambda on: on) -> tuple[LlamaArgs, str]:  # fmt: skip
    """`args` resolved for plain FSDP2 (torch AdamW, no planner), and why: 'auto' is off where `step_bytes`
    (a rank's estimated peak: its state, params, grads and activations) without checkpointing fits in
    `room_bytes` (the GPU's memory less its headroom; on the CPU, the host memory available to the rank)."""
    if args.activation_checkpointing != "auto":
        return args, set_why(args)
    step = step_bytes(resolved(args, False))
    needed = agree(step > room_bytes)
    where = f"about {readable_size(step)} a rank without it, {readable_size(room_bytes)} of room"
    why = where if needed == (step > room_bytes) else "another rank needs it"
    return resolved(args, needed), f"auto: {why}"


def fsdp_step_bytes(args: LlamaArgs, world: int, seq_len: int, micro_batch: int) -> int:
    """A plain FSDP2 rank's estimated peak: its shard's FP32 params, grads and Adam moments (16 bytes a
    param) and the bf16 step beside them (node_plan.train_gpu_bytes)."""
    shapes = ModelShapes.of(args)
    local = sum(shapes.local_numels(world, 0))
    return 16 * local + train_gpu_bytes(args, shapes, local, seq_len, micro_batch, itemsize=2)
