"""What `p.grad` holds once OffloadAdamW has taken a param's grad for the step: a `HeldGrad`, a tensor
of the grad's shape, dtype and device with no storage, on which every operation raises an error that
says where the grad went and what to call instead.

Without it `p.grad` would be None, and torch's clip_grad_norm_ (from any import path), get_total_norm,
torchtitan's and HF's clipping, a NaN check or a user's own clip would see no grads, report a norm of 0
and clip nothing, silently. A grad written in place would be lost the same way. FSDP2 adding a
backward's grad to it (a backward beyond offload.micro_batches before step()) meets the same error.
The optimizer sets `p.grad` back to None when the step consumes the grads (step() and zero_grad()).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

# Metadata ops that DTensor and autograd run on a grad without reading its values
_METADATA_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class HeldGrad(torch.Tensor):
    """A grad OffloadAdamW holds: the shape, dtype and device of the real one, no storage."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, micro_batches: int) -> HeldGrad:
        held = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device)
        held.micro_batches = micro_batches
        return held

    def __repr__(self) -> str:
        return f"HeldGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}: held by OffloadAdamW)"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        held = next(a for a in _flat(args, kwargs) if isinstance(a, HeldGrad))
        if func in _METADATA_OPS:
            return HeldGrad(held, held.micro_batches)
        raise RuntimeError(
            f"{func.__name__} on a param's grad: OffloadAdamW took this step's grads during backward (summed in FP32 "
            f"over offload.micro_batches={held.micro_batches} backward call(s)), so p.grad cannot be read or changed "
            "here and torch's clip_grad_norm_/get_total_norm would see nothing. Clip with opt.clip_grad_norm_(max_norm) "
            "(it returns the global norm) or offload.max_grad_norm, and read the last norm from opt.last_grad_norm. "
            "If this is FSDP2 adding another backward's grad, set offload.micro_batches to the backward calls per step"
        )


def held_like(grad: torch.Tensor, micro_batches: int) -> torch.Tensor:
    """A HeldGrad standing for `grad` (a DTensor stays a DTensor, its local part held)."""
    if not isinstance(grad, DTensor):
        return HeldGrad(grad, micro_batches)
    spec = DTensorSpec(grad.device_mesh, grad.placements, tensor_meta=TensorMeta(grad.shape, grad.stride(), grad.dtype))
    return DTensor(HeldGrad(grad.to_local(), micro_batches), spec, requires_grad=False)


def is_held(grad: torch.Tensor | None) -> bool:
    local = grad._local_tensor if isinstance(grad, DTensor) else grad  # (to_local() would run an op on it)
    return isinstance(local, HeldGrad)


def release_held_grads(params: list[torch.Tensor]) -> None:
    """Sets the HeldGrads of `params` back to None: the step consumed (or zero_grad() dropped) the grads."""
    for p in params:
        if p.grad is not None and is_held(p.grad):
            p.grad = None


def _flat(args: tuple, kwargs: dict | None):
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
