"""The order in which a step updates subgroups: one rule, used by the step, the placement and saves.

"alternating" goes ascending on even steps and descending on odd ones, so what the host cache held at
the end of step k is first in line at step k + 1 (MLP-Offload's cache-friendly order); "fixed" always
goes ascending (the ablation baseline).
"""

from __future__ import annotations

UPDATE_ORDERS = ("alternating", "fixed")


def update_order(num_subgroups: int, step: int, order: str) -> list[int]:
    """The subgroups in the order step `step` updates them (`order` is checked by OffloadConfig)."""
    ascending = list(range(num_subgroups))
    return ascending[::-1] if order == "alternating" and step % 2 else ascending


def step_kinds(num_subgroups: int, order: str) -> list[list[int]]:
    """The distinct orders steps take in turn: two with alternating order, one with fixed."""
    return [update_order(num_subgroups, step, order) for step in range(2 if order == "alternating" else 1)]


def order_ending_with(num_subgroups: int, step: int, order: str) -> list[int]:
    """The reverse of step `step`'s order: a pass over every subgroup in it (a fill or a save) leaves
    the host cache holding what that step needs first."""
    return update_order(num_subgroups, step, order)[::-1]
