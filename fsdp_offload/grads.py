"""The step's grads in one room: staged, scaled, clipped and handed to the update.

Backward hands each param's low-precision grad to `StepGrads.stage`, which keeps it in the staging
buffer (host memory; GPU memory for GPU-resident subgroups, and for all with grad_path="gpu_bf16")
and, when the step clips or checks fp16 grads, takes its sum of squares where the grad already is
(on the GPU, in the hook, during backward).
`step()` then asks for the factor every grad is multiplied by in flight (1 / loss scale x clip
factor, or None when fp16 grads overflowed): one all-reduce of one scalar, no pass over the grads.
Per subgroup it asks for the grads its update reads. Where those come from is the grad path, chosen
once:
- `LowpGrads` ("host_bf16", the default, and "gpu_bf16", whose staging buffer is in GPU memory): the
  staged bf16 grads themselves, upcast in flight by the kernel (MLP-Offload's "skip gradients": no
  FP32 grad anywhere);
- `TierFP32Grads` ("tier_fp32", an ablation): DeepSpeed's way, every host subgroup's grads upcast to
  FP32, written to a tier and read back for its update (8 more bytes of I/O per param and step; the
  math is unchanged, a bf16 -> FP32 upcast being exact).
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from .cache import aligned_host_buffer
from .config import OffloadConfig
from .fsdp import CopyStream, local_data
from .grad_sums import GradSums
from .loss_scale import DynamicLossScaler
from .staging import LowpStaging
from .storage.base import Tier, Transfer
from .subgroups import SubgroupLayout


class NonFiniteGradError(ValueError):
    """step() found the grads' global norm NaN or Inf (bf16, where the norm is taken: with clipping)
    and updated nothing."""


_CPU_NORM_CHUNK = 1 << 22  # elements a CPU reduction upcasts at a time: bounds its FP64 copy (32 MiB)


def gpu_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each grad's L2 norm, a 0-dim FP32 tensor on its GPU, all in one multi-tensor reduction (a few launches
    for an FSDP unit's grads, which the hooks hand over at once in the middle of backward, where a launch
    a grad cost the launching thread). The low-precision elements are upcast in registers and accumulated
    in FP32 per fixed-size chunk of each grad, and each grad's chunks summed in a fixed order: the same
    bits for a grad however many others share the launch (the grads dense: one that is not sends the whole
    list down torch's per-tensor path), a rounding far below what the FP32 clip factor shows."""
    return list(torch._foreach_norm(grads, 2, dtype=torch.float32))


def square_sum(flat: torch.Tensor) -> torch.Tensor:
    """Sum of squares of a flat grad as a 0-dim FP64 tensor on its device (inf/nan if any element is,
    and inf on the GPU if one is above 1.8e19, whose square FP32 cannot hold), the same bits every
    time for the same grad in the same place (the GPU's vectorised loop depends on its alignment). On
    the GPU it is the square of `gpu_norms`'. On the CPU, whose reduction accumulates serially, chunks
    are upcast to FP64 (the copy bounded by the chunk). The norms' squares are summed in FP64."""
    if flat.is_cuda:
        return gpu_norms([flat])[0].double().square()
    norms = [
        torch.linalg.vector_norm(flat[lo : lo + _CPU_NORM_CHUNK], dtype=torch.float64)
        for lo in range(0, max(1, flat.numel()), _CPU_NORM_CHUNK)
    ]
    return torch.stack(norms).square().sum()


class SquareSums:
    """Each param's grad's sum of squares (`square_sum`), taken as the grad is staged and summed in
    param order at the step, so the norm depends on no subgroup cut, cache state or timing. On the GPU
    the hooks write only the grads' FP32 norms into their slots (`gpu_norms`, a few launches for an FSDP
    unit's grads in the middle of backward, where the launching thread bounds the step at several ranks),
    and the step squares them all at once in FP64: the bits of `square_sum`."""

    def __init__(self, params: int, device: torch.device) -> None:
        self._norms_on_gpu = device.type == "cuda"
        self._values = torch.zeros(params, dtype=torch.float32 if self._norms_on_gpu else torch.float64, device=device)
        self._slots = self._values.unbind()  # views made once: none is made per grad

    def take(self, indices: list[int], grads: list[torch.Tensor]) -> None:
        """The grads of params `indices` (any shape, one dtype, on any device) are now `grads`."""
        if not indices:
            return
        slots = [self._slots[i] for i in indices]
        if self._norms_on_gpu:  # a grad handed in from host memory (stage_grad) is copied up and reduced as the others
            device = self._values.device
            flats = [g if g.is_contiguous() else g.reshape(-1) for g in grads]  # (dense: see gpu_norms)
            torch._foreach_copy_(slots, gpu_norms([g if g.device == device else g.to(device) for g in flats]))
        else:
            for slot, grad in zip(slots, grads):
                slot.copy_(square_sum(grad.reshape(-1)))

    def total(self) -> torch.Tensor:
        """The sum over params, FP64, shape (1,)."""
        squares = self._values.double().square() if self._norms_on_gpu else self._values
        return squares.sum().reshape(1)

    def forget(self, index: int) -> None:
        """Param `index`'s grad was dropped: it counts in no norm."""
        self._slots[index].zero_()

    def clear(self) -> None:
        self._values.zero_()


class LowpGrads:
    """Grads stay low-precision in the staging buffer (or FP32 in the sums); the kernel upcasts them
    in flight."""

    def before_update(self, subgroups: list[int], source: Callable[[int], torch.Tensor]) -> list[Transfer]:
        return []



class TierFP32Grads:
    """Grads go to a tier as FP32 before the update and come back for it (the DeepSpeed baseline).

    Each subgroup's FP32 grad slot follows the state slots in a tier's file (`slot_bytes`)."""

    def __init__(self, layout: SubgroupLayout, tiers: list[Tier], tier_for) -> None:
        self.layout, self.tiers, self.tier_for = layout, tiers, tier_for
        self._first_key = len(layout)
        self._buffer = aligned_host_buffer(max(self.slot_bytes(layout)))
        self._tier_of: dict[int, int] = {}

    @staticmethod
    def slot_bytes(layout: SubgroupLayout) -> list[int]:
        return [4 * sg.padded for sg in layout.subgroups]

    def _view(self, sg: int) -> torch.Tensor:
        return self._buffer[: 4 * self.layout.subgroups[sg].padded]

    def before_update(self, subgroups: list[int], source: Callable[[int], torch.Tensor]) -> list[Transfer]:
        """Upcasts and writes the grads of `subgroups` (`source(sg)`: staged, or FP32 sums), one at a time
        through one buffer."""
        done = []
        for sg in subgroups:
            buf = self._view(sg)
            buf.view(torch.float32).copy_(source(sg))
            tier = self.tier_for(sg)
            done.append(self.tiers[tier].write(self._first_key + sg, buf).result())
            self._tier_of[sg] = tier
        return done

    def for_update(self, sg: int, lowp: torch.Tensor) -> tuple[torch.Tensor, Transfer | None]:
        """Subgroup `sg`'s FP32 grads, read back (valid until the next read)."""
        buf = self._view(sg)
        t = self.tiers[self._tier_of[sg]].read(self._first_key + sg, buf).result()
        return buf.view(torch.float32), t


class StepGrads:
    """The staged grads of one step, the loss scale, and the clip/unscale factor."""

    def __init__(
        self,
        cfg: OffloadConfig,
        staging: LowpStaging,
        path: LowpGrads | TierFP32Grads,
        sums: GradSums,
        local_shapes: list[torch.Size],
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.staging = staging
        self.sums = sums
        self.micro_batches = cfg.micro_batches
        self.backwards = [0] * len(local_shapes)  # grads each param took this step
        self.dtype = staging.dtype
        self.max_grad_norm = cfg.max_grad_norm
        self._local_shapes = local_shapes
        self._group = group
        self._device = device
        self.path = path
        self.loss_scaler = (
            DynamicLossScaler(cfg.loss_scale_init, growth_interval=cfg.loss_scale_growth_interval)
            if self.dtype == torch.float16
            else None
        )
        self._losses_scaled = 0  # scale_loss calls since the last step took the grad scale (fp16: it divides by it)
        self._loss_scale_checked = False  # this step's grads passed _check_loss_scaled (a retried step's too)
        self.last_norm: float | None = None
        self.step_clip: float | None = None  # this step's clip factor from clip_grad_norm_ (over max_grad_norm)
        self.after_clip = 0  # grads from backwards after clip_grad_norm_ in this step
        self._param_grads_seen: dict[int, tuple[weakref.ref, int]] = {}  # p.grads staged this step (no hook), and version
        self._total: float | None = None  # this step's all-reduced sum of squares, once taken
        self._square_sums: SquareSums | None = None
        self._accumulated: set[int] = set()  # staged twice or more (or before sums were taken): summed at the step
        if self.max_grad_norm is not None or self.loss_scaler is not None:
            self.take_square_sums()

    def take_square_sums(self) -> None:
        """From now on, each grad's sum of squares is taken as it is staged (where the grad is: on the
        GPU in the hook). Grads staged before are summed from the staging buffer when the norm is asked."""
        if self._square_sums is None:
            self._square_sums = SquareSums(len(self._local_shapes), self._device)
            self._accumulated.update(i for i, has in enumerate(self.staged) if has)

    @property
    def staged(self) -> list[bool]:
        """Which params hold a grad for the next step."""
        return self.staging.staged

    def stage(self, indices: list[int], grads: list[torch.Tensor]) -> None:
        """One grad each (its local shard, any shape) for params `indices`: the step's first of a param goes
        into the staging buffer, its norm taken where it is; a later one into the FP32 sums."""
        for index, grad in zip(indices, grads):  # all checked before any is taken
            if grad.dtype != self.dtype:
                raise TypeError(
                    f"grad of param {index} (shape {tuple(grad.shape)}) is {grad.dtype}; OffloadAdamW expects "
                    f"{self.dtype} grads (the model's params are {self.dtype})"
                )
            if grad.shape != self._local_shapes[index]:
                raise ValueError(
                    f"grad of param {index} has shape {tuple(grad.shape)}, the param's local shape is "
                    f"{tuple(self._local_shapes[index])}"
                )
        self._total = None  # a norm taken before these grads is stale
        firsts, first_grads, summed, summed_grads = [], [], [], []
        for index, grad in zip(indices, grads):
            if self.sums.takes(index):  # a later micro-batch's grad (or every grad, with sums on the GPU)
                summed.append(index)
                summed_grads.append(grad)
            else:
                firsts.append(index)
                first_grads.append(grad)
        if summed:
            self.sums.add(summed, summed_grads)
        if firsts:
            self.staging.stage(firsts, first_grads)
            if self._square_sums is not None:
                self._square_sums.take(firsts, first_grads)
        for index in indices:  # (counted once taken: sums.add may refuse them, and then they are handed over again)
            self.backwards[index] += 1

    def stage_param_grads(self, grads: list[torch.Tensor | None], copies: CopyStream) -> None:
        """Stages the .grad (`grads[i]`) of params that no hook has handed over. One staged before (by a clip)
        and written, replaced or cleared since (a backward after the clip adds to it), or a param's first
        after a clip, counts as a grad after the clip, which the step refuses: the staged copy would silently
        leave the backward out."""
        changed = [i for i, (ref, version) in self._param_grads_seen.items()
                   if grads[i] is None or ref() is not grads[i] or grads[i]._version != version]  # fmt: skip
        taken = [i for i, g in enumerate(grads) if g is not None and not self.staged[i]]
        self.after_clip += len(changed) + (len(taken) if self.step_clip is not None else 0)  # (a first grad too)
        if taken and self.micro_batches > 1:
            raise RuntimeError(
                f"params {taken[:5]} hold grads in p.grad, which autograd summed over the micro-batches in their dtype "
                f"({self.dtype}), not in FP32 as offload.micro_batches={self.micro_batches} promises: pass model= (an "
                "FSDP2 model, whose hooks hand each grad in), or hand each micro-batch's grads to opt.stage_grad()"
            )
        with copies.after_current():
            self.stage(taken, [local_data(grads[i]) for i in taken])
        copies.wait_host()
        for i in taken + changed:  # each change counted once
            if grads[i] is None:
                self._param_grads_seen.pop(i)
            else:
                self._param_grads_seen[i] = (weakref.ref(grads[i]), grads[i]._version)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._losses_scaled += 1
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def _check_loss_scaled(self) -> None:
        """fp16: the step divides every grad by the loss scale, so grads of a loss that scale_loss did not
        scale are refused (zero grads, as torch's state-dict API steps with to build the state, are let be)."""
        if self._loss_scale_checked or self.loss_scaler is None:
            return
        backwards = max(self.backwards, default=0)  # (one scaled loss a backward: a micro-batch's own)
        if self._losses_scaled < backwards and self._total != 0:
            raise RuntimeError(
                f"param_dtype float16: this step's grads come from {backwards} backwards and opt.scale_loss() scaled "
                f"{self._losses_scaled} losses: grads of a loss it did not scale would be wrong, as "
                f"the step divides every grad by the loss scale (now {self.loss_scaler.scale:g}): call "
                "opt.scale_loss(loss).backward() for each micro-batch (OffloadAdamW scales fp16 losses itself; "
                "torch.amp.GradScaler does not apply); zero_grad() drops these grads"
            )
        self._loss_scale_checked = True

    def norm(self) -> float:
        """The global L2 norm of this step's grads, unscaled (inf/nan if any grad is): one all-reduce
        of one scalar per step, however often it is asked."""
        self.take_square_sums()
        if self._total is None:
            self.sums.drain()
            summed = [i for i, s in enumerate(self.sums.summed) if s]
            self._square_sums.take(summed, [self.sums.param_sum(i).to(self._device) for i in summed])
            staged = sorted(self._accumulated - set(summed))
            self._square_sums.take(staged, [self.staging.param_grad(i).to(self._device) for i in staged])
            self._accumulated.clear()
            sq = self._square_sums.total()
            if self._group is not None:
                dist.all_reduce(sq, group=self._group)  # inf/nan spreads through the sum
            self._total = float(sq.item())
        self._check_loss_scaled()
        unscale = 1.0 if self.loss_scaler is None else 1.0 / self.loss_scaler.scale  # the scale backward ran with
        return math.sqrt(self._total) * unscale

    def clip_to(self, max_norm: float) -> float:
        """opt.clip_grad_norm_(max_norm), as torch's: the global norm of the grads as they stand (after any clip
        called before in this step) and a clip of them to `max_norm`, which the step applies in flight. A
        second clip multiplies in, as torch's clips the grads the first left."""
        factor = 1.0 if self.step_clip is None else self.step_clip
        norm = self.norm() * factor
        self.step_clip = factor * min(1.0, max_norm / (norm + 1e-6))
        return norm

    def grad_scale(self) -> float | None:
        """The factor applied to every grad in flight (1 / loss scale x clip factor), or None when the
        fp16 grads overflowed and the step must be skipped. Agreed across ranks."""
        if self.after_clip:
            raise RuntimeError(
                f"{self.after_clip} grads came after clip_grad_norm_() in this step (a backward after it, or after a "
                "model.zero_grad() that dropped the grads it clipped): torch would have clipped only the grads before "
                "it, where OffloadAdamW sums a step's grads and clips the sum. Call clip_grad_norm_() once after the "
                "step's last backward; opt.zero_grad() drops this step's grads and its clip"
            )
        if self.max_grad_norm is None and self.step_clip is None and self.loss_scaler is None:
            return 1.0
        norm = self.norm()
        self._losses_scaled = 0  # (the next step's count from here: step() has taken this one's grads)
        unscale = 1.0
        if self.loss_scaler is not None:
            unscale = 1.0 / self.loss_scaler.scale
            found_inf = not math.isfinite(norm)
            self.loss_scaler.update(found_inf)
            if found_inf:
                return None
        if not math.isfinite(norm):  # bf16: applying it would put NaN into every master and moment
            raise NonFiniteGradError(
                f"the global grad norm is {norm}: a grad holds NaN or Inf, or (on the GPU) an element above "
                "1.8e19 (a diverging loss, a bad batch, too high an lr). Nothing was updated; call zero_grad() to "
                "drop these grads and go on with the next batch, or resume from the last checkpoint with a lower lr"
            )
        self.last_norm = norm
        clip = self.step_clip
        if clip is None:
            clip = 1.0 if self.max_grad_norm is None else min(1.0, self.max_grad_norm / (norm + 1e-6))
        return unscale * clip

    def before_update(self, host_subgroups: list[int]) -> list[Transfer]:
        """What the grad path does before any subgroup is updated (tier_fp32: writes the host subgroups'
        FP32 grads); the adds still running finish first."""
        self.sums.drain()
        return self.path.before_update(host_subgroups, self._fp32_source)

    def _fp32_source(self, sg: int) -> torch.Tensor:
        return self.sums.completed(sg) if self.sums.subgroup_summed(sg) else self.staging.view(sg)

    def for_update(self, sg: int, lowp: torch.Tensor, on_gpu: bool) -> tuple[torch.Tensor, Transfer | None]:
        """The grads subgroup `sg`'s update reads (on the GPU or the CPU, as `on_gpu` says), given its
        staged part `lowp` that the kernel writes the new params into: the FP32 tier copy (tier_fp32),
        the FP32 sums of its micro-batches, or `lowp` itself, upcast in flight."""
        if not on_gpu and isinstance(self.path, TierFP32Grads):
            return self.path.for_update(sg, lowp)
        if self.sums.subgroup_summed(sg):
            return self.sums.for_update(sg, on_gpu), None
        return lowp, None

    def forget(self, index: int) -> None:
        """Drops param `index`'s grads of this step (its p.grad was cleared before the next backward)."""
        self.staging.staged[index] = False
        self.sums.summed[index] = False
        self.backwards[index] = 0
        self._accumulated.discard(index)
        self._param_grads_seen.pop(index, None)
        if self._square_sums is not None:
            self._square_sums.forget(index)
        self._total = None

    def plan_cpu_updates(self, order: list[int], params: list[torch.Tensor]) -> None:
        """The subgroups the CPU is about to update, in order, every grad of theirs in: those kept on the
        GPU start down towards it (and the model's `params` of each, for split masters)."""
        self.sums.plan_cpu_updates(order)
        self.staging.plan_cpu_updates(order, params)

    def after_update(self, sg: int) -> None:
        """Subgroup `sg`'s update has read its grads."""
        self.sums.after_update(sg)

    def clear(self) -> None:
        self.backwards = [0] * len(self.backwards)
        self.sums.clear()
        self.staging.clear()
        self._accumulated.clear()
        self._total, self.step_clip, self.after_clip, self._loss_scale_checked = None, None, 0, False
        self._param_grads_seen.clear()
        if self._square_sums is not None:
            self._square_sums.clear()

    def state_dict(self) -> dict | None:
        return None if self.loss_scaler is None else self.loss_scaler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if self.loss_scaler is not None and state:
            self.loss_scaler.load_state_dict(state)
