"""What `p.grad` holds once OffloadAdamW has taken a param's grad (after every backward, not only
the step's last): a `HeldGrad`, a tensor of the grad's shape, dtype and device with no storage, on
which every operation raises an error that says where the grad went and what to call instead.

Without it `p.grad` would be None, and torch's clip_grad_norm_ (from any import path), get_total_norm,
torchtitan's and HF's clipping, a NaN check or a user's own clip would see no grads, report a norm of 0
and clip nothing, silently (after the last micro-batch, or after fewer backwards than
offload.micro_batches). A grad written in place would be lost the same way.

Two operations are taken rather than refused: adding a grad to it in place, which is what FSDP2 does
with the next backward's grad while `p.grad` is set, and zeroing it. The added grad goes to the
optimizer (`take`), which sums it in FP32 as it sums every micro-batch. A `p.grad` cleared between
backwards (model.zero_grad(): None, or zeroed with set_to_none=False) makes the next backward's grad
come in fresh (`restart`), and the optimizer drops the earlier ones, as torch does; a zeroed one that
takes no grad before the step is stepped with zeros, as torch steps a zero grad.

step() uses the grads but leaves the HeldGrad, marked consumed: torch would add the next backward's
grads to them until a zero_grad(), which the optimizer cannot do once it has stepped with them. A
backward that finds it still there hands its grad to no one and marks it refused; the next step()
(or clip) raises, naming zero_grad(), before it changes anything. (Raising in the hook itself would
stop FSDP2's backward half-way and leave its state for the next one to trip over.) zero_grad() (the
optimizer's or the model's) clears it, as torch's does.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor

# Metadata ops that DTensor and autograd run on a grad without reading its values
_METADATA_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
_ADD_IN_PLACE = torch.ops.aten.add_.Tensor
_ZERO_IN_PLACE = torch.ops.aten.zero_.default
_AMP_UNSCALE = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default  # a GradScaler's unscale_


class GradHold:
    """What one param's HeldGrad (and every alias autograd or DTensor makes of it) shares: where an
    added grad goes, and whether the grad was zeroed or consumed by a step since."""

    def __init__(self, micro_batches: int, take: Callable[[torch.Tensor], None], restart: Callable[[torch.Tensor], None]) -> None:
        self.micro_batches = micro_batches
        self.take = take  # a grad added in place, summed with the ones before it
        self.restart = restart  # a grad added after p.grad was zeroed: the first again
        self.cleared = False
        self.consumed = False  # step() has used the grads
        self.refused = False  # a backward came after step() with no zero_grad(): its grad was not taken

    def add(self, grad: torch.Tensor) -> None:
        if self.cleared:
            self.cleared = self.consumed = self.refused = False
            self.restart(grad)
        elif self.consumed:
            self.refused = True
        else:
            self.take(grad)


class HeldGrad(torch.Tensor):
    """A grad OffloadAdamW holds: the shape, dtype and device of the real one, no storage."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, hold: GradHold) -> HeldGrad:
        held = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device)
        held.hold = hold
        return held

    def __repr__(self) -> str:
        return f"HeldGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: held by OffloadAdamW)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = args[0] if args else None  # (FSDP2's `+=`, once a param every backward: no search)
        held = first if isinstance(first, HeldGrad) else next(a for a in _flat(args, kwargs) if isinstance(a, HeldGrad))
        if func in _METADATA_OPS:
            return HeldGrad(held, held.hold)
        if func is _ADD_IN_PLACE and args[0] is held and _takeable(args[1], held, kwargs):
            held.hold.add(args[1])  # the next backward's grad (FSDP2 adds it to p.grad): summed by the optimizer
            return held
        if func is _ZERO_IN_PLACE and args[0] is held:  # zero_grad(set_to_none=False), the model's or the optimizer's
            held.hold.cleared, held.hold.refused = True, False
            return held
        when = "the step has used" if held.hold.consumed else "OffloadAdamW took"
        if func is _AMP_UNSCALE:
            raise RuntimeError(
                f"GradScaler (torch.amp's, or FSDP's ShardedGradScaler) cannot unscale the params' grads: {when} this "
                "step's grads during backward. Leave GradScaler out: bf16 needs no loss scaling, and with "
                "offload.param_dtype=float16 the optimizer keeps a loss scale of its own: opt.scale_loss(loss).backward(), "
                "then opt.step()"
            )
        raise RuntimeError(
            f"{func.__name__} on a param's grad: {when} this step's grads during backward (summed in FP32 "
            f"over offload.micro_batches={held.hold.micro_batches} backward call(s)), so p.grad cannot be read or changed "
            "here and torch's clip_grad_norm_/get_total_norm would see nothing. Clip with opt.clip_grad_norm_(max_norm) "
            "(it returns the global norm) or offload.max_grad_norm, and read the last norm from opt.last_grad_norm"
        )


def _takeable(added: object, held: HeldGrad, kwargs: dict | None) -> bool:
    """`held += added` with a real grad of its shape and dtype (no alpha): a grad to sum."""
    return (isinstance(added, torch.Tensor) and not isinstance(added, HeldGrad) and added.shape == held.shape
            and added.dtype == held.dtype and not kwargs)  # fmt: skip


def held_like(grad: torch.Tensor, micro_batches: int, take: Callable[[torch.Tensor], None],
              restart: Callable[[torch.Tensor], None]) -> torch.Tensor:  # fmt: skip
    """A HeldGrad standing for `grad` (a DTensor stays a DTensor, its local part held); a grad added to it
    in place goes to `take` (its local part), or to `restart` after the HeldGrad was zeroed."""
    hold = GradHold(micro_batches, take, restart)
    if not isinstance(grad, DTensor):
        return HeldGrad(grad, hold)
    # The grad's own spec (mesh, placements, global shape, stride and dtype: the HeldGrad's too): this
    # runs once per param in every backward, where building a new spec took 12 us on a CPU where the
    # rest of the HeldGrad takes 5.
    return DTensor(HeldGrad(grad._local_tensor, hold), grad._spec, requires_grad=False)


def _held(grad: torch.Tensor | None) -> HeldGrad | None:
    local = grad._local_tensor if isinstance(grad, DTensor) else grad  # (to_local() would run an op on it)
    return local if isinstance(local, HeldGrad) else None


def is_held(grad: torch.Tensor | None) -> bool:
    return _held(grad) is not None


def is_zeroed(grad: torch.Tensor | None) -> bool:
    """A HeldGrad zeroed in place (zero_grad(set_to_none=False)) since its last grad."""
    held = _held(grad)
    return held is not None and held.hold.cleared


def zeros_taken(grad: torch.Tensor) -> None:
    """The zeros a zeroed HeldGrad stands for went to the step as its param's grad: it holds them now, as it
    holds a grad that came after a zeroing (GradHold.add)."""
    _held(grad).hold.cleared = False


def refuse_backwards_after_step(params: list[torch.Tensor]) -> None:
    """Raises, before a step or clip changes anything, where a backward came after the last step() with
    no zero_grad() between (torch would have summed its grads into the ones that step used)."""
    refused = [p for p in params if (held := _held(p.grad)) is not None and held.hold.refused]
    if refused:
        micro_batches = _held(refused[0].grad).hold.micro_batches
        raise RuntimeError(
            "a backward after step() with no zero_grad() in between: torch would add its grads to the ones the last "
            "step used and step with the sum; OffloadAdamW consumed those at step(), so this backward's grads were "
            "not taken. Call opt.zero_grad() (or model.zero_grad()) after step() and run that backward again; to sum "
            f"several backwards into one step, call step() once per offload.micro_batches={micro_batches} backward call(s)"
        )


def holds_used_grads(params: list[torch.Tensor]) -> bool:
    """Whether any of `params` still holds grads the last step used (no zero_grad() since): torch would step
    with them again."""
    return any((held := _held(p.grad)) is not None and held.hold.consumed and not held.hold.cleared for p in params)


def consume_held_grads(params: list[torch.Tensor]) -> None:
    """Marks the HeldGrads of `params` consumed: the step has used their grads, and a backward before
    the next zero_grad() would have torch sum into them."""
    for p in params:
        held = _held(p.grad)
        if held is not None:
            held.hold.consumed, held.hold.cleared, held.hold.refused = True, False, False


def release_held_grads(params: list[torch.Tensor]) -> None:
    """Sets the HeldGrads of `params` back to None: zero_grad() dropped the grads, or the optimizer closed."""
    for p in params:
        if p.grad is not None and is_held(p.grad):
            p.grad = None


def _flat(args: tuple, kwargs: dict | None):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
