"""The order in which a step updates subgroups: one rule, used by the step, the placement and saves.

"forward" (the default) updates the subgroups already in memory first, then the ones that must be
read, each part in the order the model's forward needs them. The next forward waits per FSDP unit for
the subgroups that hold its params, so it starts as soon as the first units' subgroups are done; and
since a step ends holding the last subgroups it visited, the next one starts with cache hits, as many
as the cache holds (the same hit count as MLP-Offload's alternating order).
"alternating" goes ascending on even steps and descending on odd ones (MLP-Offload's cache-friendly
order); "fixed" always goes ascending (the ablation baseline: the cache never hits once it is full).
"""

from __future__ import annotations

from typing import Container, Sequence

UPDATE_ORDERS = ("forward", "alternating", "fixed")


def forward_order(unit_subgroups: Sequence[Sequence[int]], num_subgroups: int) -> list[int]:
    """Every subgroup once, in the order the forward's FSDP units (in the order they run) need them;
    subgroups no unit names (no model given) follow in ascending order."""
    seen: dict[int, None] = {}
    for subgroups in unit_subgroups:
        seen.update((sg, None) for sg in sorted(subgroups))
    seen.update((sg, None) for sg in range(num_subgroups))
    return list(seen)


def update_order(forward: Sequence[int], step: int, order: str, resident: Container[int] = ()) -> list[int]:
    """The subgroups in the order step `step` updates them. `forward`: every subgroup, in the order the
    model's forward uses them; `resident`: the ones held in memory (GPU or host cache) at the start."""
    if order == "forward":
        return [sg for sg in forward if sg in resident] + [sg for sg in forward if sg not in resident]
    ascending = sorted(forward)
    return ascending[::-1] if order == "alternating" and step % 2 else ascending


def step_kinds(forward: Sequence[int], cache_slots: int, order: str) -> list[list[int]]:
    """The distinct orders that steady-state steps take in turn (two with alternating order, one with
    fixed; with forward order, the cycle the cache settles into, which a pass's fill starts it in)."""
    if order != "forward":
        return [update_order(forward, step, order) for step in range(2 if order == "alternating" else 1)]
    resident = set(order_ending_with(forward, 0, order)[-cache_slots:]) if cache_slots else set()
    seen: list[list[int]] = []
    while True:
        o = update_order(forward, 0, order, resident)
        if o in seen:
            return seen[seen.index(o) :]
        seen.append(o)
        resident = set(o[-cache_slots:]) if cache_slots else set()  # a step ends holding what it visited last


def order_ending_with(forward: Sequence[int], step: int, order: str) -> list[int]:
    """The order of a pass over every subgroup that is not a step (a fill or a save): it leaves the host
    cache holding what step `step` needs first."""
    if order == "forward":
        return list(forward)[::-1]
    return update_order(forward, step, order)[::-1]
