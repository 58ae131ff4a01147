"""OffloadAdamW: AdamW whose FP32 master params and moments live out of core, in subgroups.

The model keeps bf16 (or fp16) params; the optimizer keeps their FP32 masters and the Adam moments in
subgroups that stream through a host cache and storage tiers. Each step updates the subgroups in
alternating order from the low-precision grads, upcast in flight, and writes the new low-precision
params back into the model.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
import weakref
from typing import Any, Callable, Iterable

import torch

from .cache import HostCache, aligned_host_buffer
from .config import OffloadConfig, format_bytes
from .grad_flush import GRAD_PATHS, FP32GradFlush, grad_slot_bytes
from .fsdp import CopyStream, check_sharded_params, install_grad_hooks, local_data, mesh_group, root_fsdp_module
from .kernels import get_adamw_kernel
from .loss_scale import DynamicLossScaler
from .metrics import StepMetrics, step_metrics
from .placement import make_placement
from .schedule import UPDATE_ORDERS, SubgroupPipeline, update_order
from .staging import LowpStaging
from .storage import Tier, open_tiers
from .storage.base import ALIGN
from .subgroups import SubgroupLayout

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _rank_tag() -> str:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return f"rank{rank}-pid{os.getpid()}-{uuid.uuid4().hex[:8]}"


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with out-of-core FP32 state.

    Build it on the model's FP32 params: it takes their values as master weights and then casts the
    params to `offload.param_dtype`, so the model (and the GPU) hold no FP32 copy. Grads must then
    arrive in that dtype. For an FSDP2 model, the one line is

        optimizer = OffloadAdamW(model.parameters(), lr=3e-4, model=model, offload=OffloadConfig(...))

    which also hooks each sharded param so its grad shard goes to host memory as soon as it is reduced.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        offload: OffloadConfig | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"invalid lr {lr}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if not 0.0 <= eps:
            raise ValueError(f"invalid eps {eps}: must be >= 0")
        self._frozen = False
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._frozen = True
        self.offload = cfg = offload or OffloadConfig()
        if cfg.update_order not in UPDATE_ORDERS:
            raise ValueError(f"offload.update_order={cfg.update_order!r}: choose one of {UPDATE_ORDERS}")
        if cfg.param_dtype not in _DTYPES:
            raise ValueError(f"offload.param_dtype={cfg.param_dtype!r}: choose one of {sorted(_DTYPES)}")
        if cfg.prefetch < 0:
            raise ValueError(f"offload.prefetch={cfg.prefetch} must be >= 0")
        if cfg.grad_path not in GRAD_PATHS:
            raise ValueError(f"offload.grad_path={cfg.grad_path!r}: choose one of {GRAD_PATHS}")
        if cfg.grad_path == "tier_fp32" and not cfg.tiers:
            raise ValueError("offload.grad_path='tier_fp32' writes grads to a tier: give offload.tiers too")
        self.param_dtype = _DTYPES[cfg.param_dtype]

        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._check_params()
        if model is not None:
            self._root = root_fsdp_module(model)
            check_sharded_params(model, self._params)
        elif any(hasattr(p, "device_mesh") for p in self._params):
            raise ValueError(
                "the params are FSDP2-sharded DTensors: pass model=model so OffloadAdamW can cast the model "
                "and hook its grad shards: OffloadAdamW(model.parameters(), ..., model=model)"
            )
        locals_ = [local_data(p) for p in self._params]
        self._local_shapes = [t.shape for t in locals_]
        self.layout = SubgroupLayout([t.numel() for t in locals_], cfg.subgroup_numel)
        self.kernel_name, self._kernel = get_adamw_kernel(cfg.kernel)
        pin = any(t.is_cuda for t in locals_)
        self.gpu_state = self._gpu_resident_state(locals_[0].device)
        if self.gpu_state:
            from .kernels.triton_adamw import triton_adamw_step

            self._gpu_kernel = triton_adamw_step
        self._host_subgroups = [sg for sg in range(len(self.layout)) if sg not in self.gpu_state]

        self.staging = LowpStaging(self.layout, self.param_dtype, pin, frozenset(self.gpu_state), locals_[0].device)
        # What close() releases, in reverse: registered here as it is made, so a build that fails part-way
        # frees pinned memory and deletes tier files too.
        resources: list = [self.staging]
        self._closer = weakref.finalize(self, _close_all, resources)
        # The FP32 cache never meets the GPU (the bf16 staging buffer does), so it is not page-locked.
        self.cache = HostCache(self.layout.slot_bytes, self._plan_slots(self.staging.nbytes), pin=False)
        resources.append(self.cache)
        # GPU-resident subgroups are the last ones: the placement plans for the ones before them
        assert self._host_subgroups == list(range(len(self._host_subgroups)))
        self.placement = make_placement(cfg, self.layout, self.cache.num_slots, len(self._host_subgroups))  # may measure the tiers
        resources.append(self.placement)  # closing it saves the learned bandwidths
        self.tiers: list[Tier] = open_tiers(cfg.tiers, cfg.tier_access, cfg.tier_lock_dir)
        resources.extend(self.tiers)
        slots = [sg.state_bytes for sg in self.layout.subgroups]
        if cfg.grad_path == "tier_fp32":
            slots += grad_slot_bytes(self.layout)
        tag = _rank_tag()
        for t in self.tiers:
            t.attach(tag, slots)
        self.pipeline = SubgroupPipeline(self.layout, self.cache, self.tiers, self.placement, cfg.prefetch)
        self._grad_flush = FP32GradFlush(self.layout, self.tiers, self.placement) if cfg.grad_path == "tier_fp32" else None

        self._steps = [0] * len(self._params)  # AdamW step count of each param
        self.step_count = 0  # optimizer steps taken: picks the update order
        self._pending: list[int] | None = None  # subgroups left of a step that raised
        self._unwritten: set[int] = set()  # updated subgroups whose params did not reach the model yet
        self._load_error: str | None = None  # set while a failed load has left the state mixed
        self._pending_scale = 1.0
        self._lock_wait_seen: dict[str, float] = {}
        self.last_metrics: StepMetrics | None = None
        self.loss_scaler = (
            DynamicLossScaler(cfg.loss_scale_init, growth_interval=cfg.loss_scale_growth_interval)
            if self.param_dtype == torch.float16
            else None
        )
        self.skipped_steps = 0  # fp16 steps skipped for inf/nan grads
        self.last_grad_norm: float | None = None
        self._group = mesh_group(self._params)
        self._copies = CopyStream(locals_[0].device)

        masters = [t.detach().reshape(-1) for t in locals_]
        self._fill_state(lambda i: masters[i], None, None)
        if model is not None:
            model.to(self.param_dtype)  # FSDP2 re-points its sharded storage (FSDPModule._apply)
            self._hooks = install_grad_hooks(self._params, self.stage_grad, self._copies)
        else:
            self._root = None
            for p in self._params:
                p.data = p.data.to(self.param_dtype)

    # -- construction ---------------------------------------------------------------------------

    def _check_params(self) -> None:
        if not self._params:
            raise ValueError("OffloadAdamW got an empty parameter list")
        devices = {local_data(p).device.type for p in self._params}
        if len(devices) > 1:
            raise ValueError(f"params are on mixed device types {sorted(devices)}: put the whole model on one device")
        for i, p in enumerate(self._params):
            if p.dtype != torch.float32:
                raise ValueError(
                    f"param {i} (shape {tuple(p.shape)}) is {p.dtype}, not float32: OffloadAdamW takes its FP32 "
                    "master weights from the model's FP32 params and casts the model to "
                    f"{self.offload.param_dtype} itself; build it before casting the model"
                )
            if not local_data(p).is_contiguous():
                raise ValueError(f"param {i} (shape {tuple(p.shape)}) is not contiguous")

    def _plan_slots(self, staging_bytes: int) -> int:
        """Host cache slots that the budget allows, or a clear error when it is too small."""
        cfg, m, slot = self.offload, len(self._host_subgroups), self.layout.slot_bytes
        budget = cfg.host_budget_bytes
        if budget is None:
            return m
        slots = min(m, max(0, (budget - staging_bytes) // slot))
        if slots == m:
            return m
        minimum = cfg.prefetch + 1
        if slots < minimum:
            raise ValueError(
                f"offload.host_budget_gb={cfg.host_budget_gb} is below the pipeline's minimum of "
                f"{format_bytes(staging_bytes + minimum * slot)}: {format_bytes(staging_bytes)} of grad "
                f"staging + {minimum} slots of {format_bytes(slot)} for prefetch={cfg.prefetch}; raise the "
                "budget, or lower subgroup_numel or prefetch"
            )
        if not cfg.tiers:
            raise ValueError(
                f"offload.host_budget_gb={cfg.host_budget_gb} holds {slots} of {m} subgroups and no tier "
                "is given: add a tier (offload.tiers=['posix:/path']) or raise the budget to "
                f"{format_bytes(staging_bytes + m * slot)}"
            )
        return slots

    def _gpu_resident_state(self, device: torch.device) -> dict[int, torch.Tensor]:
        """FP32 state buffers of the subgroups kept in GPU memory (the last `gpu_fraction` of them)."""
        fraction = self.offload.gpu_fraction
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"offload.gpu_fraction={fraction} must be between 0 and 1")
        if fraction == 0.0:
            return {}
        if device.type != "cuda":
            raise ValueError(f"offload.gpu_fraction={fraction} keeps state on the GPU, but the params are on {device}: use 0")
        m = len(self.layout)
        chosen = range(m - round(m * fraction), m)
        need = sum(self.layout.subgroups[sg].state_bytes + 2 * self.layout.subgroups[sg].padded for sg in chosen)
        free = torch.cuda.mem_get_info(device)[0]
        if need > 0.9 * free:
            per_sg = need / max(1, len(chosen))
            raise ValueError(
                f"offload.gpu_fraction={fraction} keeps {len(chosen)} of {m} subgroups on the GPU: "
                f"{format_bytes(need)}, but only {format_bytes(free)} of GPU memory is free; use at most "
                f"{int(0.9 * free / per_sg) / m:.3f}"
            )
        return {sg: torch.zeros(self.layout.subgroups[sg].state_bytes, dtype=torch.uint8, device=device) for sg in chosen}

    def _order_ending_with_next_step(self, step_count: int) -> list[int]:
        """The reverse of the next step's update order: a pass over all subgroups in it leaves the
        host cache holding what that step needs first."""
        return update_order(len(self.layout), step_count, self.offload.update_order)[::-1]

    def _visit(self, order: list[int], visit: Callable[[int, torch.Tensor], None], **kw: bool) -> None:
        """Calls `visit(sg, state)` on every subgroup of `order`: GPU-resident ones directly, the rest
        through the host cache and tiers (see SubgroupPipeline.run for `load` and `dirty`)."""
        for sg in order:
            if sg in self.gpu_state:
                visit(sg, self.gpu_state[sg])
        try:
            self.pipeline.run([sg for sg in order if sg not in self.gpu_state], visit, **kw)
        finally:
            self.pipeline.take_transfers()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_frozen", False):
            raise RuntimeError(
                "OffloadAdamW lays out its subgroups when it is built; params cannot be added later. "
                "Build a new optimizer over all params"
            )
        for k in ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable"):
            if param_group.get(k):
                raise ValueError(f"OffloadAdamW does not support {k}=True")
        super().add_param_group(param_group)

    # -- grads ----------------------------------------------------------------------------------

    def stage_grad(self, index: int, grad: torch.Tensor) -> None:
        """Hands param `index`'s low-precision grad to the host staging buffer (hooks call this)."""
        if self._pending is not None:
            raise RuntimeError(
                f"step {self.step_count} stopped part-way ({len(self._pending)} subgroups left) and its "
                "buffers hold its grads: call step() again to finish it before the next backward"
            )
        if grad.dtype != self.param_dtype:
            raise TypeError(
                f"grad of param {index} (shape {tuple(grad.shape)}) is {grad.dtype}; OffloadAdamW expects "
                f"{self.param_dtype} grads (the model's params are {self.param_dtype})"
            )
        if grad.shape != self._local_shapes[index]:
            raise ValueError(
                f"grad of param {index} has shape {tuple(grad.shape)}, the param's local shape is "
                f"{tuple(self._local_shapes[index])}"
            )
        self.staging.stage(index, grad)

    def _stage_param_grads(self) -> None:
        """Stages the .grad of params that no hook has handed over (plain tensors)."""
        with self._copies.after_current():
            for i, p in enumerate(self._params):
                if p.grad is not None and not self.staging.staged[i]:
                    self.stage_grad(i, local_data(p.grad))
        self._copies.wait_host()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self._pending is None:
            self.staging.clear()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the dynamic loss scale with fp16, as is otherwise."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    # -- the update -----------------------------------------------------------------------------

    def _grad_scale(self) -> float | None:
        """The factor applied to every grad in flight (1 / loss scale x clip factor), or None when the
        fp16 grads overflowed and the step must be skipped. Agreed across ranks."""
        cfg = self.offload
        if cfg.max_grad_norm is None and self.loss_scaler is None:
            return 1.0
        sq = torch.tensor([self.staging.grad_square_sum()], dtype=torch.float64)
        if self._group is not None:
            device = local_data(self._params[0]).device
            sq = sq.to(device)
            torch.distributed.all_reduce(sq, group=self._group)  # inf/nan spreads through the sum
        total = float(sq.item())
        unscale = 1.0
        if self.loss_scaler is not None:
            unscale = 1.0 / self.loss_scaler.scale  # the scale this backward ran with
            found_inf = not math.isfinite(total)
            self.loss_scaler.update(found_inf)
            if found_inf:
                return None
        norm = math.sqrt(total) * unscale
        self.last_grad_norm = norm
        clip = 1.0 if cfg.max_grad_norm is None else min(1.0, cfg.max_grad_norm / (norm + 1e-6))
        return unscale * clip

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Updates every subgroup. If it raises (an I/O error, say), nothing is lost: the next call
        finishes the same step from the subgroup where it stopped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        self._require_loaded()
        if self._pending is None:
            self._stage_param_grads()
            if not any(self.staging.staged):
                raise RuntimeError("step() called before any backward: no param has a grad")
            if self._grad_flush is not None:  # first: if it fails, the step has changed nothing yet
                self.pipeline.transfers += self._grad_flush.write(self._host_subgroups, self.staging)
            scale = self._grad_scale()
            if scale is None:  # fp16 overflow: no state is touched
                self.skipped_steps += 1
                self.staging.clear()
                self.last_metrics = step_metrics(self.step_count, time.perf_counter() - start, 0, len(self.layout), 0, [], {})
                self.last_metrics.skipped = True
                return loss
            for i, has in enumerate(self.staging.staged):
                self._steps[i] += has
            self._pending_scale = scale
            order = update_order(len(self.layout), self.step_count, self.offload.update_order)
            # GPU-resident subgroups first (no I/O), then the others through the host cache and tiers
            self._pending = [sg for sg in order if sg in self.gpu_state] + [sg for sg in order if sg not in self.gpu_state]
        params = [local_data(p) for p in self._params]
        updated: set[int] = set()

        def update(sg: int, state: torch.Tensor) -> None:
            self._update_subgroup(sg, state, self._pending_scale)
            updated.add(sg)  # its state is new now: a retry must not update it again
            self._unwritten.add(sg)
            with self._copies.after_current():
                self.staging.write_back(sg, params)
            self._unwritten.discard(sg)

        try:
            for sg in sorted(self._unwritten):  # params a failed try updated but did not copy back
                with self._copies.after_current():
                    self.staging.write_back(sg, params)
                self._unwritten.discard(sg)
            for sg in [sg for sg in self._pending if sg in self.gpu_state]:
                update(sg, self.gpu_state[sg])
            self.pipeline.run([sg for sg in self._pending if sg not in self.gpu_state], update)
        finally:
            self._pending = [sg for sg in self._pending if sg not in updated] or None
            self._params_written()
        self._finish_step(start)
        return loss

    def _lock_waits(self) -> dict[str, float]:
        """Seconds spent waiting for each locked tier's node lock since the last call."""
        out = {}
        for t in self.tiers:
            lock = getattr(t, "lock", None)  # LockedTier (tier_access exclusive or k)
            if lock is not None:
                out[t.name] = lock.wait_s - self._lock_wait_seen.get(t.name, 0.0)
                self._lock_wait_seen[t.name] = lock.wait_s
        return out

    def _params_written(self) -> None:
        """Makes the next forward wait for the params copied back so far."""
        event = self._copies.record()
        if event is None:
            return
        if self._root is not None:
            self._root.set_post_optim_event(event)
        else:
            torch.cuda.current_stream().wait_event(event)

    def _update_subgroup(self, sg: int, state: torch.Tensor, grad_scale: float) -> None:
        subgroup = self.layout.subgroups[sg]
        p, m, v = subgroup.parts(state)
        out = g = self.staging.view(sg)  # the kernel writes the new low-precision params over the grads
        if self._grad_flush is not None and not state.is_cuda:
            g, transfer = self._grad_flush.read(sg)
            self.pipeline.transfers.append(transfer)
        kernel = self._gpu_kernel if state.is_cuda else self._kernel
        staged = self.staging.staged
        for seg in subgroup.segments:
            if not staged[seg.param]:
                continue
            group = self.param_groups[self._group_of[seg.param]]
            beta1, beta2 = group["betas"]
            piece = seg.in_subgroup
            kernel(
                p[piece], m[piece], v[piece], g[piece], out[piece],
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), step=self._steps[seg.param], grad_scale=grad_scale,
            )  # fmt: skip

    def _finish_step(self, start: float) -> None:
        transfers, hits = self.pipeline.take_transfers()
        updated = sum(n for n, has in zip(self.layout.numels, self.staging.staged) if has)
        location = {sg: self.tiers[t].name for sg, t in self.pipeline.location.items() if not self.cache.is_resident(sg)}
        self.last_metrics = step_metrics(
            self.step_count, time.perf_counter() - start, updated, len(self.layout), hits, transfers, location
        )
        self.last_metrics.lock_wait_s = self._lock_waits()
        self.last_metrics.log()
        self.step_count += 1
        self.staging.clear()

    # -- state ----------------------------------------------------------------------------------

    def _fill_state(
        self,
        master: Callable[[int], torch.Tensor],
        exp_avg: Callable[[int], torch.Tensor] | None,
        exp_avg_sq: Callable[[int], torch.Tensor] | None,
        params: list[torch.Tensor] | None = None,
    ) -> None:
        """Overwrites every subgroup from flat per-param FP32 tensors (moments None: zeros).

        With `params`, the low-precision params are rewritten from the new masters too."""

        def fill(sg: int, state: torch.Tensor) -> None:
            state.zero_()
            parts = self.layout.subgroups[sg].parts(state)
            for seg in self.layout.subgroups[sg].segments:
                src = seg.in_param
                dst = seg.in_subgroup
                for part, source in zip(parts, (master, exp_avg, exp_avg_sq)):
                    if source is not None:
                        part[dst].copy_(source(seg.param)[src])
            if params is not None:
                self.staging.fill_from_master(sg, parts[0], params)

        order = self._order_ending_with_next_step(self.step_count)
        self._visit(order, fill, load=False)

    def _require_loaded(self) -> None:
        if self._load_error is not None:
            raise RuntimeError(f"{self._load_error}; load a state again (load_state_dict or a checkpoint) before using it")

    def _require_step_finished(self) -> None:
        self._require_loaded()
        self._check_no_pending_step()

    def _check_no_pending_step(self) -> None:
        if self._pending is not None:
            raise RuntimeError(
                f"step {self.step_count} stopped part-way ({len(self._pending)} subgroups left); "
                "call step() again to finish it before saving or loading state"
            )

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """Like torch.optim.AdamW's, plus each param's FP32 'master_param' (all gathered in host memory).

        For models whose state does not fit host memory, checkpoint through the DCP Stateful instead.
        """
        self._require_step_finished()
        shapes = [local_data(p).shape for p in self._params]
        out = [{k: torch.empty(s, dtype=torch.float32) for k in ("master_param", "exp_avg", "exp_avg_sq")} for s in shapes]

        def gather(sg: int, state: torch.Tensor) -> None:
            parts = self.layout.subgroups[sg].parts(state)
            for seg in self.layout.subgroups[sg].segments:
                dst = seg.in_param
                src = seg.in_subgroup
                for key, part in zip(("master_param", "exp_avg", "exp_avg_sq"), parts):
                    out[seg.param][key].view(-1)[dst].copy_(part[src])

        order = self._order_ending_with_next_step(self.step_count)
        self._visit(order, gather, dirty=False)
        state = {i: {"step": torch.tensor(float(self._steps[i])), **out[i]} for i in range(len(self._params))}
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": groups, "offload": self._offload_meta()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores masters, moments, step counts and hyperparameters, and rewrites the model's params
        from the restored masters."""
        self._check_no_pending_step()
        groups, state = state_dict["param_groups"], state_dict["state"]
        self._check_groups([len(g["params"]) for g in groups])
        for i, p in enumerate(self._params):
            want = tuple(local_data(p).shape)
            for key in ("master_param", "exp_avg", "exp_avg_sq"):
                got = tuple(state[i][key].shape) if i in state and key in state[i] else None
                if got != want:
                    raise ValueError(f"state_dict param {i} {key}: shape {got}, expected {want} (another model or sharding?)")

        def flat(key: str) -> Callable[[int], torch.Tensor]:
            return lambda i: state[i][key].reshape(-1).to(torch.float32)

        params = [local_data(p) for p in self._params]
        self._begin_load()
        with self._copies.after_current():
            self._fill_state(flat("master_param"), flat("exp_avg"), flat("exp_avg_sq"), params)
        self._end_load(
            [{k: v for k, v in g.items() if k != "params"} for g in groups],
            [int(state[i]["step"]) for i in range(len(self._params))],
            state_dict.get("offload", {}),
        )

    def _check_groups(self, sizes: list[int]) -> None:
        mine = [len(g["params"]) for g in self.param_groups]
        if sizes != mine:
            raise ValueError(
                f"the saved state has param groups of sizes {sizes}, this optimizer {mine}: it was saved from "
                "another model or another split of params into groups"
            )

    def _begin_load(self) -> None:
        """Before subgroups are overwritten: until `_end_load`, the optimizer refuses to step."""
        self._check_no_pending_step()
        self._copies.wait_host()  # the last step's copies to the model still read the staging buffer
        self.staging.clear()
        self._load_error = "loading optimizer state failed part-way, so its subgroups are a mix of old and new"

    def _end_load(self, groups: list[dict], steps: list[int], meta: dict[str, Any]) -> None:
        """After every subgroup (and the model's params) was rewritten: takes the saved hyperparameters
        and counters."""
        self._load_error = None
        self.staging.clear()
        self._params_written()
        for mine, g in zip(self.param_groups, groups):
            mine.update(g)
        self._steps = list(steps)
        self._restore_offload_meta(meta)

    def _offload_meta(self) -> dict[str, Any]:
        return {
            "step_count": self.step_count,
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "placement": self.placement.state_dict(),
        }

    def _restore_offload_meta(self, meta: dict[str, Any]) -> None:
        self.step_count = int(meta.get("step_count", 0))
        if self.loss_scaler is not None and meta.get("loss_scaler"):
            self.loss_scaler.load_state_dict(meta["loss_scaler"])
        if meta.get("placement"):
            self.placement.load_state_dict(meta["placement"])

    # -- one subgroup at a time (checkpoints through DCP, see dcp_state.py) ------------------------

    def checkpoint_meta(self) -> dict[str, Any]:
        """Everything but the subgroups: what `load_checkpoint_meta` restores after they are written."""
        self._require_step_finished()
        return {
            "layout": self._layout_signature(),
            "steps": list(self._steps),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "group_sizes": [len(g["params"]) for g in self.param_groups],
            "offload": self._offload_meta(),
        }

    def _layout_signature(self) -> dict[str, Any]:
        return {"numels": list(self.layout.numels), "subgroup_numel": self.layout.subgroup_numel}

    @torch.no_grad()
    def read_subgroup(self, sg: int, out: torch.Tensor) -> None:
        """Copies subgroup `sg`'s FP32 state ([params | exp_avg | exp_avg_sq]) into `out`, a page-aligned
        host buffer of its size, from the GPU, the host cache or its tier. The cache is left as it is:
        the next step finds what it would have found."""
        self._require_step_finished()
        held = self.gpu_state.get(sg)
        if held is None:
            held = self.pipeline.resident_state(sg)
        if held is not None:
            out.copy_(held)
        else:
            self.pipeline.read_stored(sg, out)

    @torch.no_grad()
    def write_subgroup(self, sg: int, state: torch.Tensor) -> None:
        """Overwrites subgroup `sg`'s FP32 state with `state` (host bytes laid out as `read_subgroup`
        gives them) and the model's params in it with the new masters rounded. Between
        `_begin_load` and `_end_load` (dcp_state's load planner calls them)."""
        if self._load_error is None:
            raise RuntimeError("write_subgroup outside a load: use OffloadOptimizerState with dcp.load")
        want = self.layout.subgroups[sg].state_bytes
        if state.dtype != torch.uint8 or state.numel() != want:
            raise ValueError(
                f"subgroup {sg}: the checkpoint holds {state.numel() * state.element_size()} bytes, its state is "
                f"{want}: the checkpoint is truncated, or was written for another model, world size or "
                "offload.subgroup_numel"
            )
        dest = self.gpu_state.get(sg)
        if dest is None:
            dest = self.pipeline.resident_state(sg)
            if dest is not None:
                self.cache.dirty.add(sg)  # newer than its stored copy now
        if dest is not None:
            dest.copy_(state)
        else:
            dest = state
            if state.is_cuda or state.data_ptr() % ALIGN:  # O_DIRECT wants page-aligned host memory
                dest = aligned_host_buffer(want).copy_(state)
            self.pipeline.store(sg, dest)
        with self._copies.after_current():
            self.staging.fill_from_master(sg, self.layout.subgroups[sg].parts(dest)[0], [local_data(p) for p in self._params])

    def load_checkpoint_meta(self, meta: dict[str, Any]) -> None:
        """Ends a load whose subgroups were all written: checks the layout they were saved in and takes
        the saved step counts, hyperparameters and offload state."""
        if meta["layout"] != self._layout_signature():
            saved, mine = meta["layout"], self._layout_signature()
            raise ValueError(
                f"the checkpoint's optimizer state was laid out for {len(saved['numels'])} local params of "
                f"{sum(saved['numels'])} elements in subgroups of {saved['subgroup_numel']}, this rank has "
                f"{len(mine['numels'])} params of {sum(mine['numels'])} elements in subgroups of "
                f"{mine['subgroup_numel']}: resume with the same model, world size and offload.subgroup_numel"
            )
        self._check_groups(meta["group_sizes"])
        self._end_load(meta["param_groups"], meta["steps"], meta["offload"])

    def close(self) -> None:
        """Deletes this rank's tier files and releases pinned memory."""
        self._closer()


def _close_all(resources: list) -> None:
    for r in reversed(resources):
        r.close()
