"""FP32 masters kept split: the model's bf16 param is a master's high half, only its low half is kept.

Where the model's params are bf16, each is its FP32 master rounded to nearest even, so the master's high
16 bits are the bf16 param's bits, or one less where the rounding went up. The host cache and the tiers
keep a master as its low 16 bits and that one "rounded up" bit, which goes in the sign bit of its
exp_avg_sq (a mean of squares: never negative). A subgroup's state is then 10 bytes a param, not 12,
and a master comes back bit for bit: its high half from the model's param, its low half from here.

A NaN master comes back as NaN (torch's canonical one: its payload is not kept). A param written in the
model behind the optimizer's back (`p.data.copy_`, where `model.load_state_dict` is the way) no longer
has its master's high half: where the joined master does not round to the model's param, the master is
the param's value, so that the write is taken at bf16 precision and never makes a master of garbage.
Every function here is the reference that the fused CPU kernel's split step (cpu_adamw_ops.cpp) repeats
bit for bit (but a NaN's: NaN both, the bits may differ).
"""

from __future__ import annotations

import torch

from .contract import AdamWHyper, check_split_args
from .torch_adamw import UPCAST_CHUNK, torch_adamw_step

Tensor = torch.Tensor
ROUNDED_UP = -(2**31)  # the sign bit of an int32: set in exp_avg_sq where the master rounded up to its bf16
MAGNITUDE = 2**31 - 1


def split_masters(master: Tensor, low: Tensor, exp_avg_sq: Tensor) -> Tensor:
    """Writes `master`'s (FP32) low halves into `low` (int16) and its rounding bits into the sign bits of
    `exp_avg_sq` (FP32, non-negative; its sign bits are overwritten), in place; returns the bf16 params,
    `master` rounded to nearest even (what the model must hold for `join_masters` to give `master` back)."""
    lowp = master.to(torch.bfloat16)
    bits = master.view(torch.int32)
    low.copy_(bits)  # (an int32 to int16 copy keeps the low 16 bits)
    up = ((bits >> 16) & 0xFFFF) != (lowp.view(torch.int16).to(torch.int32) & 0xFFFF)
    v = exp_avg_sq.view(torch.int32)
    v.bitwise_and_(MAGNITUDE)
    v.bitwise_or_(torch.where(up, ROUNDED_UP, 0).to(torch.int32))
    return lowp


def join_masters(low: Tensor, lowp: Tensor, exp_avg_sq: Tensor, master: Tensor) -> None:
    """Writes into `master` (FP32) the masters that `split_masters` split into `low` and `exp_avg_sq`'s
    sign bits, given the bf16 params `lowp` it returned (a param written since: its value, see above);
    clears those sign bits (`exp_avg_sq` is itself again)."""
    v = exp_avg_sq.view(torch.int32)
    up = v < 0
    v.bitwise_and_(MAGNITUDE)
    high = lowp.view(torch.int16) - up.to(torch.int16)  # one less where the rounding went up
    master.copy_(high.view(torch.bfloat16))  # bf16 to FP32 is exact: the high half, a low half of zeros
    master.view(torch.int32).bitwise_or_(low.to(torch.int32) & 0xFFFF)
    written = master.to(torch.bfloat16).view(torch.int16) != lowp.view(torch.int16)  # the param was written
    master.copy_(torch.where(written, lowp.float(), master))
    master.masked_fill_(lowp.isnan(), float("nan"))


def torch_adamw_step_split(low: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, lowp: Tensor,
                           param_out: Tensor, hyper: AdamWHyper) -> None:  # fmt: skip
    """`torch_adamw_step` on split masters: the masters joined from `low`, the model's bf16 params `lowp`
    and `exp_avg_sq`'s sign bits, stepped, the new bf16 params written to `param_out` (which may alias
    `grad`, not `lowp`), and split again into `low` and `exp_avg_sq`; a piece at a time (elementwise: the
    same bits), so that its FP32 masters and temporaries stay small."""
    check_split_args(low, exp_avg, exp_avg_sq, grad, lowp, param_out, "cpu")  # before the join clears any bit
    master = torch.empty(min(low.numel(), UPCAST_CHUNK), dtype=torch.float32)
    for lo in range(0, low.numel(), UPCAST_CHUNK):
        piece = slice(lo, min(lo + UPCAST_CHUNK, low.numel()))
        m = master[: piece.stop - lo]
        join_masters(low[piece], lowp[piece], exp_avg_sq[piece], m)
        torch_adamw_step(m, exp_avg[piece], exp_avg_sq[piece], grad[piece], param_out[piece], hyper)
        split_masters(m, low[piece], exp_avg_sq[piece])
