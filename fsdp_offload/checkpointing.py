"""`model.activation_checkpointing: auto`, resolved once at the entry (train.py, the plan CLI) before the
model is built: recompute each block's forward in backward only where the device cannot hold the
step's activations.

Checkpointing costs a second forward inside every backward: on nvidia-h100-x4, the 1.35B at seq 2048
ran its 4-rank step in 0.43-0.44 s without it against 0.54-0.58 s with it
(`bench_scale_nvidia-h200-x4_20261127-021724.json`). It saves the activations of every block but its
input, which a big model or a long sequence needs. So `auto` keeps it off only where, without it:
- the plan still fits (on the CPU the step's activations are host memory the plan counts);
- on a GPU, every rank's estimated step peak stays under its memory less `offload.gpu_headroom_gb`;
- no optimizer state leaves the GPU for it: the plan keeps as many subgroups there as with checkpointing
  (`offload.gpu_fraction=auto` sizes the GPU's share from the room the step leaves).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .models import LlamaArgs
from .node_plan import ModelShapes, Plan, PlanError, train_gpu_bytes
from .units import GIB


def resolved(args: LlamaArgs, checkpointing: bool) -> LlamaArgs:
    return dataclasses.replace(args, activation_checkpointing=checkpointing)


def plan_checkpointing(args: LlamaArgs, make: Callable[[LlamaArgs], Plan], headroom_gb: float) -> tuple[Plan, LlamaArgs]:
    """The plan `make` gives for `args`, and `args` with activation checkpointing resolved: as set, or
    for 'auto' off where the plan without it keeps the device's state and fits (see the module's note).
    A plan that does not fit even with checkpointing raises its PlanError."""
    if args.activation_checkpointing != "auto":
        return make(args), args
    on = make(resolved(args, True))
    try:
        off = make(resolved(args, False))
    except PlanError:  # the step's activations take the host memory the state needs (a run on the CPU)
        return on, resolved(args, True)
    if off.gpu_bytes is not None:
        room = off.gpu_bytes - int(headroom_gb * GIB)
        if any(r.gpu_train_bytes > room for r in off.ranks) or [r.gpu_subgroups for r in off.ranks] != [r.gpu_subgroups for r in on.ranks]:
            return on, resolved(args, True)
    return off, resolved(args, False)


def fsdp_checkpointing(args: LlamaArgs, step_bytes: Callable[[LlamaArgs], int], device_bytes: int | None) -> LlamaArgs:
    """`args` resolved for plain FSDP2 (torch AdamW, no planner): 'auto' is off where `step_bytes` (a
    rank's estimated peak: its state, params, grads and activations) without checkpointing fits in
    `device_bytes` (the GPU's memory; None on the CPU, where it is off)."""
    if args.activation_checkpointing != "auto":
        return args
    return resolved(args, device_bytes is not None and step_bytes(resolved(args, False)) > device_bytes)


def fsdp_step_bytes(args: LlamaArgs, world: int, seq_len: int, micro_batch: int) -> int:
    """A plain FSDP2 rank's estimated GPU peak: its shard's FP32 params, grads and Adam moments (16 bytes
    a param) and the bf16 step beside them (node_plan.train_gpu_bytes)."""
    shapes = ModelShapes.of(args)
    local = sum(shapes.local_numels(world, 0))
    return 16 * local + train_gpu_bytes(args, shapes, local, seq_len, micro_batch, itemsize=2)
