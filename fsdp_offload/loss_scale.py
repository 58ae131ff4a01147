"""Dynamic loss scaling for fp16: grow the scale after a run of good steps, halve it on overflow."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.growth_factor <= 1 or not 0 < self.backoff_factor < 1 or self.growth_interval < 1:
            raise ValueError(
                f"loss scaler needs scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1; got {self}"
            )

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
