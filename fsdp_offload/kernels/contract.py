"""What every AdamW kernel here shares: its signature's scalars, the checks on its arguments and the
step's derived scalars.

The kernels take 1-D contiguous FP32 param / exp_avg / exp_avg_sq, a bf16/fp16/fp32 grad and an
optional bf16/fp16 param_out, all of one length on one device type, and an `AdamWHyper`; they derive
their per-step scalars with the same double arithmetic as torch.optim.AdamW. The split step
(kernels/split_masters.py) takes int16 `low` and the bf16 params `lowp` for param, and a bf16 param_out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class AdamWHyper:
    """The scalars of one AdamW step of a param group: `step` is the step this update takes (1 first),
    `grad_scale` multiplies every grad after its upcast (clip factor / inverse loss scale)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    grad_scale: float = 1.0

    def scalars(self) -> tuple[float, float]:
        """(step_size, sqrt of the second bias correction), computed as torch.optim.AdamW does."""
        bias_correction1 = 1 - self.beta1**self.step
        bias_correction2 = 1 - self.beta2**self.step
        return self.lr / bias_correction1, bias_correction2**0.5


def check_adamw_args(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    param_out: torch.Tensor | None,
    device_type: str,
) -> None:
    """Raises ValueError naming the argument that breaks the kernels' contract on `device_type`."""
    named = [("param", param, (torch.float32,)), ("exp_avg", exp_avg, (torch.float32,)),
             ("exp_avg_sq", exp_avg_sq, (torch.float32,)), ("grad", grad, GRAD_DTYPES)]  # fmt: skip
    if param_out is not None:
        named.append(("param_out", param_out, OUT_DTYPES))
    _check_tensors(named, device_type)
    if param_out is not None:
        _check_param_out_overlap(param_out, grad, {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq})


def check_split_args(
    low: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    lowp: torch.Tensor,
    param_out: torch.Tensor,
    device_type: str,
) -> None:
    """`check_adamw_args` for the split step (`torch_adamw_step_split`): int16 `low`, FP32 moments, a
    bf16/fp16/fp32 grad, the bf16 params `lowp` and a bf16 `param_out` (required: the masters' high halves
    go there), all 1-D contiguous, of one length, on one `device_type` device. param_out may alias grad
    element for element and nothing else; lowp, read while low and the moments are written, overlaps none
    of them. Raises ValueError naming the argument that breaks this."""
    if param_out is None:
        raise ValueError("param_out is required by the split step: the new bf16 params (the masters' high halves) go there")
    named = [("low", low, (torch.int16,)), ("exp_avg", exp_avg, (torch.float32,)),
             ("exp_avg_sq", exp_avg_sq, (torch.float32,)), ("grad", grad, GRAD_DTYPES),
             ("lowp", lowp, (torch.bfloat16,)), ("param_out", param_out, (torch.bfloat16,))]  # fmt: skip
    _check_tensors(named, device_type)
    written = {"low": low, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    _check_param_out_overlap(param_out, grad, {"lowp": lowp, **written})
    for name, t in written.items():
        if _overlap(lowp, t):
            raise ValueError(f"lowp overlaps {name}")


def _check_tensors(named: list[tuple[str, torch.Tensor, tuple[torch.dtype, ...]]], device_type: str) -> None:
    """Each (name, tensor, dtypes): 1-D, contiguous, of those dtypes, with as many elements as the first
    tensor and on its device, of `device_type`."""
    for name, t, _ in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    first, ref = named[0][0], named[0][1]
    n = ref.numel()
    for name, t, dtypes in named:
        on_device = t.device.type == device_type and t.device == ref.device
        if t.dtype not in dtypes or not on_device or t.dim() != 1 or not t.is_contiguous():
            kinds = "/".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(
                f"{name} must be a 1-D contiguous {kinds} tensor on {first}'s {device_type} device "
                f"({ref.device}), got {t.dtype} {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
            )
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, {first} has {n}")


def _check_param_out_overlap(param_out: torch.Tensor, grad: torch.Tensor, others: dict[str, torch.Tensor]) -> None:
    """param_out may alias grad element for element; any other overlap would let one thread (or
    GPU block) overwrite grads or state that another has yet to read."""
    if _overlap(param_out, grad) and (
        param_out.data_ptr() != grad.data_ptr() or param_out.element_size() != grad.element_size()
    ):
        raise ValueError("param_out overlaps grad without aliasing it element for element")
    for name, t in others.items():
        if _overlap(param_out, t):
            raise ValueError(f"param_out overlaps {name}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    return a_lo < b_lo + b.numel() * b.element_size() and b_lo < a_lo + a.numel() * a.element_size()
