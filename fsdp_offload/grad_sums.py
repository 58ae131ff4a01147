"""Gradient accumulation: the FP32 sums of a step's micro-batch grads, kept where the step reads them.

With one backward per step, each grad goes straight into the low-precision staging buffer and the
kernel upcasts it in flight. With several, one param's grads are summed in FP32 in micro-batch order,
as torch sums FP32 grads: each add is one IEEE rounding of the upcast grad onto the sum, so the GPU and
the CPU give the same bits. Where the sums live (`offload.grad_accumulation`, resolved once):
- "gpu": an FP32 buffer on the params' GPU, laid out by subgroup. Backward's hooks add an FSDP unit's
  grads to it on FSDP2's post-reduce stream, one add a run of grads that lie end to end in both the
  reduce output and the sums, and free the grads; nothing crosses PCIe during backward. At the
  step a CPU-updated subgroup's sums come down through one of two page-locked FP32 windows while the
  subgroup before it is updated (4 bytes a param, once a step); a GPU-resident subgroup's kernel
  reads them in place.
- "host": a subgroup's sums live where its staged grads do (host memory, or the GPU for GPU-resident
  subgroups and grad_path="gpu_bf16"). The first grad is staged as with one backward; each later
  one is copied into a page-locked landing buffer, and a worker thread adds it to the host sums while
  backward goes on (the hook waits only if the worker has not yet taken the same param's last grad).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .cache import aligned_host_buffer, host_buffer, unpin
from .host_windows import HostWindows, windows_bytes
from .node import says_once
from .staging import LowpStaging, copy_in_runs, runs
from .subgroups import Segment, SubgroupLayout

log = logging.getLogger(__name__)


def sums_bytes(layout: SubgroupLayout, subgroups: list[int]) -> int:
    """Bytes of FP32 sums for `subgroups` (padded, as laid out)."""
    return 4 * sum(layout.subgroups[sg].padded for sg in subgroups)


def grad_accumulation_memory(layout: SubgroupLayout, mode: str, micro_batches: int, host_subgroups: list[int]) -> tuple[int, int]:
    """(GPU bytes, host bytes) that accumulating over `micro_batches` takes in `mode` ("gpu"/"host"),
    `host_subgroups` being those whose state (and staged grads) are off the GPU: none with one
    micro-batch; "gpu": every subgroup's FP32 sums on the GPU and two subgroups' page-locked FP32
    windows; "host": FP32 sums and a bf16 landing buffer (6 bytes a param) for the host subgroups and
    the worker's FP32 scratch, and FP32 sums for the others on the GPU."""
    if micro_batches <= 1:
        return 0, 0
    everything = list(range(len(layout)))
    if mode == "gpu":
        return sums_bytes(layout, everything), windows_bytes(layout, 4)
    on_gpu = [sg for sg in everything if sg not in set(host_subgroups)]
    scratch = 4 * fold_chunk(layout) if host_subgroups else 0
    return sums_bytes(layout, on_gpu), sums_bytes(layout, host_subgroups) * 6 // 4 + scratch


def resolve_grad_accumulation(mode: str, micro_batches: int, device_type: str, gpu_room: int | None, gpu_need: int) -> str:
    """`offload.grad_accumulation` made "gpu" or "host": "auto" is "gpu" where several micro-batches are
    accumulated on CUDA params and the GPU has `gpu_need` bytes of `gpu_room` for the sums, else "host"
    (one micro-batch: nothing is summed, and "host" allocates nothing unless a second grad comes)."""
    if mode == "gpu" and device_type != "cuda":
        raise ValueError(
            f"offload.grad_accumulation='gpu' sums the grads in GPU memory, but the params are on {device_type}: "
            "use offload.grad_accumulation='host' (or 'auto')"
        )
    if mode != "auto":
        return mode
    if micro_batches > 1 and device_type == "cuda" and gpu_room is not None and gpu_need <= gpu_room:
        return "gpu"
    return "host"


def fold_chunk(layout: SubgroupLayout) -> int:
    """Elements the host worker upcasts at a time: 4Mi (16 MiB of FP32), or the largest subgroup's."""
    return min(1 << 22, max(sg.padded for sg in layout.subgroups))


class GradSums:
    """The FP32 sums of one step's grads, for the params that take more than one grad (all params with
    mode "gpu", whose first grad starts the sum)."""

    def __init__(
        self, layout: SubgroupLayout, staging: LowpStaging, mode: str, device: torch.device, gpu_resident: frozenset[int],
        planned: bool,
    ) -> None:  # fmt: skip
        """`gpu_resident`: the subgroups updated on the GPU; `planned`: the config said to accumulate
        (offload.micro_batches > 1): the buffers are made now, else at the first second grad, with a
        warning (memory the plan did not count)."""
        self.layout, self.staging, self.mode, self.device = layout, staging, mode, device
        self.gpu_resident = gpu_resident
        self._pin = device.type == "cuda"
        n = len(layout.numels)
        self.summed = [False] * n  # param i's grads of this step are in the sums
        # "host": on the GPU only for subgroups updated there (grad_accumulation_memory counts it so)
        self._sums_on_device = [mode == "gpu" or sg in gpu_resident for sg in range(len(layout))]
        self._pieces: list[list[tuple[torch.Tensor, int, Segment, torch.Tensor | None]]] | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._taken: list[Future | None] = [None] * n  # the worker's last add of param i
        self._windows: HostWindows | None = None  # where CPU updates read sums kept on the GPU
        self._raw: list[torch.Tensor] = []  # buffers to unpin at close
        self._planned = planned
        if planned:
            self._allocate()

    @property
    def first_grad_starts_sum(self) -> bool:
        return self.mode == "gpu"

    def _allocate(self) -> None:
        """The sums (device and host), the landing buffer and the window, laid out by subgroup."""
        device_sgs = [sg for sg in range(len(self.layout)) if self._sums_on_device[sg]]
        host_sgs = [sg for sg in range(len(self.layout)) if not self._sums_on_device[sg]]
        device_sums = torch.empty(sums_bytes(self.layout, device_sgs) // 4, dtype=torch.float32, device=self.device)
        host_sums = aligned_host_buffer(sums_bytes(self.layout, host_sgs)).view(torch.float32)
        landing_raw = host_buffer(sums_bytes(self.layout, host_sgs) // 2, self._pin)
        self._raw.append(landing_raw)
        landing = landing_raw.view(self.staging.dtype)
        self._views: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # per subgroup: (sums, landing)
        offsets = {True: 0, False: 0}
        for sg in self.layout.subgroups:
            on_device, lo = self._sums_on_device[sg.index], offsets[self._sums_on_device[sg.index]]
            hi = lo + sg.padded
            self._views.append((device_sums[lo:hi], None) if on_device else (host_sums[lo:hi], landing[lo:hi]))
            offsets[on_device] = hi
        self._pieces = [
            [(self._views[sg][0][seg.in_subgroup], sg, seg, self._land(sg, seg)) for sg, seg in segs]
            for segs in self.layout.param_segments
        ]
        if host_sgs:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="fsdp-offload-grad-sums")
            self._scratch = torch.empty(fold_chunk(self.layout), dtype=torch.float32)  # the worker's alone
        if self.device.type == "cuda" and any(sg not in self.gpu_resident for sg in device_sgs):  # CPU updates read them
            self._windows = HostWindows(self.layout, torch.float32, self.device, self._copy_down)

    def _land(self, sg: int, seg: Segment) -> torch.Tensor | None:
        landing = self._views[sg][1]
        return None if landing is None else landing[seg.in_subgroup]

    def takes(self, index: int) -> bool:
        """Whether param `index`'s next grad goes into the sums (else into the staging buffer)."""
        return self.first_grad_starts_sum or self.staging.staged[index]

    def add(self, indices: list[int], grads: list[torch.Tensor]) -> None:
        """Adds each param's grad (its local shard, on any device) to its sum; the first add of a step
        starts the sum from the grad ("gpu") or from the grad already staged ("host"). Sums that live where
        the grads do take one copy or add a run of grads end to end in both (`staging.runs`); the others
        go through the landing buffer to the worker a param at a time."""
        if self._pieces is None and says_once():
            log.warning(
                "a second backward came before step() with offload.micro_batches=1: the grads are summed in FP32 "
                "from now on, in %s more memory than planned; set offload.micro_batches to the backward calls per step",
                _gib(sum(4 * sg.padded for sg in self.layout.subgroups)),
            )
        if self._pieces is None:
            self._allocate()
        for index in indices:  # the worker's error, if any, before anything is taken: a refused unit is handed over again
            self._wait_taken(index)
        starts: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (sums, first values) copied first
        adds: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (sums, grads) added after
        for index, grad in zip(indices, grads):
            starting = not self.summed[index]
            pieces = self._pieces[index]
            whole = len(pieces) == 1  # (the param lies in one subgroup)
            flat = grad if whole and pieces[0][3] is None else grad.reshape(-1)  # (runs() flattens the grads it merges)
            for sums, sg, seg, landing in pieces:
                src = flat if whole else flat[seg.in_param]
                if landing is None:  # the sums are where the grad is: add in stream order
                    if starting and self.first_grad_starts_sum:
                        _append(starts, sums, src)
                        continue
                    if starting:
                        _append(starts, sums, self._staged(sg, seg))
                    _append(adds, sums, src)
                    continue
                self._wait_taken(index)  # (a param twice in one call: the worker still has the first in the landing buffer)
                landing.copy_(src, non_blocking=src.is_cuda)
                landed = _event_after_current(src)
                staged = self._staged(sg, seg) if starting else None
                self._taken[index] = self._worker.submit(_fold, sums, landing, staged, landed, self._scratch)
            self.summed[index] = True
            self.staging.staged[index] = True
        copy_in_runs(*starts)  # (a param's start before its add: no param starts twice in one call)
        for sums, src in runs(*adds):
            sums.add_(src.to(sums.device))

    def _staged(self, sg: int, seg: Segment) -> torch.Tensor:
        """The grad staged for segment `seg` of subgroup `sg` (its param's first grad of the step)."""
        return self.staging.view(sg)[seg.in_subgroup]

    def _wait_taken(self, index: int) -> None:
        taken, self._taken[index] = self._taken[index], None
        if taken is not None:
            taken.result()

    def drain(self) -> None:
        """Waits for every add the worker has yet to finish (before the sums are read); raises its error."""
        for i in range(len(self._taken)):
            self._wait_taken(i)

    def subgroup_summed(self, sg: int) -> bool:
        """Whether any param of subgroup `sg` has its grads in the sums this step."""
        return any(self.summed[seg.param] for seg in self.layout.subgroups[sg].segments)

    def param_sum(self, index: int) -> torch.Tensor:
        """Param `index`'s FP32 sum as one flat tensor (a copy when it spans subgroups)."""
        pieces = [sums for sums, _, _, _ in self._pieces[index]]
        if not pieces:
            return torch.empty(0, dtype=torch.float32)
        return pieces[0] if len(pieces) == 1 else torch.cat([p.to(pieces[0].device) for p in pieces])

    def for_update(self, sg: int, on_gpu: bool) -> torch.Tensor:
        """Subgroup `sg`'s FP32 grads for its update, on the GPU (`on_gpu`) or in host memory: its
        params' sums, and the upcast staged grads of those with one grad this step. A CPU update of
        sums kept on the GPU reads them through a window (valid until `after_update(sg)`)."""
        sums = self.completed(sg)
        if on_gpu:  # (host sums of a subgroup that gpu_fraction="auto" moved to the GPU go up)
            return sums if sums.is_cuda else sums.to(self.device)
        return self._windows.take(sg) if sums.is_cuda else sums

    def _copy_down(self, sg: int, window: torch.Tensor) -> torch.Tensor:
        sums = self.completed(sg)
        return window[: sums.numel()].copy_(sums, non_blocking=True)

    def completed(self, sg: int) -> torch.Tensor:
        """Subgroup `sg`'s sums where they live, completed with the upcast staged grads of its params
        that took one grad."""
        sums, _ = self._views[sg]
        for seg in self.layout.subgroups[sg].segments:
            if self.staging.staged[seg.param] and not self.summed[seg.param]:
                sums[seg.in_subgroup].copy_(self._staged(sg, seg))
        return sums

    def plan_cpu_updates(self, order: list[int]) -> None:
        """The subgroups the CPU will update, in order: those whose sums are on the GPU start down now."""
        if self._windows is not None:
            self._windows.plan([sg for sg in order if self._sums_on_device[sg] and self.subgroup_summed(sg)])

    def after_update(self, sg: int) -> None:
        """Subgroup `sg`'s CPU update has read its grads: its window takes the next subgroup's."""
        if self._windows is not None:
            self._windows.release(sg)

    def clear(self) -> None:
        self.drain()
        if self._windows is not None:
            self._windows.reset()
        self.summed = [False] * len(self.summed)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        if self._windows is not None:
            self._windows.close()
        for raw in self._raw:
            if self._pin and raw.numel():
                unpin(raw)
        self._raw = []


def _append(pairs: tuple[list[torch.Tensor], list[torch.Tensor]], dst: torch.Tensor, src: torch.Tensor) -> None:
    pairs[0].append(dst)
    pairs[1].append(src)


def _event_after_current(src: torch.Tensor) -> torch.cuda.Event | None:
    if not src.is_cuda:
        return None
    event = torch.cuda.Event(blocking=True)
    event.record(torch.cuda.current_stream(src.device))
    return event


@torch.no_grad()
def _fold(sums: torch.Tensor, landing: torch.Tensor, staged: torch.Tensor | None, landed: torch.cuda.Event | None,
          scratch: torch.Tensor) -> None:  # fmt: skip
    """The worker's add: waits for the grad's copy to land, starts the sum from the staged first grad
    where this is the param's second, and adds the landed grad, upcast a chunk at a time into
    `scratch` (the same bits as adding the bf16 grad to the FP32 sum directly, which torch does
    several times slower: its mixed-dtype add does not vectorise the cast)."""
    if landed is not None:
        landed.synchronize()
    if staged is not None:
        sums.copy_(staged)
    for lo in range(0, sums.numel(), scratch.numel()):
        hi = min(lo + scratch.numel(), sums.numel())
        part = scratch[: hi - lo]
        part.copy_(landing[lo:hi])
        sums[lo:hi].add_(part)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
