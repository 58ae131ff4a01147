"""The flat layout of a rank's params, cut into fixed-size subgroups.

Params are concatenated in a deterministic order (the order given to the optimizer) and cut every
`subgroup_numel` elements, so a param may span several subgroups. A subgroup's FP32 state is one
contiguous buffer [params | exp_avg | exp_avg_sq], each part padded to 4 KiB, so one subgroup is one
I/O. With split masters (bf16 params, kernels/split_masters.py) a host cache slot or a tier holds it as
[the masters' low halves | exp_avg | exp_avg_sq with the rounding bits]: 10 bytes a param, not 12; in GPU
memory and in checkpoints it is FP32.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Callable

import torch

ALIGN_NUMEL = 1024  # 4 KiB of FP32
STATE_PARTS = 3  # master params, exp_avg, exp_avg_sq


def check_subgroup_numel(value: object, name: str = "subgroup_numel") -> None:
    """A subgroup size is a positive multiple of ALIGN_NUMEL; the error names the nearest one."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0 and value % ALIGN_NUMEL == 0:
        return
    hint = ""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0:
        nearest = max(ALIGN_NUMEL, round(value / ALIGN_NUMEL) * ALIGN_NUMEL)
        hint = f"; the nearest is {nearest}"
    raise ValueError(f"{name}={value!r} must be a positive multiple of {ALIGN_NUMEL} (4 KiB of FP32){hint}")


@dataclass(frozen=True)
class Segment:
    """The part of one param that lives in one subgroup."""

    param: int  # index of the param in the optimizer's flat param list
    param_offset: int  # first element, in the param's flattened local data
    offset: int  # first element, within the subgroup
    numel: int

    @property
    def in_param(self) -> slice:
        """Its elements within the param's flattened local data."""
        return slice(self.param_offset, self.param_offset + self.numel)

    @property
    def in_subgroup(self) -> slice:
        """Its elements within the subgroup (and within each part of the subgroup's state)."""
        return slice(self.offset, self.offset + self.numel)


@dataclass(frozen=True)
class Subgroup:
    index: int
    numel: int  # elements that hold params
    padded: int  # numel rounded up to ALIGN_NUMEL: the length of each state part
    segments: tuple[Segment, ...]
    split: bool = False  # held split off the GPU (the masters' low halves), see the module's docstring

    @property
    def state_bytes(self) -> int:
        """Bytes of its FP32 state (in GPU memory, and as checkpoints and state dicts give it)."""
        return STATE_PARTS * self.padded * 4

    @property
    def low_bytes(self) -> int:
        """Bytes of its split masters' low halves, padded to 4 KiB (0 where not split)."""
        return -(-2 * self.padded // 4096) * 4096 if self.split else 0

    @property
    def stored_bytes(self) -> int:
        """Bytes of its state in a host cache slot or a tier file."""
        return self.low_bytes + (STATE_PARTS - 1) * self.padded * 4 if self.split else self.state_bytes

    def stored_parts(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the masters' low halves (int16), exp_avg, exp_avg_sq with the rounding bits) as views of a host
        slot buffer holding this subgroup split; `parts` where it is not split."""
        if not self.split:
            return self.parts(state)
        n, low = self.padded, self.low_bytes
        moments = state[low : self.stored_bytes].view(torch.float32)
        return state[: 2 * n].view(torch.int16), moments[:n], moments[n:]

    def parts(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master params, exp_avg, exp_avg_sq) as FP32 views of a slot buffer holding this subgroup."""
        flat = state[: self.state_bytes].view(torch.float32)
        n = self.padded
        return flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]


def kernel_runs(subgroup: Subgroup, key_of: Callable[[int], object | None]) -> list[tuple[int, int, object]]:
    """(start, stop, key) of each run of `subgroup`'s elements that one kernel call updates: params lie
    back to back in a subgroup, and neighbours of one `key_of(param)` (a param group at one Adam step;
    None: not updated) take one call (the update is elementwise, so this changes no bit)."""
    runs: list[list] = []
    for seg in subgroup.segments:
        key = key_of(seg.param)
        if key is None:
            continue
        if runs and runs[-1][2] == key and runs[-1][1] == seg.offset:
            runs[-1][1] = seg.offset + seg.numel
        else:
            runs.append([seg.offset, seg.offset + seg.numel, key])
    return [(lo, hi, key) for lo, hi, key in runs]


class SubgroupLayout:
    """Deterministic cut of params (given by their element counts) into subgroups."""

    def __init__(self, numels: list[int], subgroup_numel: int, split_masters: bool = False) -> None:
        """`split_masters`: subgroups are held split off the GPU (the model's params are bf16)."""
        check_subgroup_numel(subgroup_numel)
        total = sum(numels)
        if total == 0:
            raise ValueError("the optimizer got no parameter elements to manage")
        self.numels = list(numels)
        self.subgroup_numel = subgroup_numel
        starts, acc = [], 0
        for n in numels:
            starts.append(acc)
            acc += n

        subgroups = []
        first = 0  # the first param that may reach into the next subgroup (one sweep over both)
        for index, lo in enumerate(range(0, total, subgroup_numel)):
            hi = min(lo + subgroup_numel, total)
            segs = []
            while first < len(numels) and starts[first] + numels[first] <= lo:
                first += 1
            p = first
            while p < len(numels) and starts[p] < hi:
                a, b = max(lo, starts[p]), min(hi, starts[p] + numels[p])
                if a < b:
                    segs.append(Segment(param=p, param_offset=a - starts[p], offset=a - lo, numel=b - a))
                p += 1
            numel = hi - lo
            padded = -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL
            subgroups.append(Subgroup(index, numel, padded, tuple(segs), split_masters))
        self.subgroups: list[Subgroup] = subgroups
        self.split_masters = split_masters
        # Where each param's pieces live, for grad staging and gathering state.
        self.param_segments: list[list[tuple[int, Segment]]] = [[] for _ in numels]
        for sg in subgroups:
            for seg in sg.segments:
                self.param_segments[seg.param].append((sg.index, seg))

    def __len__(self) -> int:
        return len(self.subgroups)

    @property
    def split_saves(self) -> bool:
        """Whether its largest subgroup takes fewer bytes split than whole."""
        largest = max(self.subgroups, key=lambda sg: sg.padded)
        return dataclasses.replace(largest, split=True).stored_bytes < largest.state_bytes

    def with_split(self, split_masters: bool) -> SubgroupLayout:
        """This layout, its subgroups held split (or whole) off the GPU."""
        return self if split_masters == self.split_masters else SubgroupLayout(self.numels, self.subgroup_numel, split_masters)

    @property
    def slot_bytes(self) -> int:
        """Bytes of the largest subgroup's stored state: the size of one host cache slot."""
        return max(sg.stored_bytes for sg in self.subgroups)
