"""The host buffer of low-precision values laid out by subgroup.

Backward hands each param's bf16/fp16 grad into it; after a subgroup's update the kernel overwrites
that subgroup's grads with the new bf16/fp16 params, which are copied from here back into the model.
One buffer does both jobs, so no FP32 grad and no second low-precision copy is ever held.

A subgroup's part lives in host memory, or in GPU memory (GPU-resident state, or grad_path="gpu_bf16").
A part in GPU memory whose subgroup is updated on the CPU passes through one of two page-locked
windows (`host_windows.py`): its grads come down into one while the subgroup before it is updated from
the other (except with overlap="backward", where they come down when its update starts), and its new
params go back up from it.

With split masters (kernels/split_masters.py) a CPU update also reads the subgroup's params as the model
holds them (their high halves): from GPU params through two windows of their own, fetched ahead alike.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .cache import host_buffer, unpin
from .host_windows import HostWindows
from .subgroups import Segment, SubgroupLayout

LOWP_DTYPES = (torch.bfloat16, torch.float16)


def resolve_grad_path(mode: str, device_type: str, fixed_gpu_share: bool, host_spills: bool, host_short: bool,
                      gpu_room: int | None, gpu_need: int) -> str:  # fmt: skip
    """`offload.grad_path` made concrete. "auto" keeps the grads in GPU memory ("gpu_bf16") where the
    params are on CUDA, the GPU has `gpu_need` bytes of `gpu_room` for them, and either the budget is
    short of the pipeline's minimum with the grads in host memory and not without (`host_short`), or
    the host cache would spill subgroups to the tiers with them there and hold more without
    (`host_spills`; the caller weighs both plans) and the GPU share is a fixed
    fraction (gpu_fraction="auto" gives the GPU's room to state, which saves the tiers as many bytes
    and the CPU its update too). Their host memory then goes to the cache. Else "host_bf16", which
    stages them during backward."""
    if mode != "auto":
        return mode
    wanted = host_short or (fixed_gpu_share and host_spills)
    if device_type == "cuda" and wanted and gpu_room is not None and gpu_need <= gpu_room:
        return "gpu_bf16"
    return "host_bf16"


def _storage_start(t: torch.Tensor) -> int:
    """The address of the start of `t`'s storage (the same for every tensor on one allocation)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


def runs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The pairs (`dsts[k]`, `srcs[k]`) (of one dtype each side, `dsts[k]` 1-D, `srcs[k]` of any shape with as
    many elements) as 1-D pairs, contiguous ones that continue each other in both sides merged into one
    pair: on the GPU each op on a pair is a launch the backward's thread pays, and an elementwise op gives
    each element the same bits merged or not. A run is told by address, on one storage each side: views
    made in the HeldGrad's dispatch (below autograd), as the hand-over of a later micro-batch's grads makes
    them, have no `_base`, and the storage's start tells apart allocations that lie end to end."""
    k = 0
    while k < len(dsts):
        dst, src = dsts[k], srcs[k]
        n, end = dst.numel(), k + 1
        if not (dst.is_contiguous() and src.is_contiguous() and src.numel() == n):  # (as_strided flattens only these)
            yield dst, src.reshape(-1)  # (a pair of unequal sizes fails in the op, as unmerged)
            k = end
            continue
        dst_size, src_size = dst.element_size(), src.element_size()
        dst_end, src_end = dst.data_ptr() + n * dst_size, src.data_ptr() + n * src_size
        dst_storage, src_storage = _storage_start(dst), _storage_start(src)
        while end < len(dsts):
            d, s = dsts[end], srcs[end]
            m = d.numel()
            # (a strided view starting at a run's end is no part of it)
            if not (d.data_ptr() == dst_end and s.data_ptr() == src_end and s.numel() == m and d.is_contiguous()
                    and s.is_contiguous() and _storage_start(d) == dst_storage and _storage_start(s) == src_storage):  # fmt: skip
                break
            n, end, dst_end, src_end = n + m, end + 1, dst_end + m * dst_size, src_end + m * src_size
        yield dst.as_strided((n,), (1,)), src.as_strided((n,), (1,))
        k = end


def copy_in_runs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """`dsts[k].copy_(srcs[k])` for each k, one copy a run (see `runs`)."""
    for dst, src in runs(dsts, srcs):
        dst.copy_(src, non_blocking=src.is_cuda)


class LowpStaging:
    def __init__(
        self,
        layout: SubgroupLayout,
        dtype: torch.dtype,
        pin: bool,
        on_device: frozenset[int] = frozenset(),
        device: torch.device | None = None,
        host_window: bool = False,
        params_window: bool = False,
    ) -> None:
        """`on_device`: subgroups whose part of the buffer lives on `device`; `host_window`: some of them
        are updated on the CPU (grad_path="gpu_bf16"), through two host windows of the largest subgroup;
        `params_window`: CPU updates of split masters read the model's params on `device` through two more."""
        if dtype not in LOWP_DTYPES:
            raise ValueError(f"param_dtype must be one of {LOWP_DTYPES}, got {dtype}")
        self.layout = layout
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._where: list[tuple[bool, int]] = []  # per subgroup: (on device, offset in that buffer)
        host_numel = device_numel = 0
        for sg in layout.subgroups:
            if sg.index in on_device:
                self._where.append((True, device_numel))
                device_numel += sg.padded
            else:
                self._where.append((False, host_numel))
                host_numel += sg.padded
        self._raw = host_buffer(host_numel * itemsize, pin)
        self._pinned = pin and self._raw.numel() > 0
        self.buffer = self._raw.view(dtype)
        self._windows = HostWindows(layout, dtype, device, self._grads_down) if host_window else None
        self._params_windows = HostWindows(layout, dtype, device, self._params_down) if params_window else None
        self._params: list[torch.Tensor] = []  # the model's local params, as the update in progress sees them
        self.device_buffer = torch.empty(device_numel, dtype=dtype, device=device) if on_device else None
        self.staged = [False] * len(layout.numels)  # which params hold a grad for the next step
        self._make_pieces()

    def _make_pieces(self) -> None:
        # Each segment's view of the buffer and its part of the param (None: the whole param, no slice),
        # made once: the backward hook (per param) and the copy back (per subgroup) run every step
        def piece(sg: int, seg: Segment) -> tuple[torch.Tensor, slice | None]:
            return self.view(sg)[seg.in_subgroup], None if seg.numel == self.layout.numels[seg.param] else seg.in_param

        self._pieces: list[list[tuple[torch.Tensor, slice | None]]] = [
            [piece(sg, seg) for sg, seg in segs] for segs in self.layout.param_segments
        ]
        self._subgroup_pieces: list[list[tuple[int, torch.Tensor, slice | None]]] = [
            [(seg.param, *piece(sg, seg)) for seg in subgroup.segments] for sg, subgroup in enumerate(self.layout.subgroups)
        ]

    def device_buffer_for(self, subgroups: list[int], device: torch.device) -> torch.Tensor:
        """The device buffer that the parts on the device and those of `subgroups` will share (allocated
        before anything moves: where it does not fit, nothing has)."""
        numel = 0 if self.device_buffer is None else self.device_buffer.numel()
        numel += sum(self.layout.subgroups[sg].padded for sg in subgroups if not self._where[sg][0])
        return torch.empty(numel, dtype=self.dtype, device=device)

    def move_to_device(self, subgroups: list[int], new: torch.Tensor) -> None:
        """Moves the parts of `subgroups` (with what they hold now) into device memory, into `new`
        (from device_buffer_for), for subgroups whose state moved to the GPU. Their host part stays
        allocated, unused."""
        old, old_numel = self.device_buffer, 0 if self.device_buffer is None else self.device_buffer.numel()
        moved = [sg for sg in sorted(subgroups) if not self._where[sg][0]]
        if old is not None:
            new[:old_numel].copy_(old)
        offset = old_numel
        for sg in moved:
            n = self.layout.subgroups[sg].padded
            new[offset : offset + n].copy_(self.view(sg))
            self._where[sg] = (True, offset)
            offset += n
        self.device_buffer = new
        self._make_pieces()

    @property
    def nbytes(self) -> int:
        """Host bytes (the host parts and the windows)."""
        return self._raw.numel() + sum(0 if w is None else w.nbytes for w in (self._windows, self._params_windows))

    def _grads_down(self, sg: int, window: torch.Tensor) -> torch.Tensor:
        part = self.view(sg)
        return window[: part.numel()].copy_(part, non_blocking=True)

    def _copy_params(self, sg: int, params: list[torch.Tensor], into: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        """Subgroup `sg`'s pieces of the model's `params` into `into` (its padded length), one copy call."""
        segments = self.layout.subgroups[sg].segments
        torch._foreach_copy_([into[seg.in_subgroup] for seg in segments],
                             [params[seg.param].view(-1)[seg.in_param] for seg in segments], non_blocking=non_blocking)  # fmt: skip
        return into

    def _params_down(self, sg: int, window: torch.Tensor) -> torch.Tensor:
        return self._copy_params(sg, self._params, window[: self.layout.subgroups[sg].padded], non_blocking=True)

    def model_params(self, sg: int, params: list[torch.Tensor]) -> torch.Tensor:
        """Subgroup `sg`'s low-precision params (padded with zeros, in host memory) as the model holds them:
        the high halves of its split masters."""
        return self._copy_params(sg, params, torch.zeros(self.layout.subgroups[sg].padded, dtype=self.dtype), non_blocking=False)

    def model_params_for_update(self, sg: int, params: list[torch.Tensor]) -> torch.Tensor:
        """`model_params` for a CPU update of subgroup `sg` (landed; a window's until `after_cpu_update`)."""
        if self._params_windows is None:
            return self.model_params(sg, params)
        self._params = params
        return self._params_windows.take(sg)

    def view(self, sg: int) -> torch.Tensor:
        """Subgroup `sg`'s part of the buffer (padded length)."""
        on_device, lo = self._where[sg]
        return (self.device_buffer if on_device else self.buffer)[lo : lo + self.layout.subgroups[sg].padded]

    def plan_cpu_updates(self, order: list[int], params: list[torch.Tensor]) -> None:
        """The subgroups the CPU is about to update, in order: those whose part is in device memory start
        down into the windows now (on the caller's current stream, after backward's copies), as do the
        model's `params` of each, for split masters."""
        if self._windows is not None:
            self._windows.plan([sg for sg in order if self._where[sg][0]])
        if self._params_windows is not None:
            self._params = params
            self._params_windows.plan(order)

    def for_cpu_update(self, sg: int) -> torch.Tensor:
        """Subgroup `sg`'s part in host memory, for a CPU update that reads grads from it and writes new
        params over them: the part itself, or a host window holding a copy of the part (landed)."""
        if not self._where[sg][0]:
            return self.view(sg)
        return self._windows.take(sg)

    def after_cpu_update(self, sg: int, lowp: torch.Tensor) -> None:
        """Puts the new params of a part updated through a host window back into the part (queued on the
        current stream, before anything that reuses the window), and gives the window back."""
        if self._where[sg][0]:
            self.view(sg).copy_(lowp, non_blocking=True)
            self._windows.release(sg)
        if self._params_windows is not None:
            self._params_windows.release(sg)

    def stage(self, params: list[int], grads: list[torch.Tensor]) -> None:
        """Copies each param's grad (its local shard, any shape, on any device: its first of the step; later
        ones are summed in FP32 by grad_sums.GradSums) into the buffer: one copy a run of pieces that lie
        end to end both where the grads are and in the buffer (an FSDP unit's grads are views of one
        reduce-scatter output, and its params' parts of a subgroup follow each other)."""
        dsts, srcs = [], []
        for param, grad in zip(params, grads):
            for dst, part in self._pieces[param]:
                dsts.append(dst)
                srcs.append(grad if part is None else grad.reshape(-1)[part])
        copy_in_runs(dsts, srcs)
        for param in params:
            self.staged[param] = True

    def on_device(self, sg: int) -> bool:
        """Whether subgroup `sg`'s part lives in device memory."""
        return self._where[sg][0]

    def param_grad(self, param: int) -> torch.Tensor:
        """Param `param`'s staged grad as one flat tensor (a copy when it spans subgroups)."""
        pieces = [piece for piece, _ in self._pieces[param]]
        if not pieces:  # an empty local shard (FSDP2 gives one where dim 0 is below the world size)
            return torch.empty(0, dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else torch.cat([p.to(pieces[0].device) for p in pieces])

    def copy_params_to_model(self, sg: int, params: list[torch.Tensor]) -> None:
        """Copies subgroup `sg`'s updated low-precision params into the model's local param data: one
        call for all of them, from source views made once (this runs for every subgroup of every step,
        on the thread the next forward waits for)."""
        dsts, srcs = [], []
        for p, piece, part in self._subgroup_pieces[sg]:
            if self.staged[p]:  # (a param without a grad was not updated)
                dsts.append(params[p].view(-1) if part is None else params[p].view(-1)[part])
                srcs.append(piece)
        if dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=dsts[0].is_cuda)

    def load_params_from_master(self, sg: int, master: torch.Tensor, params: list[torch.Tensor]) -> None:
        """Rounds `sg`'s FP32 masters into the buffer and writes them to the model (after a load)."""
        lowp = self.view(sg)
        for seg in self.layout.subgroups[sg].segments:
            piece = seg.in_subgroup
            lowp[piece].copy_(master[piece])
            dst = params[seg.param].view(-1)[seg.in_param]
            dst.copy_(lowp[piece], non_blocking=dst.is_cuda)

    def clear(self) -> None:
        self.staged = [False] * len(self.staged)
        for windows in (self._windows, self._params_windows):
            if windows is not None:
                windows.reset()

    def close(self) -> None:
        """Unregisters the pinned pages (before the memory can be reused by another buffer)."""
        for windows in (self._windows, self._params_windows):
            if windows is not None:
                windows.close()
        if self._pinned:
            unpin(self._raw)
            self._pinned = False
