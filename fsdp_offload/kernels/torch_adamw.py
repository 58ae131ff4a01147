"""Pure-torch AdamW on one flat segment: the reference path and the fallback.

It applies the same tensor ops in the same order as torch.optim.AdamW's single-tensor path, so master
params and moments are bit-identical to torch.optim.AdamW fed the same upcast grads.
"""

from __future__ import annotations

import torch

from .contract import AdamWHyper

# Upcast at most this many grad elements at a time: the FP32 grad only ever exists in flight.
UPCAST_CHUNK = 1 << 22


Tensor = torch.Tensor


def torch_adamw_step(param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, param_out: Tensor | None, hyper: AdamWHyper) -> None:
    """One AdamW step on 1-D FP32 `param`/`exp_avg`/`exp_avg_sq` from a bf16/fp16/fp32 `grad`.

    `grad` is multiplied by `hyper.grad_scale` after the upcast (clip factor / inverse loss scale).
    `param_out`, when given, receives the updated params in its own (low-precision) dtype.
    """
    step_size, bias_correction2_sqrt = hyper.scalars()
    lr, beta1, beta2, eps, weight_decay, grad_scale = hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.grad_scale
    n = param.numel()
    for lo in range(0, n, UPCAST_CHUNK):
        hi = min(lo + UPCAST_CHUNK, n)
        p, m, v = param[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi]
        g = grad[lo:hi].float()  # for an FP32 grad this is the caller's tensor: scale out of place
        if grad_scale != 1.0:
            g = g * grad_scale
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        if param_out is not None:
            param_out[lo:hi].copy_(p)
