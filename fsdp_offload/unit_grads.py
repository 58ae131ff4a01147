"""The grads backward's hooks take, handed to the optimizer an FSDP unit at a time.

FSDP2 reduce-scatters one unit's grads at once and then calls each param's post-accumulate-grad hook
in turn, every grad a view of that one reduce-scatter output. Handed over one at a time, each grad
cost the launching thread a norm kernel, a copy and a dozen Python calls (84 us a param on
nvidia-h200-x4, session 30: 18 ms of a 1.35B's backward), and at several ranks every collective
waits for the slowest rank's launching thread. Handed over a unit at a time, the unit's norms are one
multi-tensor kernel and its copies one a run of grads that lie end to end in both the reduce output and
the staging buffer (scripts/bench_hook_cost.py: a median 64 against 50 us a param, in turns on
nvidia-h200-x2; most of what is left is the Python around the ops).

A unit's grads go over when its last param's grad comes; where some param of the unit takes no grad
in a backward, when the next unit's first grad comes; and in any case before anything reads the step's
grads (`hand_over`: the optimizer calls it in step(), after a closure's backward, in a clip and in
stage_grad()). zero_grad() and close() drop what is held.
"""

from __future__ import annotations

from typing import Callable

import torch

HandOver = Callable[[list[int], list[torch.Tensor], list[bool]], None]


class UnitGrads:
    """The grads of the unit whose hooks are running, until they go to the optimizer together."""

    def __init__(self, units: list[list[int]], params: int, hand_over: HandOver) -> None:
        """`units`: the indices of the params of each FSDP unit that take grads (a param in none is a unit
        of its own); `hand_over(indices, grads, fresh)`: the optimizer's, `fresh[k]` saying that grad k
        found p.grad empty (the step's first for that param, or the first since p.grad was cleared)."""
        self._unit_of = [-1] * params
        self._sizes = [len(members) for members in units]
        for u, members in enumerate(units):
            for i in members:
                self._unit_of[i] = u
        self._hand_over = hand_over
        self._indices: list[int] = []
        self._held: set[int] = set()  # (the same indices)
        self._grads: list[torch.Tensor] = []
        self._fresh: list[bool] = []
        self._unit = -1
        self._stream: torch.cuda.Stream | None = None  # the stream the grads were handed in on (FSDP2's post-reduce)

    def add(self, index: int, grad: torch.Tensor, fresh: bool) -> None:
        """Param `index`'s grad (its local shard) from a hook: held until its unit's grads go over."""
        unit = self._unit_of[index]
        if self._indices and (unit != self._unit or unit < 0 or index in self._held):
            self.hand_over()  # another unit's (or a second backward's grad for a param of a unit left incomplete)
        if not self._indices:
            self._unit = unit
            self._stream = torch.cuda.current_stream(grad.device) if grad.is_cuda else None
        self._indices.append(index)
        self._held.add(index)
        self._grads.append(grad)
        self._fresh.append(fresh)
        if unit < 0 or len(self._indices) >= self._sizes[unit]:
            self.hand_over()

    @property
    def holding(self) -> bool:
        return bool(self._indices)

    def hand_over(self) -> None:
        """Hands the grads held to the optimizer, on the caller's current stream ordered after the one they
        came on, each kept alive for what that stream queues on it. Where the optimizer refuses them (a
        step stopped part-way, the last update's error, a grad of the wrong dtype), they stay held and the
        error is raised: the next call hands them over again, or raises again."""
        if not self._indices:
            return
        indices, grads, fresh = self._indices, self._grads, self._fresh
        if self._stream is not None:
            current = torch.cuda.current_stream(self._stream.device)
            if current != self._stream:  # step() after backward: FSDP2 made it wait already, unless backward failed
                current.wait_stream(self._stream)
            for grad in grads:  # freed only after what the current stream queues reading it
                grad.record_stream(current)
        self._hand_over(indices, grads, fresh)  # (it checks every grad before it takes any)
        self.drop()

    def drop(self) -> None:
        """Forgets the grads held (zero_grad(), close())."""
        self._indices, self._grads, self._fresh, self._held = [], [], [], set()
