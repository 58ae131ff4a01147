"""Page-locked host windows through which CPU updates read data kept on the GPU, fetched ahead.

A CPU update of a subgroup whose grads (FP32 micro-batch sums, or the bf16 grads of
grad_path="gpu_bf16") stay in GPU memory reads them from a host window, as an update of split masters
reads the model's params. With two windows, while one subgroup is updated from one, the next
subgroup's data comes down into the other, so the copy is off
the update's critical path (where the update is planned with every grad in: with overlap="backward" each
subgroup's data comes down when it is asked for). Copies go on the caller's current stream (the
update's: the copy stream after backward when it runs in flight), so anything queued there after a
window is released (the new params going back up from it) lands before the window is filled again.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cache import host_buffer, unpin
from .subgroups import SubgroupLayout

WINDOWS = 2  # one an update reads, one filling for the next


def windows_bytes(layout: SubgroupLayout, itemsize: int) -> int:
    """Host bytes of the windows for `layout` (each holds its largest subgroup) at `itemsize` bytes an element."""
    return WINDOWS * itemsize * max(sg.padded for sg in layout.subgroups)


class HostWindows:
    """Page-locked windows, each of `layout`'s largest subgroup in `dtype`, filled by `copy_down(sg, window)`
    (which queues subgroup `sg`'s copies from the GPU into `window` on the current stream and returns the
    part of it they fill) in the planned order. A subgroup taken out of that order is copied when it is
    asked for, the newest prefetch giving its window back."""

    def __init__(self, layout: SubgroupLayout, dtype: torch.dtype, device: torch.device,
                 copy_down: Callable[[int, torch.Tensor], torch.Tensor]) -> None:  # fmt: skip
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._raw: list[torch.Tensor] = []
        try:
            for _ in range(WINDOWS):
                self._raw.append(host_buffer(windows_bytes(layout, itemsize) // WINDOWS, pin=True))
        except BaseException:  # (page-locking can fail, e.g. at the locked-memory limit): unpin what was
            for raw in self._raw:
                unpin(raw)
            raise
        self._free = [raw.view(dtype) for raw in self._raw]
        self._copy_down, self._device = copy_down, device
        self._queue: list[int] = []
        self._coming: dict[int, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = {}  # in insertion order
        self._in_use: dict[int, torch.Tensor] = {}  # a window and the part of it the update reads

    @property
    def nbytes(self) -> int:
        return sum(raw.numel() for raw in self._raw)

    def plan(self, order: list[int]) -> None:
        """The subgroups the CPU will update, in order: the first ones start down now."""
        self.reset()
        self._queue = list(order)
        self._fill()

    def _start(self, sg: int) -> None:
        window = self._free.pop()
        part = self._copy_down(sg, window)
        landed = torch.cuda.Event(blocking=True)  # sleeps, not spins: the update's threads need the cores
        landed.record(torch.cuda.current_stream(self._device))
        self._coming[sg] = (window, part, landed)

    def _fill(self) -> None:
        while self._free and self._queue:
            self._start(self._queue.pop(0))

    def take(self, sg: int) -> torch.Tensor:
        """Subgroup `sg`'s data in a window, landed (valid until `release(sg)`)."""
        if sg not in self._coming:
            if sg in self._queue:
                self._queue.remove(sg)
            if not self._free:
                newest = next(reversed(self._coming))
                window, _, landed = self._coming.pop(newest)
                landed.synchronize()
                self._free.append(window)
                self._queue.insert(0, newest)
            self._start(sg)
        window, part, landed = self._coming.pop(sg)
        landed.synchronize()
        self._in_use[sg] = window
        return part

    def release(self, sg: int) -> None:
        """Subgroup `sg`'s update is done with its window (what it queued from it is queued): the window
        takes the next planned subgroup's data."""
        window = self._in_use.pop(sg, None)
        if window is not None:
            self._free.append(window)
            self._fill()

    def reset(self) -> None:
        """Every window free (after a step, or before a retry plans again)."""
        for window, _, landed in self._coming.values():
            landed.synchronize()
            self._free.append(window)
        self._free += self._in_use.values()
        self._coming, self._in_use, self._queue = {}, {}, []

    def close(self) -> None:
        self.reset()
        for raw in self._raw:
            unpin(raw)
        self._raw = []
