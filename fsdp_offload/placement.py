"""Which tier a subgroup is written to when it leaves the host cache."""

from __future__ import annotations

from .storage.base import Transfer


class FixedRatioPlacement:
    """Spreads subgroups over tiers in fixed proportions (1 tier: everything goes there).

    Subgroup k goes to the tier whose share is furthest behind its target after k placements (smooth
    weighted round-robin), so the split is deterministic and interleaved along the update order.
    """

    def __init__(self, ratios: list[float], num_subgroups: int) -> None:
        if not ratios or any(r < 0 for r in ratios) or sum(ratios) <= 0:
            raise ValueError(f"placement ratios {ratios} must be non-negative with a positive sum")
        total = sum(ratios)
        credit = [0.0] * len(ratios)
        self._tier: list[int] = []
        for _ in range(num_subgroups):
            for i, r in enumerate(ratios):
                credit[i] += r / total
            best = max(range(len(ratios)), key=lambda i: credit[i])
            credit[best] -= 1.0
            self._tier.append(best)

    def tier_for(self, sg: int) -> int:
        return self._tier[sg]

    def observe(self, transfer: Transfer) -> None:
        """Fixed placement learns nothing from transfers."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the split follows from the ratios alone."""
