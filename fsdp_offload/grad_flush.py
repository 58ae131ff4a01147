"""The DeepSpeed-style gradient path, kept as the ablation switch `offload.grad_path="tier_fp32"`.

Each step, every host-resident subgroup's grads are upcast to FP32 and written to a tier, then read
back for its update: 8 more bytes of I/O per param and step than keeping the bf16 grads in host
memory and upcasting in flight (the default, MLP-Offload's "skip gradients"). The math is unchanged:
a bf16 -> FP32 upcast is exact.
"""

from __future__ import annotations

import torch

from .cache import aligned_host_buffer
from .schedule import Placement
from .staging import LowpStaging
from .storage.base import Tier, Transfer
from .subgroups import SubgroupLayout

GRAD_PATHS = ("host_bf16", "tier_fp32")


def grad_slot_bytes(layout: SubgroupLayout) -> list[int]:
    """Bytes of each subgroup's FP32 grad slot; these slots follow the state slots in a tier's file."""
    return [4 * sg.padded for sg in layout.subgroups]


class FP32GradFlush:
    def __init__(self, layout: SubgroupLayout, tiers: list[Tier], placement: Placement) -> None:
        self.layout, self.tiers, self.placement = layout, tiers, placement
        self._first_key = len(layout)
        self._buffer = aligned_host_buffer(max(grad_slot_bytes(layout)))
        self._tier_of: dict[int, int] = {}

    def _view(self, sg: int) -> torch.Tensor:
        return self._buffer[: 4 * self.layout.subgroups[sg].padded]

    def write(self, subgroups: list[int], staging: LowpStaging) -> list[Transfer]:
        """Upcasts and writes the staged grads of `subgroups`, one at a time through one buffer."""
        done = []
        for sg in subgroups:
            buf = self._view(sg)
            buf.view(torch.float32).copy_(staging.view(sg))
            tier = self.placement.tier_for(sg)
            done.append(self.tiers[tier].write(self._first_key + sg, buf).result())
            self._tier_of[sg] = tier
        return done

    def read(self, sg: int) -> tuple[torch.Tensor, Transfer]:
        """Subgroup `sg`'s FP32 grads, read back (valid until the next read)."""
        buf = self._view(sg)
        t = self.tiers[self._tier_of[sg]].read(self._first_key + sg, buf).result()
        return buf.view(torch.float32), t
