"""AdamW update kernels for one flat segment of a subgroup.

Every kernel has the signature of `torch_adamw_step`: FP32 `param`, `exp_avg`, `exp_avg_sq` (1-D,
updated in place), a bf16/fp16/fp32 `grad`, an optional low-precision `param_out` (which may alias
`grad`: each element of `grad` is read before the same element of `param_out` is written), and the
scalars `lr, beta1, beta2, eps, weight_decay, step, grad_scale`.
"""

from __future__ import annotations

import logging
from typing import Callable

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


__all__ = ["AdamWKernel", "KERNEL_NAMES", "get_adamw_kernel", "torch_adamw_step"]
