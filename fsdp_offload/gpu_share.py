"""The GPU's share of the FP32 state: which subgroups stay in GPU memory and what they take there.

`offload.gpu_fraction` is read here alone. A fixed fraction keeps the last subgroups of the layout
(checked against the GPU memory free when the optimizer is built, or the planner's estimate of it);
"auto" takes as many as fit the room the planner leaves beside the training step (`last_that_fit`),
placed at start-up when train.py hands the plan's count in (`starting_share`), or sized once after the
first step from the measured peak (`grow_gpu_share`) in a loop of the user's own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .config import OffloadConfig
from .fsdp import CopyStream
from .staging import LowpStaging
from .store import SubgroupStore
from .subgroups import SubgroupLayout
from .units import format_bytes

log = logging.getLogger(__name__)


def gpu_share(layout: SubgroupLayout, fraction: float) -> frozenset[int]:
    """The last `fraction` of the subgroups: the ones a fixed offload.gpu_fraction keeps in GPU memory."""
    m = len(layout)
    return frozenset(range(m - round(m * fraction), m))


def gpu_subgroup_bytes(layout: SubgroupLayout, sg: int, itemsize: int) -> int:
    """GPU memory a resident subgroup takes: its state, plus its low-precision grads and params beside it."""
    return layout.subgroups[sg].state_bytes + itemsize * layout.subgroups[sg].padded


def moved_staging_itemsize(grad_path: str, itemsize: int) -> int:
    """Bytes per element of a subgroup's staging part that go to the GPU with its state: none with
    grad_path="gpu_bf16", where every part is in GPU memory from the start."""
    return 0 if grad_path == "gpu_bf16" else itemsize


def last_that_fit(layout: SubgroupLayout, candidates: list[int], room: int, itemsize: int) -> tuple[int, int]:
    """How many of the last `candidates` fit in `room` bytes of GPU memory, and the bytes they take
    (offload.gpu_fraction="auto")."""
    count, used = 0, 0
    for sg in reversed(candidates):
        need = gpu_subgroup_bytes(layout, sg, itemsize)
        if used + need > room:
            break
        count, used = count + 1, used + need
    return count, used


def check_gpu_share(layout: SubgroupLayout, fraction: float, free: int) -> frozenset[int]:
    """The subgroups a fixed offload.gpu_fraction keeps in GPU memory, if they fit in 0.9 of the `free`
    bytes of it (what is free when the optimizer is built; the planner's estimate of it), else why not."""
    m = len(layout)
    chosen = gpu_share(layout, fraction)
    need = sum(gpu_subgroup_bytes(layout, sg, 2) for sg in chosen)
    if need > 0.9 * free:
        per_sg = need / max(1, len(chosen))
        raise ValueError(
            f"offload.gpu_fraction={fraction} keeps {len(chosen)} of {m} subgroups on the GPU: "
            f"{format_bytes(need)}, but only {format_bytes(free)} of GPU memory is free; use at most "
            f"{int(0.9 * free / per_sg) / m:.3f}"
        )
    return frozenset(chosen)


@dataclass(frozen=True)
class GpuShare:
    """offload.gpu_fraction for an optimizer being built, decided once."""

    subgroups: frozenset[int]  # the last ones, whose state starts in GPU memory
    later: bool  # "auto" with no planned count: sized after the first step (grow_gpu_share)
    everything: bool  # gpu_fraction=1: every rank keeps all its state on the GPU, none streams any


def needs_gpu(fraction: float | str) -> bool:
    """Whether offload.gpu_fraction keeps state on the GPU whatever else holds ("auto" keeps none without one)."""
    return fraction != "auto" and fraction > 0


def planned_share(fraction: float | str, layout: SubgroupLayout, free: int | None, auto_room: int | None, itemsize: int) -> frozenset[int]:
    """The GPU's share as the planner sizes it: none on a CPU run (`free` None) or at 0; "auto": as many of
    the last subgroups as fit `auto_room` bytes beside the training step, each with `itemsize` bytes an
    element of what goes along (last_that_fit); a fixed fraction checked against `free`, the GPU memory
    the planner expects free once the model is built."""
    if free is None or fraction == 0:
        return frozenset()
    if fraction == "auto":
        count, _ = last_that_fit(layout, list(range(len(layout))), auto_room, itemsize)
        return frozenset(range(len(layout) - count, len(layout)))
    return check_gpu_share(layout, fraction, free)


def handed_count(fraction: float | str, planned: int) -> int | None:
    """What a plan hands the optimizer of its GPU share: the count "auto" sized beside the training step,
    placed at start-up; None for a fixed fraction, checked again against the GPU memory free then."""
    return planned if fraction == "auto" else None


def starting_share(fraction: float | str, layout: SubgroupLayout, device: torch.device, planned: int | None) -> GpuShare:
    """The GPU's share from the start: the planner's `planned` count of the last subgroups (for "auto"),
    or the last `fraction` of them, checked against the GPU memory free now; "auto" without a count
    grows it after the first step, where the params are on CUDA."""
    m, everything = len(layout), fraction == 1.0
    if planned is not None:
        if not 0 <= planned <= m:
            raise ValueError(f"a memory plan with {planned} subgroups on the GPU: this rank has {m}")
        if planned and device.type != "cuda":
            raise ValueError(f"a memory plan with {planned} subgroups on the GPU, but the params are on {device}")
        return GpuShare(frozenset(range(m - planned, m)), False, everything)
    if fraction == "auto" and device.type != "cuda":
        log.info("offload.gpu_fraction=auto: the params are on %s, so all state stays off the GPU", device)
    if not needs_gpu(fraction):
        return GpuShare(frozenset(), fraction == "auto" and device.type == "cuda", everything)
    if device.type != "cuda":
        raise ValueError(f"offload.gpu_fraction={fraction} keeps state on the GPU, but the params are on {device}: use 0")
    return GpuShare(check_gpu_share(layout, fraction, torch.cuda.mem_get_info(device)[0]), False, everything)


def grow_gpu_share(
    cfg: OffloadConfig, layout: SubgroupLayout, store: SubgroupStore, staging: LowpStaging, copies: CopyStream, device: torch.device
) -> bool:
    """gpu_fraction="auto" in a loop of the user's own: moves to the GPU as many subgroups (the last
    ones) as the GPU memory left by the peak so far holds, keeping gpu_headroom_gb free; True when
    some moved. Runs once, between the first two updates."""
    headroom = int(cfg.gpu_headroom_gb * (1 << 30))
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    # what this process may still take (free, plus what its allocator caches) beyond its own peak
    available = free + torch.cuda.memory_reserved(device) - peak - headroom
    # the staging parts go along, unless already in GPU memory (grad_path="gpu_bf16", as resolved)
    moving = 0 if all(staging.on_device(sg) for sg in store.host_subgroups) else staging.dtype.itemsize
    count, used = last_that_fit(layout, store.host_subgroups, available, moving)
    if count:
        copies.wait_host()  # the grads staged for this step are read as they move
        chosen = store.host_subgroups[len(store.host_subgroups) - count :]
        try:
            buffer = staging.device_buffer_for(chosen, device)
            moved = store.move_to_gpu(count, device)  # all or nothing
        except torch.OutOfMemoryError as exc:  # an economy only: the state stays where it is
            log.warning("offload.gpu_fraction=auto: moving %d subgroups to the GPU ran out of memory (%s); "
                        "they stay off the GPU: raise offload.gpu_headroom_gb", count, str(exc).splitlines()[0])  # fmt: skip
            return False
        staging.move_to_device(moved, buffer)
    log.info(
        "offload.gpu_fraction=auto: %d of %d subgroups (%.2f GiB of state and staging) now live on the GPU; "
        "%.2f GiB of %.2f GiB were free beyond the peak of %.2f GiB, keeping gpu_headroom_gb=%.1f",
        len(store.gpu_state), len(layout), used / 2**30, max(0, available + headroom) / 2**30,
        total / 2**30, peak / 2**30, cfg.gpu_headroom_gb,
    )  # fmt: skip
    return count > 0
