"""The memory levels of one rank's optimizer, built once: which subgroups live on the GPU, the
low-precision staging buffer, the FP32 grad sums, the host cache, the placement and the tiers, all
sized against the one host budget together, and handed to the store and the engine as objects.

`MemoryPlan` is what is decided: the planner makes it for train.py; an optimizer built without one
makes its own in `build_levels`, which then makes it real: the GPU share (gpu_share.py), the tiers'
starting speeds (tier_speeds.py, once, before anything that streams is built), what host memory each
buffer takes before the cache gets the rest (cache.host_cache_slots), then the levels themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .bandwidth import TierSpeed, steady_traffic
from .cache import HostCache, host_cache_slots, resolve_split_masters
from . import calibrate
from .bandwidth_profile import BandwidthProfile
from .config import OffloadConfig
from .gpu_share import gpu_subgroup_bytes, starting_share
from .grad_sums import GradSums, grad_accumulation_memory, resolve_grad_accumulation
from .grads import LowpGrads, StepGrads, TierFP32Grads
from .host_windows import windows_bytes
from .learned_rate import UpdateRateLearner
from .machine import SHARED_FILE_SYSTEM_NOTE, MachineConfig, tier_room_subgroups, tiers_sharing_a_file_system
from .memory import resolve_host_budget, warn_over_memory
from .node import job_id, node_position
from .placement import make_placement
from .staging import LowpStaging, resolve_grad_path
from .storage import open_tiers
from .store import SubgroupStore
from .subgroups import SubgroupLayout
from .tier_speeds import starting_speeds
from .units import GIB, readable_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory, decided once, and what the optimizer builds: the planner makes it for
    train.py, with the step's activations in view (plans.RankPlan.memory_plan); an optimizer built
    without one makes its own from the config and what it measures now (`build_levels`)."""

    host_budget: int | None  # bytes the optimizer keeps in host memory; None: no limit
    budget_name: str  # how errors name the budget
    grad_accumulation: str  # where several micro-batches' grads are summed: "gpu" | "host"
    gpu_subgroups: int | None  # the last subgroups on the GPU from the start; None: gpu_fraction decides now (or "auto" after the first step)
    grad_path: str  # where the low-precision grads wait for their update: "host_bf16" | "gpu_bf16" | "tier_fp32"
    split_masters: bool  # subgroups off the GPU held split (offload.split_masters, resolved)


@dataclass
class Levels:
    layout: SubgroupLayout  # the optimizer's layout, its subgroups split or whole as decided here
    staging: LowpStaging
    sums: GradSums
    grads: StepGrads  # the step's grads, over the staging buffer and the sums
    store: SubgroupStore
    grad_accumulation: str  # "gpu" | "host", resolved
    grad_path: str  # resolved
    size_gpu_share_later: bool  # gpu_fraction="auto" with no planned count: sized after the first step
    rate_learner: UpdateRateLearner | None  # keeps the CPU update's rate in offload.bandwidth_profile for the planner


def build_levels(
    cfg: OffloadConfig, layout: SubgroupLayout, forward: list[int], local_shapes: list[torch.Size], device: torch.device,
    param_dtype: torch.dtype, group: dist.ProcessGroup | None, memory: MemoryPlan | None, tier_speeds: list[TierSpeed] | None,
) -> Levels:  # fmt: skip
    """Every level of one rank's state, from `memory` (None: the optimizer's own plan, from the config and
    what it measures now) and the caller's `tier_speeds` (None: the profile's or measured, where the
    placement needs them), and the step's grads over them, on `layout` with its subgroups split or whole
    as decided here. What is decided comes first, then what is built, each level once."""
    share = starting_share(cfg.gpu_fraction, layout, device, None if memory is None else memory.gpu_subgroups)
    local, place = node_position(group)  # the node's ranks share its host memory and its tiers' room (a collective: counted once)
    streamed = len(layout) - len(share.subgroups)  # the subgroups off the GPU, the first ones: the host and tiers hold these
    grad_slots = TierFP32Grads.slot_bytes(layout) if cfg.grad_path == "tier_fp32" else []
    if memory is None:  # the optimizer's own plan: "auto" sums the grads on the GPU where its free memory, less gpu_headroom_gb, holds them
        free = torch.cuda.mem_get_info(device)[0] - int(cfg.gpu_headroom_gb * GIB) if device.type == "cuda" else None
        need = grad_accumulation_memory(layout, "gpu", cfg.micro_batches, list(range(len(layout))))[0]
        accumulation = resolve_grad_accumulation(cfg.grad_accumulation, cfg.micro_batches, device.type, free, need)
    else:
        accumulation = memory.grad_accumulation
    sums_host_bytes = grad_accumulation_memory(layout, accumulation, cfg.micro_batches, list(range(streamed)))[1]
    if memory is None:  # and the host budget ("auto": measured now, a collective over `group`), and where the grads wait
        budget = resolve_host_budget(cfg, group, device)
        off_gpu_grads = param_dtype.itemsize * sum(layout.subgroups[sg].padded for sg in range(streamed))
        windows = windows_bytes(layout, param_dtype.itemsize) if streamed else 0

        def slots(slot_bytes: int, staged_bytes: int) -> int | None:  # the cache's slots with this much grad staging; None: short
            try:
                return host_cache_slots(*budget, cfg.host_budget.unit, streamed, slot_bytes,
                                        staged_bytes + max(grad_slots, default=0) + sums_host_bytes, cfg.prefetch,
                                        len(cfg.tiers))  # fmt: skip
            except ValueError:
                return None

        whole = slots(layout.with_split(False).slot_bytes, off_gpu_grads)
        split = resolve_split_masters(cfg.split_masters, cfg.param_dtype, whole, streamed, layout.split_saves)
        layout = layout.with_split(split)
        params_windows = split_windows(layout, device, streamed, param_dtype)
        warn_over_memory(cfg, streamed * layout.slot_bytes + off_gpu_grads + params_windows + sums_host_bytes, local, place == 0)  # the node's first says it
        # with the grads in host memory, and on the GPU (two host windows instead): what each leaves the cache
        kept_host, kept_gpu = slots(layout.slot_bytes, off_gpu_grads + params_windows), slots(layout.slot_bytes, windows + params_windows)
        short = kept_host is None and kept_gpu is not None  # the grads' host memory lets the minimum be met
        spill = bool(cfg.tiers) and kept_host is not None and kept_host < streamed and (kept_gpu or 0) > kept_host
        # the GPU's room for them: what is free now, less the sums placed there and the fixed share's state, not yet allocated
        room = None if free is None else free - (need if accumulation == "gpu" else 0) - sum(
            gpu_subgroup_bytes(layout, sg, param_dtype.itemsize) for sg in share.subgroups)
        grad_path = resolve_grad_path(cfg.grad_path, device.type, cfg.gpu_fraction != "auto", spill, short, room, off_gpu_grads)
        memory = MemoryPlan(*budget, accumulation, None, grad_path, split)
    layout = layout.with_split(memory.split_masters)
    if accumulation == "gpu" and device.type != "cuda":
        raise ValueError(f"a memory plan with the grad sums on the GPU, but the params are on {device.type}")
    grads_on_gpu = memory.grad_path == "gpu_bf16"
    if grads_on_gpu and device.type != "cuda":
        raise ValueError(
            f"offload.grad_path='gpu_bf16' keeps the grads in GPU memory, but the params are on {device}: "
            "use offload.grad_path='host_bf16' (or 'auto')"
        )
    # The tiers' speeds, before anything is built: once a node, a collective, so its condition is the same
    # on every rank (a rank's own layout may leave it nothing to stream)
    needed = cfg.places_by_bandwidth and (not share.everything if group is not None else streamed > 0)
    start = starting_speeds(cfg, needed=needed, given=tier_speeds, group=group)
    # the CPU kernel's rate as the step runs it, for the planner's next prediction here (where a profile is kept)
    learner = None
    if cfg.bandwidth_profile is not None:
        run = job_id(group)  # (a collective: its condition is the config's, the same on every rank)
        learner = UpdateRateLearner(cfg.bandwidth_profile, local, place, run, cfg.subgroup_numel) if streamed else None
    learn = None
    if start.save_learned and streamed and layout.slot_bytes < calibrate.PROFILE_MIN_TRANSFER_BYTES:
        if group is None or dist.get_rank(group) == 0:  # each transfer is one subgroup's
            log.info("offload.bandwidth_profile: the speeds this run learns are used, not saved: its subgroups of %s are "
                     "moved in transfers too small to time the tier (under %s)", readable_size(layout.slot_bytes),
                     readable_size(calibrate.PROFILE_MIN_TRANSFER_BYTES))  # fmt: skip
    elif start.save_learned and streamed:
        learn = BandwidthProfile(cfg.bandwidth_profile)
    made: list = [] if learn is None else [learn]  # closed, in reverse, if the build fails part-way
    try:
        staged_on_gpu = frozenset(range(len(layout))) if grads_on_gpu else share.subgroups
        staging = LowpStaging(layout, param_dtype, device.type == "cuda", staged_on_gpu, device, host_window=grads_on_gpu and streamed > 0,
                              params_window=split_windows(layout, device, streamed, param_dtype) > 0)  # fmt: skip
        made.append(staging)
        sums = GradSums(layout, staging, accumulation, device, share.subgroups, planned=cfg.micro_batches > 1)
        made.append(sums)
        reserved = staging.nbytes + max(grad_slots, default=0) + sums_host_bytes  # (the FP32 grad path's one buffer)
        cache = HostCache(layout.slot_bytes, host_cache_slots(memory.host_budget, memory.budget_name, cfg.host_budget.unit, streamed,
                                                              layout.slot_bytes, reserved, cfg.prefetch, len(cfg.tiers)))  # fmt: skip
        made.append(cache)
        traffic = steady_traffic(streamed, cache.num_slots, cfg.update_order, [sg for sg in forward if sg < streamed])
        # a bandwidth rule keeps to each tier's room on this node (a fixed split is the user's, as given)
        room = tier_room_subgroups(MachineConfig(), list(cfg.tier_specs), local, layout.slot_bytes) if cfg.places_by_bandwidth else None
        placement = make_placement(cfg, layout, streamed, traffic, start.speeds, learn, room, sharers=local)
        made.append(placement)
        tiers = open_tiers(cfg.tier_specs, cfg.tier_access, cfg.tier_lock_dir, cfg.tier_lock_timeout_s)
        made.extend(tiers)
        if group is None or dist.get_rank(group) == 0:
            for shared in tiers_sharing_a_file_system(cfg.tier_specs):
                log.warning("offload.tiers %s %s", " and ".join(shared), SHARED_FILE_SYSTEM_NOTE)
        path = TierFP32Grads(layout, tiers, placement.tier_for) if cfg.grad_path == "tier_fp32" else LowpGrads()
        grads = StepGrads(cfg, staging, path, sums, local_shapes, group, device)
        # the store owns the cache, the placement and the tiers from here on (and closes them if it fails)
        del made[made.index(cache):]
        store = SubgroupStore(layout, share.subgroups, device, cache, placement, tiers, grad_slots, cfg.prefetch)
    except BaseException:
        for part in reversed(made):  # pinned pages before the memory can be reused; tier files deleted
            part.close()
        raise
    says = place == 0  # the node's first rank says what it built (the others' differ by their shard alone)
    if says and cfg.micro_batches > 1:
        log.info("offload.grad_accumulation=%r: the grads of %d micro-batches are summed in FP32 on the %s",
                 cfg.grad_accumulation, cfg.micro_batches, "GPU" if accumulation == "gpu" else "host")  # fmt: skip
    if says and cfg.host_budget.auto:
        log.info("%s: %d of %d subgroups off the GPU kept in host memory", memory.budget_name, cache.num_slots, streamed)
    if says and cfg.split_masters == "auto" and layout.split_masters:
        log.info("offload.split_masters='auto': the %d subgroups off the GPU are held split (the masters' low halves, "
                 "10 bytes a param), since the host cache would not hold them all whole", streamed)  # fmt: skip
    if says and cfg.grad_path == "auto" and grads_on_gpu:
        log.info("offload.grad_path='auto': the grads wait for their update in GPU memory, leaving their host memory "
                 "to the cache (it would spill subgroups to the tiers otherwise)")  # fmt: skip
    return Levels(layout, staging, sums, grads, store, accumulation, memory.grad_path, share.later, learner)


def split_windows(layout: SubgroupLayout, device: torch.device, streamed: int, param_dtype: torch.dtype) -> int:
    """Host bytes of the two windows through which CPU updates of split masters read the model's params
    (on a GPU, where any subgroup is off it)."""
    return windows_bytes(layout, param_dtype.itemsize) if layout.split_masters and device.type == "cuda" and streamed else 0
