"""OffloadAdamW: AdamW whose FP32 master params and moments live out of core, in subgroups.

The model keeps bf16 (or fp16) params; the optimizer keeps their FP32 masters and the Adam moments in
subgroups that a `SubgroupStore` keeps on the GPU, in a host cache or on storage tiers. Each step
updates the subgroups (in the order order.py gives) from the low-precision grads (`StepGrads`),
upcast in flight, and copies the new low-precision params back into the model; with an FSDP2 model
it does so on a worker thread while the next forward runs (`UpdateInFlight`), and with
overlap="backward" it starts during backward, each subgroup in memory as soon as its grads are in.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .calibrate import TierSpeed
from .config import GIB, OffloadConfig, dataclass_from
from .fsdp import (
    CopyStream, cast_params, check_sharded_params, fsdp_units, install_forward_waits, install_grad_hooks, local_data, mesh_group,
    root_fsdp_module,
)  # fmt: skip
from .grad_sums import GradSums, grad_accumulation_memory, resolve_grad_accumulation
from .grads import LowpGrads, StepGrads, TierFP32Grads
from .kernels import get_adamw_kernel
from .memory import resolve_host_budget
from .metrics import StepMetrics, step_metrics
from .order import forward_order, order_ending_with, update_order
from .overlap import UpdateAborted, UpdateInFlight
from .placement import node_tier_speeds, placement_measures
from .staging import LowpStaging
from .store import STATE_KEYS, SubgroupStore, gpu_resident_subgroups, last_that_fit, moved_staging_itemsize
from .subgroups import SubgroupLayout

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with out-of-core FP32 state.

    Build it on the model's FP32 params: it takes their values as master weights and then casts the
    params to `offload.param_dtype`, so the model (and the GPU) hold no FP32 copy. Grads must then
    arrive in that dtype. For an FSDP2 model, the one line is

        optimizer = OffloadAdamW(model.parameters(), lr=3e-4, model=model, offload=OffloadConfig(...))

    which also hooks each sharded param so its grad shard goes to host memory as soon as it is reduced.

    `masters`: for a model already built in `offload.param_dtype` (never whole in FP32), the source of
    its FP32 master weights: `masters(p)` gives param p's local FP32 values (flat); it is asked in
    param order, a param once per subgroup it spans, and the model's params are set from what it gives
    (parallelize.StreamedMasters draws the init one module at a time).

    `tier_speeds`: one per `offload.tiers`, the speeds a bandwidth placement starts from (the plan's,
    `fsdp_offload.plan.make_plan(...).tier_speeds`), so the tiers are not measured a second time. With
    them the bandwidth profile is neither read nor written. Without them the profile gives the speeds,
    measuring the tiers it lacks; without a profile, each node's first rank measures the tiers for the
    node's ranks (a collective over the params' mesh).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        offload: OffloadConfig | None = None,
        model: torch.nn.Module | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        masters: Callable[[torch.Tensor], torch.Tensor] | None = None,
        tier_speeds: list[TierSpeed] | None = None,
    ) -> None:
        _refuse_torch_options(amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                              differentiable=differentiable, fused=fused)  # fmt: skip
        _check_hyperparameters(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), "OffloadAdamW")
        if isinstance(params, torch.nn.Module):
            raise TypeError(
                f"OffloadAdamW takes the params (model.parameters() or param groups), not the {type(params).__name__} "
                "itself: OffloadAdamW(model.parameters(), model=model, ...)"
            )
        self._frozen = False
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._frozen = True
        self.offload = cfg = offload_config(offload)
        self.param_dtype = _DTYPES[cfg.param_dtype]
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._models = [] if model is None else [model]
        self._check_params(streamed=masters is not None)
        self._root = None
        units = []
        if model is not None:
            self._root = root_fsdp_module(model)
            check_sharded_params(model, self._params)
            units = fsdp_units(model)
        elif any(hasattr(p, "device_mesh") for p in self._params):
            raise ValueError(
                "the params are FSDP2-sharded DTensors: pass model=model so OffloadAdamW can cast the model "
                "and hook its grad shards: OffloadAdamW(model.parameters(), ..., model=model)"
            )
        overlap = cfg.resolved_overlap()  # checked before anything is allocated
        if overlap == "backward" and not units:
            if cfg.overlap == "backward":
                raise ValueError(
                    "offload.overlap='backward' starts the update from the grad hooks of an FSDP2 model: pass "
                    "model=model, or use offload.overlap='next_forward'"
                )
            overlap = "next_forward"  # auto without a model: nothing to hook
        if cfg.overlap == "auto":
            log.info("offload.overlap='auto': %s", overlap)
        locals_ = [local_data(p) for p in self._params]
        device = locals_[0].device
        self.layout = SubgroupLayout([t.numel() for t in locals_], cfg.subgroup_numel)
        index = {id(p): i for i, p in enumerate(self._params)}
        unit_subgroups = [
            frozenset(sg for p in params if id(p) in index for sg, _ in self.layout.param_segments[index[id(p)]])
            for _, params in units
        ]
        self._forward = forward_order(unit_subgroups, len(self.layout))
        self._forward_rank = {sg: k for k, sg in enumerate(self._forward)}
        self.kernel_name, self._kernel = get_adamw_kernel(cfg.kernel)
        self._device = device
        on_gpu = gpu_resident_subgroups(self.layout, 0.0 if cfg.gpu_fraction == "auto" else cfg.gpu_fraction, device)
        self._gpu_kernel = _triton_kernel() if on_gpu else None
        self._size_gpu_share = cfg.gpu_fraction == "auto"  # after the first step
        if self._size_gpu_share and device.type != "cuda":
            log.info("offload.gpu_fraction=auto: the params are on %s, so all state stays off the GPU", device)
            self._size_gpu_share = False
        # sized before the staging buffer takes its share of the host memory that "auto" measures
        group = mesh_group(self._params)
        budget, budget_name = resolve_host_budget(cfg, group, device)
        grads_on_gpu = cfg.grad_path == "gpu_bf16"
        if grads_on_gpu and device.type != "cuda":
            raise ValueError(
                f"offload.grad_path='gpu_bf16' keeps the grads in GPU memory, but the params are on {device}: "
                "use offload.grad_path='host_bf16'"
            )
        staged_on_gpu = frozenset(range(len(self.layout))) if grads_on_gpu else on_gpu
        staging = LowpStaging(self.layout, self.param_dtype, device.type == "cuda", staged_on_gpu, device,
                              host_window=grads_on_gpu and len(on_gpu) < len(self.layout))  # fmt: skip
        # Once a node, not once a rank: a collective, so its condition is the same on every rank
        streams = cfg.gpu_fraction != 1.0  # (a rank's own layout may leave it nothing to stream)
        if tier_speeds is None and cfg.bandwidth_profile is None and streams and placement_measures(cfg) and group is not None:
            tier_speeds = node_tier_speeds(cfg, group)
        fp32_grads = cfg.grad_path == "tier_fp32"
        grad_slots = TierFP32Grads.slot_bytes(self.layout) if fp32_grads else []
        off_gpu = [sg for sg in range(len(self.layout)) if sg not in on_gpu]
        self.grad_accumulation = resolve_grad_accumulation(
            cfg.grad_accumulation, cfg.micro_batches, device.type,
            torch.cuda.mem_get_info(device)[0] - int(cfg.gpu_headroom_gb * GIB) if device.type == "cuda" else None,
            grad_accumulation_memory(self.layout, "gpu", cfg.micro_batches, off_gpu)[0],
        )  # fmt: skip
        sums_host_bytes = grad_accumulation_memory(self.layout, self.grad_accumulation, cfg.micro_batches, off_gpu)[1]
        sums = None
        try:
            sums = GradSums(self.layout, staging, self.grad_accumulation, device, on_gpu, planned=cfg.micro_batches > 1)
            self.store = SubgroupStore(
                cfg, self.layout, on_gpu, device, budget, budget_name,
                staging.nbytes + max(grad_slots, default=0) + sums_host_bytes,  # (the FP32 grad path's one buffer)
                grad_slots, self._forward, tier_speeds,
            )  # fmt: skip
        except BaseException:
            for pinned in (sums, staging):  # their pinned pages, before the memory can be reused
                if pinned is not None:
                    pinned.close()
            raise
        if cfg.micro_batches > 1:
            log.info("offload.grad_accumulation=%r: the grads of %d micro-batches are summed in FP32 on the %s",
                     cfg.grad_accumulation, cfg.micro_batches, "GPU" if self.grad_accumulation == "gpu" else "host")  # fmt: skip
        if cfg.host_budget_gb == "auto":
            log.info("%s: %d of %d subgroups off the GPU kept in host memory", budget_name,
                     self.store.cache.num_slots, len(self.store.host_subgroups))  # fmt: skip
        # None: step() updates every subgroup before it returns
        self._inflight = UpdateInFlight(unit_subgroups) if units and overlap != "none" else None
        self._during_backward = overlap == "backward"
        self._subgroups_of = [sorted({sg for sg, _ in segs}) for segs in self.layout.param_segments]
        # overlap="backward": per subgroup, how many of its params that take grads have yet to hand them in
        self._grads_expected = [0] * len(self.layout)
        for p, sgs in zip(self._params, self._subgroups_of):
            for sg in sgs:
                self._grads_expected[sg] += p.requires_grad
        self._grads_missing: list[int] = []
        self._grads_taken: set[int] = set()  # params whose grad this step's backward handed in
        self._closer = weakref.finalize(self, _close_all, [staging, sums, self.store, self._inflight])
        path = TierFP32Grads(self.layout, self.store.tiers, self.store.placement.tier_for) if fp32_grads else LowpGrads()
        self.grads = StepGrads(cfg, staging, path, sums, [t.shape for t in locals_], group, device)
        self._copies = CopyStream(device)

        self._steps = [0] * len(self._params)  # AdamW step count of each param
        self.step_count = 0  # optimizer steps taken: picks the update order
        self._pending: list[int] | None = None  # subgroups left of a step begun and not finished
        self._unwritten: set[int] = set()  # updated subgroups whose params did not reach the model yet
        self._pending_scale = 1.0
        self._hyper: list[dict[str, float]] = []  # each group's hyperparameters, taken when the step began
        self._after_backward = None  # CUDA event after the work queued before step(): the update's copies follow it
        self._begin_s = 0.0  # time step() took before the update could start
        self._norm_s = 0.0  # time this step's step() took to take the grad norm (metrics.norm_s)
        self._finished: StepMetrics | None = None  # the last update's metrics, before finish_update publishes them
        self.last_metrics: StepMetrics | None = None  # the last finished update's
        self._untaken: deque[StepMetrics] = deque(maxlen=1024)  # finished steps' metrics, for take_metrics()
        self.skipped_steps = 0  # fp16 steps skipped for inf/nan grads

        if masters is None:  # the FP32 params are the masters
            flat = [t.detach().reshape(-1) for t in locals_]
            self.store.fill(self._pass_order(), {"master_param": flat.__getitem__})  # moments start at zero
        else:  # in param order, as a streamed source draws them; the model's params follow the masters
            self.store.fill(list(range(len(self.layout))), {"master_param": lambda i: masters(self._params[i])},
                            then=self.load_params_from_master)  # fmt: skip
            self._copies.wait_host()
        self._hooks: list = []  # removed at close(): a closed optimizer takes no grads
        if model is not None:
            if masters is None:
                cast_params(model, self.param_dtype)
            setattr(model, _CAST_MARK, True)
            self._hooks = install_grad_hooks(self._params, self.stage_grad)
            if self._inflight is not None:
                self._hooks += install_forward_waits([modules for modules, _ in units], self._inflight.wait_unit)
        else:
            for p in self._params:
                if masters is None:
                    p.data = p.data.to(self.param_dtype)
                setattr(p, _CAST_MARK, True)
        self._show_state()

    def placement(self) -> dict[str, Any]:
        """Where this rank's subgroups live now: on the GPU, in host cache slots, and by tier (the one
        each would be written to), as the planner (plan.py) predicts it."""
        streams = self.store.cache.num_slots < len(self.store.host_subgroups)  # else no subgroup reaches a tier
        tiers = [self.store.placement.tier_for(sg) for sg in self.store.host_subgroups] if streams else []
        return {"subgroups": len(self.layout), "gpu_subgroups": len(self.store.gpu_state),
                "cache_slots": self.store.cache.num_slots,
                "tier_subgroups": {t.name: tiers.count(i) for i, t in enumerate(self.store.tiers)}}  # fmt: skip

    def _check_params(self, streamed: bool) -> None:
        """`streamed`: the params are already in param_dtype and `masters=` gives the FP32 values."""
        if not self._params:
            raise ValueError("OffloadAdamW got an empty parameter list")
        devices = {local_data(p).device.type for p in self._params}
        if len(devices) > 1:
            raise ValueError(f"params are on mixed device types {sorted(devices)}: put the whole model on one device")
        for i, p in enumerate(self._params):
            if streamed:
                if p.dtype != self.param_dtype:
                    raise ValueError(
                        f"param {i} (shape {tuple(p.shape)}) is {p.dtype}: with masters= the model is built in "
                        f"offload.param_dtype={self.offload.param_dtype} and the masters come from the source "
                        "(parallelize.build_offloaded_model does both); without masters=, give FP32 params"
                    )
            elif p.dtype != torch.float32 and any(getattr(x, _CAST_MARK, False) for x in [p, *self._models]):
                raise ValueError(
                    f"param {i} (shape {tuple(p.shape)}) is {p.dtype}: an earlier OffloadAdamW cast this model and "
                    "holds its FP32 master weights. Keep using that optimizer; to rebuild one (other options, "
                    "another tier), save the old one's state (state_dict() or a DCP checkpoint), close() it, "
                    "build the model again in FP32, build the new optimizer on it and load the state"
                )
            elif p.dtype != torch.float32:
                raise ValueError(
                    f"param {i} (shape {tuple(p.shape)}) is {p.dtype}, not float32: OffloadAdamW takes its FP32 "
                    "master weights from the model's FP32 params and casts the model to "
                    f"{self.offload.param_dtype} itself; build it before casting the model"
                )
            if not local_data(p).is_contiguous():
                raise ValueError(f"param {i} (shape {tuple(p.shape)}) is not contiguous")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_frozen", False):
            raise RuntimeError(
                "OffloadAdamW lays out its subgroups when it is built; params cannot be added later. "
                "Build a new optimizer over all params"
            )
        _refuse_torch_options(**{k: param_group[k] for k in _TORCH_OPTIONS if k in param_group})
        _check_hyperparameters(param_group, f"param group {len(self.param_groups)}")
        super().add_param_group(param_group)

    # -- grads ----------------------------------------------------------------------------------

    @property
    def loss_scaler(self):
        """The fp16 dynamic loss scaler (None with bf16)."""
        return self.grads.loss_scaler

    @property
    def last_grad_norm(self) -> float | None:
        return self.grads.last_norm

    def stage_grad(self, index: int, grad: torch.Tensor) -> None:
        """Hands param `index`'s low-precision grad to the staging buffer (hooks call this)."""
        self._check_open()
        if self._during_backward:
            self._stage_grad_during_update(index, grad)
            return
        self._ready_for_grads()
        self.grads.stage(index, grad)

    def _stage_param_grads(self) -> None:
        """Stages the `.grad` of params that no hook handed over (params without model=)."""
        self.grads.stage_param_grads([None if p.grad is None else local_data(p.grad) for p in self._params], self._copies)

    def _ready_for_grads(self) -> None:
        """Before a backward's grads go into the staging buffer: the last update has ended (it writes
        the new params there) and did not stop part-way (its buffers are still its own)."""
        self.finish_update()
        if self._pending is not None:
            raise RuntimeError(
                f"step {self.step_count} stopped part-way ({len(self._pending)} subgroups left to update) and "
                "its buffers are still in use: call step() again to finish it before the next backward"
            )

    def _stage_grad_during_update(self, index: int, grad: torch.Tensor) -> None:
        """overlap="backward": the step's first grad starts its update; a subgroup whose grads are all in
        is handed to it at once."""
        if not self._inflight.awaiting_grads:
            self._start_update_in_backward()
        elif index in self._grads_taken:
            raise RuntimeError(
                f"param {index} (shape {tuple(grad.shape)}) got a second grad before step(): with "
                "offload.overlap='backward' a subgroup is updated as soon as its grads are in, so grads cannot "
                "accumulate over several backwards; call step() after each backward, or use "
                "offload.overlap='next_forward' for gradient accumulation"
            )
        self.grads.stage(index, grad)
        self._grads_taken.add(index)
        for sg in self._subgroups_of[index]:
            self._grads_missing[sg] -= 1
            if self._grads_missing[sg] == 0:
                self._inflight.grads_in(sg, self._copies.record_current())  # the hook's copies, on FSDP2's stream

    def _start_update_in_backward(self) -> None:
        self._ready_for_grads()
        start = time.perf_counter()
        self.store.require_loaded()
        if self._size_gpu_share and self.last_metrics is not None:
            self._grow_gpu_share()
        self._plan_step(1.0)  # no clipping, bf16: the factor is known before the grads
        self._grads_missing, self._grads_taken = list(self._grads_expected), set()
        self._after_backward = self._copies.mark_current()
        self._inflight.start(lambda: self._update(start), before_grads=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._inflight is not None and self._inflight.awaiting_grads:
            raise RuntimeError(
                "zero_grad() between backward and step(): with offload.overlap='backward' backward has already "
                "updated subgroups with these grads; call step() first"
            )
        super().zero_grad(set_to_none)
        if self._pending is None and not (self._inflight is not None and self._inflight.busy):
            self.grads.clear()  # (an update in flight clears them when it ends)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` for this optimizer's params, whose grads the hooks took out
        of `p.grad` (so torch's own function sees none): returns the global L2 norm of this step's
        grads (all ranks, every backward since the last step) as a tensor, and has the next `step()`
        scale them so that it is at most `max_norm`, in flight. The first call on an optimizer built
        without `offload.max_grad_norm` sums the grads already staged on the CPU; from then on the
        hooks take each grad's sum of squares where it is, as `max_grad_norm` does."""
        self._check_open()
        if norm_type != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): OffloadAdamW clips by the L2 norm (2.0) only")
        if not (max_norm > 0 and math.isfinite(max_norm)):
            raise ValueError(f"clip_grad_norm_(max_norm={max_norm}): give a positive number")
        if self._inflight is not None and self._inflight.awaiting_grads:
            raise RuntimeError(
                "clip_grad_norm_() with offload.overlap='backward': backward has already updated subgroups with "
                "unclipped grads; use offload.overlap='next_forward' to clip"
            )
        self.finish_update()
        self._stage_param_grads()
        if not any(self.grads.staged):
            raise RuntimeError("clip_grad_norm_() called before any backward: no param has a grad")
        norm = self.grads.norm()
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(f"the total norm of the grads is {norm}: clip_grad_norm_(error_if_nonfinite=True)")
        self.grads.step_max_norm = max_norm
        return torch.tensor(norm, dtype=torch.float64, device=self._device)  # the value the step clips by

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the dynamic loss scale with fp16, as is otherwise."""
        return self.grads.scale_loss(loss)

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Updates every subgroup: with the update overlapped, on a worker thread, returning at once
        (the next forward waits per FSDP unit for its params; `finish_update` waits for all of it).
        If the update raises (an I/O error, say), nothing is lost: the error surfaces where it is
        waited for, and the next call finishes the same step from the subgroup where it stopped."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._inflight is not None and self._inflight.awaiting_grads:
            self._hand_in_last_grads()
            return loss
        self.finish_update()
        start = time.perf_counter()
        self.store.require_loaded()
        if self._size_gpu_share and self._pending is None and self.last_metrics is not None:
            self._grow_gpu_share()
        if self._pending is None and not self._begin_step(start):
            return loss  # fp16 overflow: no state was touched
        self._begin_s = time.perf_counter() - start
        if self._inflight is None:
            self._update(start)
            self._publish_metrics(0.0)
        else:
            self._after_backward = self._copies.mark_current()
            everything = range(len(self.layout))  # a retry: what the failed try finished is in the model
            done = set(everything) - set(self._pending) - self._unwritten
            self._inflight.start(lambda: self._update(start), in_model=done)
        return loss

    def _hand_in_last_grads(self) -> None:
        """overlap="backward": the update started during backward; the rest of the subgroups may go now."""
        start = time.perf_counter()
        self._stage_param_grads()
        self._inflight.all_grads_in()
        self._begin_s = time.perf_counter() - start

    def _grow_gpu_share(self) -> None:
        """gpu_fraction="auto": moves to the GPU as many subgroups (the last ones) as the GPU memory left
        by the peak so far holds, keeping gpu_headroom_gb free. Runs once, between the first two updates."""
        self._size_gpu_share = False
        device, headroom = self._device, int(self.offload.gpu_headroom_gb * (1 << 30))
        free, total = torch.cuda.mem_get_info(device)
        peak = torch.cuda.max_memory_allocated(device)
        # what this process may still take (free, plus what its allocator caches) beyond its own peak
        available = free + torch.cuda.memory_reserved(device) - peak - headroom
        moving = moved_staging_itemsize(self.offload.grad_path, self.param_dtype.itemsize)
        count, used = last_that_fit(self.layout, self.store.host_subgroups, available, moving)
        if count:
            self._copies.wait_host()  # the grads staged for this step are read as they move
            chosen = self.store.host_subgroups[len(self.store.host_subgroups) - count :]
            try:
                staging = self.grads.staging.device_buffer_for(chosen, device)
                moved = self.store.move_to_gpu(count, device)  # all or nothing
            except torch.OutOfMemoryError as exc:  # an economy only: the state stays where it is
                log.warning("offload.gpu_fraction=auto: moving %d subgroups to the GPU ran out of memory (%s); "
                            "they stay off the GPU: raise offload.gpu_headroom_gb", count, str(exc).splitlines()[0])  # fmt: skip
                return
            self.grads.staging.move_to_device(moved, staging)
            self._gpu_kernel = self._gpu_kernel or _triton_kernel()
        log.info(
            "offload.gpu_fraction=auto: %d of %d subgroups (%.2f GiB of state and staging) now live on the GPU; "
            "%.2f GiB of %.2f GiB were free beyond the peak of %.2f GiB, keeping gpu_headroom_gb=%.1f",
            len(self.store.gpu_state), len(self.layout), used / 2**30, max(0, available + headroom) / 2**30,
            total / 2**30, peak / 2**30, self.offload.gpu_headroom_gb,
        )  # fmt: skip

    def finish_update(self) -> None:
        """Waits until the update of the last step has finished and its params are in the model;
        raises its error, if it had one. Saves, loads and the next step call it themselves."""
        if self._inflight is None or not self._inflight.busy:
            return
        if self._inflight.awaiting_grads:
            raise RuntimeError(
                "backward has started this step's update (offload.overlap='backward') and step() has not been "
                "called: call step() first, then save, load or read the params"
            )
        try:
            self._inflight.finish()
        finally:
            self._copies.current_waits()  # the params copied so far (all, or a failed try's), for what reads them next
            self._publish_metrics(self._inflight.waited_s)

    def _publish_metrics(self, waited_s: float) -> None:
        m, self._finished = self._finished, None
        if m is None:
            return  # the update raised before it ended
        m.exposed_update_s = m.update_s if self._inflight is None else self._begin_s + waited_s
        m.lock_wait_s = self.store.lock_waits()
        self._published(m)
        m.log()

    def _published(self, m: StepMetrics) -> None:
        self.last_metrics = m
        self._untaken.append(m)

    def take_metrics(self) -> list[StepMetrics]:
        """The metrics of every step finished since the last call (a skipped fp16 step's too), oldest
        first: a step() that skips can follow the end of the step before it, so `last_metrics` alone
        may pass one by. Kept for the last 1024 steps."""
        taken = list(self._untaken)
        self._untaken.clear()
        return taken

    @torch.no_grad()  # grad mode is per thread: this may run on the update's own
    def _update(self, start: float) -> None:
        """Updates the subgroups of `_pending` and copies their params back into the model."""
        params = [local_data(p) for p in self._params]
        updated: set[int] = set()

        def update(sg: int, state: torch.Tensor) -> None:
            if self._inflight is not None:
                self._inflight.wait_grads(sg)
            with _interrupts_between_subgroups():  # the kernel writes params over the grads: no retry may see half
                self._update_subgroup(sg, state, self._pending_scale)
                updated.add(sg)  # its state is new now: a retry must not update it again
                self._unwritten.add(sg)
            self._copy_back(sg, params)

        with self._copies.after(self._after_backward) if self._inflight is not None else contextlib.nullcontext():
            try:
                for sg in sorted(self._unwritten):  # params a failed try updated but did not copy back
                    self._copy_back(sg, params)
                if self._during_backward:
                    self._update_as_grads_arrive(update)
                self.store.run_update([sg for sg in self._pending if sg not in updated], update)
            finally:
                # [] until _finish_step: every subgroup is new, the step is not closed (a retry closes it)
                self._pending = [sg for sg in self._pending if sg not in updated]
                if self._inflight is None:
                    self._params_written()
            self._finish_step(start)

    def _update_as_grads_arrive(self, update: Callable[[int, torch.Tensor], None]) -> None:
        """overlap="backward": the subgroups in memory, each as soon as its grads are in; of those whose
        grads are in, the one the next forward needs first (backward hands in the root unit's grads,
        which the forward needs first, last of all)."""
        resident = self.store.resident()
        left = [sg for sg in self._pending if sg in resident]
        while left:
            sg = self._inflight.next_with_grads(left, self._forward_rank.__getitem__)
            left.remove(sg)
            self.store.run_update([sg], update)

    def _copy_back(self, sg: int, params: list[torch.Tensor]) -> None:
        with self._copies.after_current():
            self.grads.staging.copy_params_to_model(sg, params)
        self._unwritten.discard(sg)
        if self._inflight is not None:
            self._inflight.params_ready(sg, self._copies.record())

    def _begin_step(self, start: float) -> bool:
        """Stages what backward left, writes the FP32 grads (that path only) and takes the grad scale;
        False when fp16 grads overflowed and the step is skipped."""
        self._stage_param_grads()
        staged = self.grads.staged
        if not any(staged):
            raise RuntimeError("step() called before any backward: no param has a grad")
        # first: if it fails, the step has changed nothing yet
        self.store.record_io(self.grads.before_update(self.store.host_subgroups))
        taken = time.perf_counter()
        scale = self.grads.grad_scale()
        self._norm_s = time.perf_counter() - taken
        if scale is None:
            self.skipped_steps += 1
            self.grads.clear()
            transfers, _ = self.store.take_io()  # the FP32 grads written before the overflow was seen
            m = step_metrics(self.step_count, time.perf_counter() - start, 0, len(self.layout), 0, transfers, {})
            m.skipped, m.exposed_update_s = True, m.update_s
            m.norm_s, self._norm_s = self._norm_s, 0.0
            self._published(m)
            return False
        self._plan_step(scale)
        return True

    def _plan_step(self, grad_scale: float) -> None:
        """Takes the grad factor and each group's hyperparameters, and the order of the subgroups."""
        self._pending_scale = grad_scale
        # taken now: a scheduler may change them while the update runs
        self._hyper = [
            {"lr": float(g["lr"]), "beta1": float(g["betas"][0]), "beta2": float(g["betas"][1]),
             "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])}
            for g in self.param_groups
        ]  # fmt: skip
        self._pending = update_order(self._forward, self.step_count, self.offload.update_order, self.store.resident())

    def _update_subgroup(self, sg: int, state: torch.Tensor, grad_scale: float) -> None:
        subgroup = self.layout.subgroups[sg]
        p, m, v = subgroup.parts(state)
        staging = self.grads.staging
        # the kernel writes the new low-precision params over the grads
        out = staging.view(sg) if state.is_cuda else staging.for_cpu_update(sg)
        g, transfer = self.grads.for_update(sg, out, state.is_cuda)
        if transfer is not None:
            self.store.record_io([transfer])
        kernel = self._gpu_kernel if state.is_cuda else self._kernel
        staged = self.grads.staged
        # Params lie back to back in a subgroup: neighbours of one param group at one Adam step are
        # updated by one kernel call (the update is elementwise, so this changes no bit).
        runs: list[list] = []  # [start, stop, (group, step)]
        for seg in subgroup.segments:
            if not staged[seg.param]:
                continue
            key = (self._group_of[seg.param], self._steps[seg.param] + 1)  # the step this update takes
            if runs and runs[-1][2] == key and runs[-1][1] == seg.offset:
                runs[-1][1] = seg.offset + seg.numel
            else:
                runs.append([seg.offset, seg.offset + seg.numel, key])
        for lo, hi, (group, step) in runs:
            piece = slice(lo, hi)
            kernel(
                p[piece], m[piece], v[piece], g[piece], out[piece],
                **self._hyper[group], step=step, grad_scale=grad_scale,
            )  # fmt: skip
        if not state.is_cuda:
            staging.after_cpu_update(sg, out)

    def _params_written(self) -> None:
        """Makes the next forward wait for the params copied back so far."""
        event = self._copies.record()
        if event is None:
            return
        if self._root is not None:
            self._root.set_post_optim_event(event)
        else:
            torch.cuda.current_stream().wait_event(event)

    def _finish_step(self, start: float) -> None:
        transfers, hits = self.store.take_io()
        updated = sum(n for n, has in zip(self.layout.numels, self.grads.staged) if has)
        self._finished = step_metrics(
            self.step_count, time.perf_counter() - start, updated, len(self.layout), hits, transfers,
            self.store.stored_locations(),
        )  # fmt: skip
        self._finished.subgroups_on_gpu = len(self.store.gpu_state)
        self._finished.norm_s, self._norm_s = self._norm_s, 0.0
        for i, has in enumerate(self.grads.staged):
            self._steps[i] += has
        self.step_count += 1
        self.grads.clear()
        self._pending = None

    def _show_state(self) -> None:
        """`self.state[p]` answers as torch's AdamW's does: 'step' at once, the moments and the FP32
        master when asked (`ParamState`). A non-empty `state` also tells torch's distributed state-dict
        API that the state exists (it would otherwise run a zero-lr step to create it)."""
        for i, p in enumerate(self._params):
            self.state[p] = ParamState(self, i)

    @torch.no_grad()
    def param_state(self, index: int, key: str) -> torch.Tensor:
        """Param `index`'s `key` (one of STATE_KEYS), this rank's part read from wherever its subgroups
        live, shaped as the param (a DTensor for a sharded one)."""
        self._check_no_pending_step()
        p = self._params[index]
        out: list[dict[str, torch.Tensor]] = [{} for _ in self._params]
        out[index][key] = torch.empty(local_data(p).shape, dtype=torch.float32)
        self.store.gather(list(self._subgroups_of[index]), out)  # (a pass reorders its list)
        return _like_param(out[index][key], p)

    def _check_open(self) -> None:
        if not self._closer.alive:
            raise RuntimeError(
                "this OffloadAdamW was closed (its tier files and buffers are gone): build a new one, and load "
                "a checkpoint into it to go on"
            )

    def _check_no_pending_step(self) -> None:
        self._check_open()
        self.finish_update()
        if self._pending is not None:
            raise RuntimeError(
                f"step {self.step_count} stopped part-way ({len(self._pending)} subgroups left to update); "
                "call step() again to finish it before saving or loading state"
            )

    # -- state ----------------------------------------------------------------------------------

    def _pass_order(self) -> list[int]:
        """The order of a pass that is not a step (a fill, a gather): it leaves the host cache holding
        what the next step needs first."""
        return order_ending_with(self._forward, self.step_count, self.offload.update_order)

    @torch.no_grad()
    def load_params_from_master(self, sg: int, master: torch.Tensor) -> None:
        """The model's params in subgroup `sg` from its new FP32 masters, rounded (after a fill or a load)."""
        with self._copies.after_current():
            self.grads.staging.load_params_from_master(sg, master, [local_data(p) for p in self._params])

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """Like torch.optim.AdamW's, plus each param's FP32 'master_param', all gathered in host memory:
        for an FSDP2-sharded param each tensor is a DTensor sharded as the param is (its local shard in
        host memory), as torch's optimizers give, so torch's distributed state-dict API and DCP see
        whole tensors. The offload's own counters ride in the first param group ("fsdp_offload"),
        which that API keeps.

        For models whose state does not fit host memory, checkpoint through the DCP Stateful instead.
        """
        self._check_no_pending_step()
        out = [{k: torch.empty(local_data(p).shape, dtype=torch.float32) for k in STATE_KEYS} for p in self._params]
        self.store.gather(self._pass_order(), out)
        state = {
            i: {"step": torch.tensor(float(self._steps[i])), **{k: _like_param(t, p) for k, t in out[i].items()}}
            for i, p in enumerate(self._params)
        }
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        groups[0][_META_KEY] = self._offload_meta()
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def full_fp32_state_dict(self, model: torch.nn.Module | None = None, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The FP32 master weights as whole tensors keyed by parameter name (`model`'s, by default the
        one given at construction), in host memory: for `model.load_state_dict` of an FP32 copy of the
        model, `torch.save`, or `save_pretrained`. Collective under FSDP2: every rank calls it, and with
        `rank0_only` only rank 0 gets the tensors (one whole param at a time crosses the others). Each
        rank first gathers its own masters' shards (4 bytes per local param) in host memory."""
        self._check_no_pending_step()
        model = model if model is not None else (self._models[0] if self._models else None)
        if model is None:
            raise ValueError("full_fp32_state_dict() names params by the model's names: pass model= (here or at construction)")
        names = {id(p): name for name, p in model.named_parameters()}
        missing = [i for i, p in enumerate(self._params) if id(p) not in names]
        if missing:
            raise ValueError(f"params {missing[:5]} of this optimizer are not parameters of the model given")
        out = [{"master_param": torch.empty(local_data(p).shape, dtype=torch.float32)} for p in self._params]
        self.store.gather(self._pass_order(), out)
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
        full: dict[str, torch.Tensor] = {}
        for p, o in zip(self._params, out):
            t = o["master_param"]
            if isinstance(p, DTensor):  # the local shard goes where the mesh's collectives run
                t = _like_param(t.to(local_data(p).device), p).full_tensor().cpu()
            if keep:
                full[names[id(p)]] = t
        return full

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores masters, moments, step counts and hyperparameters, and rewrites the model's params
        from the restored masters."""
        self._check_no_pending_step()
        groups = state_dict["param_groups"]
        self._check_groups([len(g["params"]) for g in groups])
        # params are matched by position: keys are indices from state_dict(), or the names torch's
        # distributed state-dict API gives them (in this optimizer's order)
        keys = [k for g in groups for k in g["params"]]
        state = [state_dict["state"].get(k, {}) for k in keys]
        for i, p in enumerate(self._params):
            want = tuple(local_data(p).shape)
            for key in ("step", *STATE_KEYS):
                if key not in state[i]:
                    raise ValueError(f"state_dict param {i} ({keys[i]!r}) has no {key!r}: it was not saved by OffloadAdamW")
            for key in STATE_KEYS:
                got = tuple(local_data(state[i][key]).shape)
                if got != want:
                    raise ValueError(
                        f"state_dict param {i} ({keys[i]!r}) {key}: local shape {got}, expected {want} (another model or sharding?)"
                    )

        def flat(key: str) -> Callable[[int], torch.Tensor]:
            return lambda i: local_data(state[i][key]).reshape(-1).to(torch.float32)

        self.begin_load()
        self.store.fill(self._pass_order(), {key: flat(key) for key in STATE_KEYS}, then=self.load_params_from_master)
        self._end_load(
            [{k: v for k, v in g.items() if k not in ("params", _META_KEY)} for g in groups],
            [int(s["step"]) for s in state],
            groups[0].get(_META_KEY) or state_dict.get("offload", {}),  # (state dicts saved before it moved)
        )

    def _check_groups(self, sizes: list[int]) -> None:
        mine = [len(g["params"]) for g in self.param_groups]
        if sizes != mine:
            raise ValueError(
                f"the saved state has param groups of sizes {sizes}, this optimizer {mine}: it was saved from "
                "another model or another split of params into groups"
            )

    def begin_load(self) -> None:
        """Before a load overwrites subgroups (`store.overwrite`): until it ends, the optimizer refuses to step."""
        self._check_no_pending_step()
        self._copies.wait_host()  # the last step's copies to the model still read the staging buffer
        self.grads.clear()
        self.store.begin_load()

    def _end_load(self, groups: list[dict], steps: list[int], meta: dict[str, Any]) -> None:
        """After every subgroup (and the model's params) was rewritten: takes the saved hyperparameters
        and counters."""
        self.store.end_load()
        self.grads.clear()
        self._params_written()
        for mine, g in zip(self.param_groups, groups):
            mine.update(g)
        self._steps = list(steps)
        self.step_count = int(meta.get("step_count", 0))
        self.grads.load_state_dict(meta.get("loss_scaler"))
        if meta.get("placement"):
            self.store.placement.load_state_dict(meta["placement"])

    def _offload_meta(self) -> dict[str, Any]:
        return {"step_count": self.step_count, "loss_scaler": self.grads.state_dict(), "placement": self.store.placement.state_dict()}

    # -- checkpoints through DCP: subgroups go through `store`; this is the rest -------------------

    def checkpoint_meta(self) -> dict[str, Any]:
        """Everything but the subgroups: what `load_checkpoint_meta` restores after they are written."""
        self._check_no_pending_step()
        self.store.require_loaded()
        return {
            "layout": self.store.layout_signature(),
            "steps": list(self._steps),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "group_sizes": [len(g["params"]) for g in self.param_groups],
            "offload": self._offload_meta(),
        }

    def load_checkpoint_meta(self, meta: dict[str, Any]) -> None:
        """Ends a load whose subgroups were all overwritten: checks the layout they were saved in and
        takes the saved step counts, hyperparameters and offload state."""
        self.store.check_layout(meta["layout"])
        self._check_groups(meta["group_sizes"])
        self._end_load(meta["param_groups"], meta["steps"], meta["offload"])

    def close(self) -> None:
        """Waits for the update in flight, then deletes this rank's tier files and releases pinned memory."""
        try:
            if self._inflight is not None and self._inflight.awaiting_grads:
                # closed between backward and step() (backward raised, say): the step is dropped, not applied
                self._inflight.abort()
                with contextlib.suppress(UpdateAborted):
                    self._inflight.finish()
            self.finish_update()
        finally:
            self._copies.wait_host()  # copies still reading the staging buffer, before it is unpinned
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._closer()


class ParamState(Mapping):
    """`opt.state[p]` of an OffloadAdamW: 'step' (a tensor, as torch's AdamW), and 'exp_avg',
    'exp_avg_sq' and 'master_param' read from the store on access (each a copy: writing to it changes
    nothing; load_state_dict does)."""

    def __init__(self, opt: OffloadAdamW, index: int) -> None:
        self._opt, self._index = opt, index

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == "step":
            self._opt.finish_update()  # the update in flight counts its step when it ends
            return torch.tensor(float(self._opt._steps[self._index]))
        if key in STATE_KEYS:
            return self._opt.param_state(self._index, key)
        raise KeyError(key)

    def __iter__(self):
        return iter(("step", *STATE_KEYS))

    def __len__(self) -> int:
        return 1 + len(STATE_KEYS)


_META_KEY = "fsdp_offload"  # the first param group's entry for the offload's own counters
_CAST_MARK = "_cast_by_offload_adamw"  # set on the models and params an OffloadAdamW cast to low precision
_TORCH_OPTIONS = {
    "amsgrad": "it keeps a fourth FP32 state tensor (the running max of exp_avg_sq) that the out-of-core layout has no room for",
    "maximize": "the fused kernels descend; negate the loss instead",
    "foreach": "torch's implementation choice: OffloadAdamW always runs its own kernels (choose with offload.kernel)",
    "fused": "torch's implementation choice: OffloadAdamW always runs its own kernels (choose with offload.kernel)",
    "capturable": "the update runs on the CPU and storage, outside any CUDA graph",
    "differentiable": "the update is not part of autograd",
}


def offload_config(offload: OffloadConfig | Mapping | None) -> OffloadConfig:
    """`offload=` as given: an OffloadConfig, a mapping of its options (a Hydra/YAML section), or None."""
    if offload is None:
        return OffloadConfig()
    if isinstance(offload, OffloadConfig):
        return offload
    if isinstance(offload, Mapping):
        return dataclass_from(OffloadConfig, offload, f"offload={dict(offload)!r}")
    raise TypeError(f"offload= takes an OffloadConfig or a dict of its options, not {type(offload).__name__}")


@contextlib.contextmanager
def _interrupts_between_subgroups():
    """Holds a Ctrl-C (SIGINT) that arrives inside the block until the block has finished, then raises
    it: a subgroup's update, which overwrites its grads with the new params run by run, is then done
    whole or not at all, and a retried step() never takes params for grads. Off the main thread (the
    overlapped update's worker) no signal is delivered, so there is nothing to hold."""
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if previous is None:  # a worker thread, or a handler not set from Python: leave it be
        yield
        return
    held: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held and callable(previous):
            previous(*held[0])  # the default handler raises KeyboardInterrupt here, between subgroups
        elif held and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


def _check_hyperparameters(values: dict[str, Any], where: str) -> None:
    """AdamW's hyperparameters that `values` sets, checked as torch AdamW checks them (NaN refused
    too), and of their kind: numbers (or what float() takes, as a 0-d tensor), betas a pair."""

    def number(value: Any) -> float:
        try:
            return math.nan if isinstance(value, bool) else float(value)
        except (TypeError, ValueError, RuntimeError):
            return math.nan

    for name, must in (("lr", "a number >= 0"), ("eps", "a number >= 0"), ("weight_decay", "a number >= 0 (0: none)")):
        if name in values and not number(values[name]) >= 0.0:
            raise ValueError(f"{where}: invalid {name} {values[name]!r}: must be {must}")
    if "betas" in values:  # a pair of any kind torch AdamW takes: a tuple, a list, Hydra's ListConfig, a tensor
        betas = values["betas"]
        try:
            pair = [number(b) for b in betas] if not isinstance(betas, str) else []
        except TypeError:  # not iterable
            pair = []
        if not (len(pair) == 2 and all(0.0 <= b < 1.0 for b in pair)):
            raise ValueError(f"{where}: invalid betas {betas!r}: give two numbers in [0, 1), e.g. (0.9, 0.999)")


def _refuse_torch_options(**given: Any) -> None:
    """torch AdamW's options other than the math ones: their defaults are accepted, any other value is
    refused by name with why."""
    for name, value in given.items():
        if value:
            raise ValueError(f"OffloadAdamW does not support {name}={value!r}: {_TORCH_OPTIONS[name]}")


def _like_param(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`t` (the local part of a state tensor of `p`) shaped as `p`: a DTensor sharded like `p` when
    `p` is one."""
    if not isinstance(p, DTensor):
        return t
    # Built as FSDP2 builds its CPU-offloaded params: DTensor.from_local would copy `t` to the mesh's
    # device (all FP32 state onto the GPU); the local part stays where it is.
    spec = DTensorSpec(p.device_mesh, p.placements, tensor_meta=TensorMeta(p.shape, p.stride(), t.dtype))
    return DTensor(t.view(local_data(p).shape), spec, requires_grad=False)


def _triton_kernel() -> Callable:
    from .kernels.triton_adamw import triton_adamw_step

    return triton_adamw_step


def _close_all(resources: list) -> None:
    for r in reversed(resources):
        if r is not None:
            r.close()
