"""AdamW update kernels for one flat segment of a subgroup.

Every kernel has the signature of `torch_adamw_step`: FP32 `param`, `exp_avg`, `exp_avg_sq` (1-D,
updated in place), a bf16/fp16/fp32 `grad`, an optional low-precision `param_out` (which may alias
`grad`: each element of `grad` is read before the same element of `param_out` is written), and the
scalars `lr, beta1, beta2, eps, weight_decay, step, grad_scale`.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .contract import AdamWHyper
from .split_masters import torch_adamw_step_split
from .torch_adamw import torch_adamw_step

log = logging.getLogger(__name__)

AdamWKernel = Callable[..., None]
KERNEL_NAMES = ("auto", "fused", "torch")
_fallback_reported = False


def get_adamw_kernel(name: str = "auto") -> tuple[str, AdamWKernel]:
    """Returns (resolved name, kernel) for `name` in KERNEL_NAMES.

    "fused" is the C++ CPU kernel and raises if it cannot be built; "auto" takes it when it builds and
    otherwise falls back to "torch", saying once why.
    """
    global _fallback_reported
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown AdamW kernel {name!r}: choose one of {', '.join(KERNEL_NAMES)}")
    if name == "torch":
        return "torch", torch_adamw_step
    try:
        from .cpu_adamw import load_fused_adamw

        return "fused", load_fused_adamw()
    except ValueError:  # a bad FSDP_OFFLOAD_CPU_ISA is the user's to fix, not a reason to fall back
        raise
    except Exception as exc:  # build or import failure: reported, never hidden
        if name == "fused":
            raise RuntimeError(f"the fused CPU AdamW kernel is not available: {exc}") from exc
        if not _fallback_reported:
            log.warning("fused CPU AdamW unavailable (%s); using the pure-torch AdamW kernel", exc)
            _fallback_reported = True
        return "torch", torch_adamw_step


def split_step_of(kernel: AdamWKernel) -> AdamWKernel:
    """The step on split masters (split_masters.py) of the CPU `kernel`: the fused kernel's own, or the
    reference's."""
    if kernel is torch_adamw_step:
        return torch_adamw_step_split
    return kernel.step_split


def triton_kernel() -> Callable:
    """The Triton GPU AdamW (imported when first asked for: Triton is there only with CUDA)."""
    from .triton_adamw import triton_adamw_step

    return triton_adamw_step


def warm_up_gpu_kernel(kernel: Callable, device: torch.device, grad_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """Compiles the GPU kernel for the grads it will read (Triton compiles at its first call): at
    start-up, not in the first steps, which would otherwise carry it."""
    p, m, v = (torch.zeros(4096, device=device) for _ in range(3))
    out = torch.empty(4096, dtype=out_dtype, device=device)
    kernel(p, m, v, torch.zeros(4096, dtype=grad_dtype, device=device), out, AdamWHyper(0.0, 0.9, 0.999, 1e-8, 0.0, 1))


__all__ = ["AdamWKernel", "KERNEL_NAMES", "get_adamw_kernel", "split_step_of", "torch_adamw_step", "triton_kernel",
           "warm_up_gpu_kernel"]
