"""Triton AdamW for subgroups whose FP32 state is resident on the GPU.

Same contract as `torch_adamw_step` and the same arithmetic as the fused CPU kernel (cpu_adamw.cpp):
the FMAs that torch's CPU kernels have (lerp_, addcmul_) are explicit `tl.fma`, every other op is
rounded on its own (fp fusion off), and sqrt and division are IEEE-rounded (`sqrt_rn`, `div_rn`).
So exp_avg, exp_avg_sq are bit-identical to the torch path, and params are bit-identical to the fused
CPU kernel with the hardware sqrt; they differ from the torch CPU path only where MKL's sqrt (which
torch.sqrt uses there) is 1 ulp off. Triton is imported on first use, so this module imports
anywhere.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from .contract import AdamWHyper, check_adamw_args

BLOCK = 1024


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(
        param_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr, out_ptr, n,
        grad_scale, decay, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size,
        SMALL_WEIGHT: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
        m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
        p = tl.load(param_ptr + offs, mask=mask, other=0.0)
        # torch's lerp: self + w * (end - self) for |w| < 0.5, else end + (w - 1) * (end - self)
        if SMALL_WEIGHT:
            m = tl.fma(lerp_coeff, g - m, m)
        else:
            m = tl.fma(lerp_coeff, g - m, g)
        v = tl.fma(one_minus_beta2 * g, g, v * beta2)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p * decay + tl.div_rn(neg_step_size * m, denom)
        tl.store(exp_avg_ptr + offs, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
        tl.store(param_ptr + offs, p, mask=mask)
        if HAS_OUT:  # after every load: param_out may alias grad
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)

    return adamw_kernel


Tensor = torch.Tensor


def triton_adamw_step(param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, param_out: Tensor | None, hyper: AdamWHyper) -> None:
    """One AdamW step on GPU-resident 1-D FP32 state from a bf16/fp16/fp32 grad.

    Arguments and semantics as `torch_adamw_step`; `param_out` may alias `grad`.
    """
    check_adamw_args(param, exp_avg, exp_avg_sq, grad, param_out, "cuda")
    n = param.numel()
    if n == 0:
        return
    step_size, bias_correction2_sqrt = hyper.scalars()
    # torch casts the lerp weight to float, then picks its formula and forms (w - 1) in float
    weight = np.float32(1 - hyper.beta1)
    small_weight = bool(abs(weight) < np.float32(0.5))
    lerp_coeff = float(weight if small_weight else weight - np.float32(1))
    grid = ((n + BLOCK - 1) // BLOCK,)
    with torch.cuda.device(param.device):
        _kernel()[grid](
            param, exp_avg, exp_avg_sq, grad, param if param_out is None else param_out, n,
            float(hyper.grad_scale), 1 - hyper.lr * hyper.weight_decay, lerp_coeff, float(hyper.beta2), 1 - hyper.beta2,
            bias_correction2_sqrt, float(hyper.eps), -step_size,
            SMALL_WEIGHT=small_weight, HAS_OUT=param_out is not None, BLOCK=BLOCK,
            enable_fp_fusion=False,  # no FMA beyond the explicit ones: torch's CPU kernels have none
        )  # fmt: skip
