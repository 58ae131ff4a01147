"""Where the forward's FSDP units cut each subgroup.

A subgroup holds the params of several FSDP units back to back. Its update runs piece by piece, a
piece being a row of its segments whose params belong to one unit, and each piece's new params go
back into the model as soon as the kernel has written them. The next forward's units wait for their
own pieces, not for whole subgroups: at 4 ranks a subgroup of 100Mi holds about 7 of the 1.35B's 24
blocks, and the forward of the first of them waited for all 7 to be updated.
"""

from __future__ import annotations

from dataclasses import dataclass

from .subgroups import SubgroupLayout


@dataclass(frozen=True)
class UnitPieces:
    """`ends[sg]`: the segment index where each of subgroup `sg`'s pieces ends, in order (the last is
    its segment count); `needs[u]`: for each subgroup holding params of unit `u`, the index of the last
    of its pieces that `u` needs."""

    ends: tuple[tuple[int, ...], ...]
    needs: tuple[dict[int, int], ...]

    def count(self, sg: int) -> int:
        """Subgroup `sg`'s pieces."""
        return len(self.ends[sg])

    def segments(self, sg: int, piece: int) -> slice:
        """The segments of subgroup `sg` that make its piece `piece`."""
        return slice(self.ends[sg][piece - 1] if piece else 0, self.ends[sg][piece])

    def unit_subgroups(self) -> list[frozenset[int]]:
        """Per unit, the subgroups that hold its params."""
        return [frozenset(need) for need in self.needs]


def unit_pieces(layout: SubgroupLayout, param_units: list[int | None], units: int) -> UnitPieces:
    """The pieces of `layout`'s subgroups, given the unit of each param (None: no unit waits for it;
    such a param joins the piece before it). Without units every subgroup is one piece."""
    ends: list[tuple[int, ...]] = []
    needs: list[dict[int, int]] = [{} for _ in range(units)]
    for sg in layout.subgroups:
        cuts: list[int] = []
        current: int | None = None
        for i, seg in enumerate(sg.segments):
            unit = param_units[seg.param]
            if unit is None:
                continue
            if current is not None and unit != current:
                cuts.append(i)
            current = unit
            needs[unit][sg.index] = len(cuts)  # the piece this segment is in (pieces run in order)
        ends.append((*cuts, len(sg.segments)))
    return UnitPieces(tuple(ends), tuple(needs))
