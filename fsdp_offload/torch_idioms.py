"""Where OffloadAdamW meets torch idioms that would otherwise see something torch never shows: the
update in flight read by a step post-hook, a step with no grads, grads the model cleared after
backward, a copied optimizer, swapped params.

The update runs on a worker thread after `step()` returns. A forward waits per FSDP unit (fsdp.py's
forward pre-hooks), the model's state dicts in model_state_dicts.py, and `step()` itself when step
post-hooks are registered.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks

from .fsdp import local_data
from .held_grad import holds_used_grads, is_zeroed, zeros_taken

log = logging.getLogger(__name__)


def has_step_post_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether hooks run after this optimizer's `step()` (its own or torch's global ones): they read
    the params as torch leaves them, updated, so the step must wait for its update."""
    return bool(optimizer._optimizer_step_post_hooks or _global_optimizer_post_hooks)


def step_has_grads(engine) -> bool:
    """Whether the step about to begin has grads: staged by the hooks or in p.grad (a retried step
    that stopped part-way has them staged still)."""
    if engine.pending is not None:
        return True
    engine.finish_update()
    engine.stage_param_grads()
    return any(engine.grads.staged)


class NoGradSteps:
    """`step()` without any grad (a skipped batch) does nothing, as torch's optimizers do; said once. One
    right after another step, with no zero_grad() between, is refused: torch would step again with the
    grads in p.grad, which the last step used here and let go (the staging buffer took the new params)."""

    def __init__(self) -> None:
        self.logged = False

    def skip(self, params: list[torch.Tensor]) -> None:
        if holds_used_grads(params):
            raise RuntimeError(
                "step() again on the grads the last step used, with no zero_grad() and backward between: torch AdamW "
                "would apply them a second time, but OffloadAdamW let them go at that step and nothing was updated now. "
                "Call opt.zero_grad() after step(), and run a backward before the next step() (to step twice on one "
                "batch, run its backward again)"
            )
        if not self.logged:
            self.logged = True
            log.warning("OffloadAdamW.step() with no grads (no backward since the last step): nothing updated, "
                        "as torch's optimizers do (said once)")  # fmt: skip


def refuse_copy(optimizer: object, *_: object) -> None:
    """copy.deepcopy / pickle of an OffloadAdamW: its state is out of core (tier files, pinned buffers,
    a worker thread), which a copy cannot share or duplicate."""
    raise TypeError(
        f"{type(optimizer).__name__} cannot be copied or pickled: its state lives in tier files, pinned host "
        "memory and a worker thread of this process. To copy the optimizer, save opt.state_dict() (or a DCP "
        "checkpoint) and load it into a new OffloadAdamW built on the copied model"
    )


ACCELERATE_FSDP2 = (
    "accelerate's FSDP2 flow (accelerator.prepare(model, optimizer)) builds the optimizer on the unsharded model, "
    "then shards the model and swaps the optimizer's params for the shards (upcasting them to FP32 under mixed "
    "precision); OffloadAdamW lays out its FP32 state on the shards it is built on and casts them itself. Shard "
    "the model with fully_shard first and build OffloadAdamW(model.parameters(), model=model) on it, outside "
    "accelerate's FSDP plugin"
)


def refuse_accelerate_fsdp2(params: list[torch.Tensor], models: list[torch.nn.Module]) -> None:
    """At construction: plain params while accelerate's FSDP2 plugin is active mean accelerate will shard
    the model and swap the params later (accelerate is only looked at when the process imported it)."""
    state = sys.modules.get("accelerate.state")
    if state is None or models or any(hasattr(p, "device_mesh") for p in params):
        return
    shared = state.AcceleratorState._shared_state
    plugin = shared.get("fsdp_plugin")
    if getattr(shared.get("distributed_type"), "value", None) == "FSDP" and getattr(plugin, "fsdp_version", 1) == 2:
        raise ValueError(f"OffloadAdamW cannot be built for {ACCELERATE_FSDP2}")


def check_params_unswapped(param_groups: list[dict], params: list[torch.Tensor]) -> None:
    """At each step: the param groups still hold the params the optimizer was built on (accelerate's
    FSDP2 prepare, or any code that swaps them, would leave the state updating tensors no longer in use)."""
    now = [p for g in param_groups for p in g["params"]]
    if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
        raise RuntimeError(
            "the optimizer's param_groups hold other params than those OffloadAdamW was built on: its state "
            f"belongs to those. If this is {ACCELERATE_FSDP2}"
        )


def hand_over_held_grads(hooks, engine) -> None:
    """Before a step or clip reads the grads: those the grad hooks still hold (unit_grads.UnitGrads) go to the
    step, except where step() now finishes a step that stopped part-way (its update raised, the error raised
    where it was waited for), which steps with the grads it began with. An update still in flight ends first
    (its error, if any, raised here); one that began in backward (overlap="backward") is this step's own."""
    if not (engine.inflight is not None and engine.inflight.awaiting_grads):
        engine.finish_update()
        if engine.pending is not None:
            if hooks.holding_grads:  # a backward since, for the step after: a retry would consume them unstepped
                raise RuntimeError(
                    f"step {engine.step_count} stopped part-way ({len(engine.pending)} subgroups left to update) and a "
                    "backward since holds grads for the step after it: opt.zero_grad() drops them, then step() "
                    f"finishes step {engine.step_count}; run that batch again after it"
                )
            return
    hooks.hand_over_grads()


def follow_cleared_grads(params: list[torch.Tensor], backwards: list[int], engine) -> None:
    """model.zero_grad() between backward and step() (or a clip), or zero_grad(set_to_none=False) before a
    step in which a param takes no grad: torch does not step a param whose p.grad it set to None, and
    steps one it zeroed in place with zero grads. The grads the hooks took for such params are dropped,
    and zeros staged for the zeroed ones."""
    if engine.inflight is not None and engine.inflight.awaiting_grads:  # its update began with them (and may have ended)
        if any(params[i].grad is None or is_zeroed(params[i].grad) for i in engine.grads_taken):
            raise RuntimeError(
                "model.zero_grad() between backward and step(): with offload.overlap='backward' backward has already "
                "updated subgroups with these grads, so no step can drop them: close() this optimizer and resume from "
                "the last checkpoint; offload.overlap='next_forward' follows model.zero_grad() as torch does"
            )
        step_with_zeros(params, [i for i, p in enumerate(params) if i not in engine.grads_taken and is_zeroed(p.grad)], engine)
        return
    if engine.pending is not None:
        return  # a retry of a step that stopped part-way: its grads are the ones it began with
    cleared = [i for i, p in enumerate(params) if (backwards[i] and p.grad is None) or is_zeroed(p.grad)]
    for i in cleared:
        if backwards[i]:
            engine.grads.forget(i)
    step_with_zeros(params, [i for i in cleared if params[i].grad is not None], engine)


def step_with_zeros(params: list[torch.Tensor], indices: list[int], engine) -> None:
    """Zero grads for params `indices`, whose p.grad was zeroed in place: torch steps them with zeros. Taken
    once: a step() called again (after one that raised) finds them staged, not zeroed."""
    if indices:
        engine.stage_grads(indices, [torch.zeros_like(local_data(params[i])) for i in indices])
        for i in indices:
            zeros_taken(params[i].grad)
