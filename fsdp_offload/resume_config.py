"""What a resumed run takes from its checkpoint and what from this run's config.

The model, the optimizer's state, the data position and the RNG come from the checkpoint. The training
hyperparameters are this run's, from the resumed step itself: loading puts the checkpoint's lr,
weight decay and betas in the optimizer and its base lr in the scheduler, so a changed value would
otherwise be ignored (weight decay, betas) or start a step late (the lr schedule), silently. The
checkpoint records the values it was trained with (and the micro-batches, the micro-batch size and
the clip), so any change is said once, naming it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("train")

HYPER_KEYS = ("lr", "min_lr_ratio", "warmup_steps", "steps", "weight_decay", "betas", "micro_batches")  # of TrainConfig


def train_hyper(tcfg: Any, micro_batch: int, max_grad_norm: float | None) -> dict[str, Any]:
    """The hyperparameters a checkpoint records (plain values: the rank state is read without pickled code):
    train.<key> for HYPER_KEYS, and the data.micro_batch and offload.max_grad_norm the step ran with."""
    hyper = {key: tuple(float(b) for b in tcfg.betas) if key == "betas" else getattr(tcfg, key) for key in HYPER_KEYS}
    return {**hyper, "data.micro_batch": micro_batch, "offload.max_grad_norm": max_grad_norm}


def follow_config(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, base_lrs: list[float],
                  tcfg: Any, now: dict[str, Any], saved: dict[str, Any] | None, rank: int) -> None:  # fmt: skip
    """Puts this run's hyperparameters in the optimizer and the scheduler after a resume: `base_lrs` are
    the freshly built scheduler's, `now` this run's `train_hyper`, `saved` the checkpoint's (None: a
    checkpoint written before it recorded them, where only a changed lr at this step can be seen). Where
    nothing changed, every value is the checkpoint's, bit for bit."""
    restored = [group["lr"] for group in optimizer.param_groups]
    scheduler.base_lrs = list(base_lrs)
    for group, base, factor in zip(optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)  # as LambdaLR computes it
        group["weight_decay"] = tcfg.weight_decay
        group["betas"] = tuple(float(b) for b in tcfg.betas)
    if rank != 0:
        return
    if saved is not None:  # (a key the checkpoint lacks, written before it was recorded: not compared)
        changed = [f"{key if '.' in key else 'train.' + key} {saved[key]!r} -> {now[key]!r}" for key in now
                   if key in saved and saved[key] != now[key]]  # fmt: skip
    else:
        changed = ["the lr of this step"] if restored != [group["lr"] for group in optimizer.param_groups] else []
    if changed:
        log.warning("resumed at step %d with other hyperparameters than the checkpoint's (%s): this run's apply from "
                    "this step on (its lr %.6g)", scheduler.last_epoch, ", ".join(changed), optimizer.param_groups[0]["lr"])  # fmt: skip
