"""The memory levels of one rank's optimizer, built once from the config: which subgroups live on the
GPU, the low-precision staging buffer, the FP32 grad sums and the store (host cache and tiers), all
sized against the one host budget together.

`build_levels` is the optimizer's memory plan made real: the GPU share (a fixed gpu_fraction, or the
planner's count for "auto", placed now so the first steps run at speed), where the grads of several
micro-batches are summed, and what host memory each buffer takes before the cache gets the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .calibrate import TierSpeed
from .config import GIB, OffloadConfig
from .gpu_share import check_gpu_share
from .grad_sums import GradSums, grad_accumulation_memory, resolve_grad_accumulation
from .grads import TierFP32Grads
from .memory import resolve_host_budget
from .staging import LowpStaging
from .store import SubgroupStore
from .subgroups import SubgroupLayout
from .tier_speeds import placement_measures, starting_speeds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory, decided once, and what the optimizer builds: the planner makes it for
    train.py, with the step's activations in view (node_plan.RankPlan.memory_plan); an optimizer built
    without one makes its own from the config and what it measures now (`plan_memory`)."""

    host_budget: int | None  # bytes the optimizer keeps in host memory; None: no limit
    budget_name: str  # how errors name the budget
    grad_accumulation: str  # where several micro-batches' grads are summed: "gpu" | "host"
    gpu_subgroups: int | None  # the last subgroups on the GPU from the start; None: gpu_fraction decides now (or "auto" after the first step)


def plan_memory(cfg: OffloadConfig, layout: SubgroupLayout, device: torch.device, group: dist.ProcessGroup | None) -> MemoryPlan:
    """The memory plan of an optimizer built without one: the host budget (host_budget_gb="auto" measured
    now, a collective over `group`) and where grad sums go ("auto": the GPU where its free memory, less
    gpu_headroom_gb, holds them)."""
    budget, budget_name = resolve_host_budget(cfg, group, device)
    free = torch.cuda.mem_get_info(device)[0] - int(cfg.gpu_headroom_gb * GIB) if device.type == "cuda" else None
    every = list(range(len(layout)))
    accumulation = resolve_grad_accumulation(cfg.grad_accumulation, cfg.micro_batches, device.type, free,
                                             grad_accumulation_memory(layout, "gpu", cfg.micro_batches, every)[0])  # fmt: skip
    return MemoryPlan(budget, budget_name, accumulation, None)


@dataclass
class Levels:
    staging: LowpStaging
    sums: GradSums
    store: SubgroupStore
    grad_accumulation: str  # "gpu" | "host", resolved
    size_gpu_share_later: bool  # gpu_fraction="auto" with no planned count: sized after the first step


def gpu_resident(cfg: OffloadConfig, layout: SubgroupLayout, device: torch.device, planned: int | None) -> frozenset[int]:
    """The subgroups whose state lives in GPU memory from the start: the planner's `planned` count of
    the last ones (gpu_fraction="auto"), or the last `gpu_fraction` of them, checked against the GPU
    memory free now."""
    m = len(layout)
    if planned is not None:
        if not 0 <= planned <= m:
            raise ValueError(f"a memory plan with {planned} subgroups on the GPU: this rank has {m}")
        if planned and device.type != "cuda":
            raise ValueError(f"a memory plan with {planned} subgroups on the GPU, but the params are on {device}")
        return frozenset(range(m - planned, m))
    if cfg.gpu_fraction in ("auto", 0.0):
        return frozenset()
    if device.type != "cuda":
        raise ValueError(f"offload.gpu_fraction={cfg.gpu_fraction} keeps state on the GPU, but the params are on {device}: use 0")
    return check_gpu_share(layout, cfg.gpu_fraction, torch.cuda.mem_get_info(device)[0])


def build_levels(
    cfg: OffloadConfig, layout: SubgroupLayout, forward: list[int], device: torch.device, param_dtype: torch.dtype,
    group: dist.ProcessGroup | None, memory: MemoryPlan, tier_speeds: list[TierSpeed] | None,
) -> Levels:  # fmt: skip
    on_gpu = gpu_resident(cfg, layout, device, memory.gpu_subgroups)
    later = cfg.gpu_fraction == "auto" and memory.gpu_subgroups is None
    if later and device.type != "cuda":
        log.info("offload.gpu_fraction=auto: the params are on %s, so all state stays off the GPU", device)
        later = False
    budget, budget_name, accumulation = memory.host_budget, memory.budget_name, memory.grad_accumulation
    if accumulation == "gpu" and device.type != "cuda":
        raise ValueError(f"a memory plan with the grad sums on the GPU, but the params are on {device.type}")
    grads_on_gpu = cfg.grad_path == "gpu_bf16"
    if grads_on_gpu and device.type != "cuda":
        raise ValueError(
            f"offload.grad_path='gpu_bf16' keeps the grads in GPU memory, but the params are on {device}: "
            "use offload.grad_path='host_bf16'"
        )
    staged_on_gpu = frozenset(range(len(layout))) if grads_on_gpu else on_gpu
    off_gpu = [sg for sg in range(len(layout)) if sg not in on_gpu]
    # The node's tier speeds, once a node: a collective, so its condition is the same on every rank
    # (a rank's own layout may leave it nothing to stream)
    if tier_speeds is None and group is not None:
        tier_speeds = starting_speeds(cfg, group=group, needed=placement_measures(cfg) and cfg.gpu_fraction != 1.0).speeds
    grad_slots = TierFP32Grads.slot_bytes(layout) if cfg.grad_path == "tier_fp32" else []
    staging = sums = None
    try:
        staging = LowpStaging(layout, param_dtype, device.type == "cuda", staged_on_gpu, device,
                              host_window=grads_on_gpu and len(on_gpu) < len(layout))  # fmt: skip
        sums = GradSums(layout, staging, accumulation, device, on_gpu, planned=cfg.micro_batches > 1)
        reserved = (staging.nbytes + max(grad_slots, default=0)  # (the FP32 grad path's one buffer)
                    + grad_accumulation_memory(layout, accumulation, cfg.micro_batches, off_gpu)[1])  # fmt: skip
        store = SubgroupStore(cfg, layout, on_gpu, device, budget, budget_name, reserved, grad_slots, forward, tier_speeds)
    except BaseException:
        for pinned in (sums, staging):  # their pinned pages, before the memory can be reused
            if pinned is not None:
                pinned.close()
        raise
    if cfg.micro_batches > 1:
        log.info("offload.grad_accumulation=%r: the grads of %d micro-batches are summed in FP32 on the %s",
                 cfg.grad_accumulation, cfg.micro_batches, "GPU" if accumulation == "gpu" else "host")  # fmt: skip
    if cfg.host_budget_gb == "auto":
        log.info("%s: %d of %d subgroups off the GPU kept in host memory", budget_name, store.cache.num_slots,
                 len(store.host_subgroups))  # fmt: skip
    return Levels(staging, sums, store, accumulation, later)
