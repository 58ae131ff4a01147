"""The update order and the fetch -> update -> flush pipeline over subgroups.

While subgroup i is updated, the next `prefetch` subgroups are being fetched; fetching one into a
slot whose occupant is dirty first writes the occupant to the tier the placement picks (a lazy flush:
nothing is written until its slot is needed). A subgroup's host copy is dropped only once its write is
known good, so an I/O error loses nothing.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .cache import HostCache
from .storage.base import Tier, Transfer
from .subgroups import SubgroupLayout

UPDATE_ORDERS = ("alternating", "fixed")


def update_order(num_subgroups: int, step: int, order: str) -> list[int]:
    """Ascending on even steps and descending on odd ones ("alternating"), or always ascending.

    Alternating keeps what the cache held at the end of step k first in line at step k + 1.
    """
    if order not in UPDATE_ORDERS:
        raise ValueError(f"unknown update order {order!r}: choose one of {UPDATE_ORDERS}")
    ascending = list(range(num_subgroups))
    return ascending[::-1] if order == "alternating" and step % 2 else ascending


class Placement(Protocol):
    def tier_for(self, sg: int) -> int: ...

    def observe(self, transfer: Transfer) -> None: ...


@dataclass
class _Fetch:
    """One subgroup on its way into a slot, with the flush of the slot's previous occupant."""

    sg: int
    slot: int
    victim: int | None  # dirty subgroup written out of the slot first
    victim_tier: int | None
    done: Future = field(default_factory=Future)
    write: Transfer | None = None
    read: Transfer | None = None
    error: BaseException | None = None
    write_failed: bool = False


class SubgroupPipeline:
    """Moves subgroups between the host cache and the tiers as an update pass walks them."""

    def __init__(
        self,
        layout: SubgroupLayout,
        cache: HostCache,
        tiers: list[Tier],
        placement: Placement,
        prefetch: int,
    ) -> None:
        self.layout = layout
        self.cache = cache
        self.tiers = tiers
        self.placement = placement
        self.prefetch = prefetch
        self.location: dict[int, int] = {}  # subgroup -> tier holding its latest good stored copy
        self._fetches: dict[int, _Fetch] = {}
        self.transfers: list[Transfer] = []  # since the last take_transfers()
        self.hits = 0

    def view(self, slot: int, sg: int) -> torch.Tensor:
        return self.cache.slots[slot][: self.layout.subgroups[sg].state_bytes]

    def take_transfers(self) -> tuple[list[Transfer], int]:
        """The transfers and cache hits since the last call."""
        out, hits = self.transfers, self.hits
        self.transfers, self.hits = [], 0
        return out, hits

    # -- one pass over subgroups -------------------------------------------------------------

    def run(
        self,
        order: list[int],
        visit: Callable[[int, torch.Tensor], None],
        *,
        load: bool = True,
        dirty: bool = True,
    ) -> None:
        """Calls `visit(sg, state)` on each subgroup of `order` with its state resident.

        `load=False` skips reading stored copies (the visit overwrites the whole state);
        `dirty=False` says the visit only reads the state.
        """
        try:
            for i, sg in enumerate(order):
                window = order[i : i + 1 + self.prefetch]
                keep = set(window)
                for nxt in window:
                    self._start(nxt, load, keep)
                state = self._acquire(sg, load, keep)
                visit(sg, state)
                if dirty:
                    self.cache.dirty.add(sg)
        except BaseException:
            self.drain()
            raise

    def _start(self, sg: int, load: bool, keep: set[int]) -> bool:
        """Begins bringing `sg` into a slot; False when every slot is spoken for right now."""
        if self.cache.is_resident(sg) or sg in self._fetches:
            return True
        slot, victim = self.cache.take_free(), None
        if slot is None:
            victim = self.cache.victim(keep)
            if victim is None:
                return False
            was_dirty = victim in self.cache.dirty
            slot = self.cache.remove(victim)
            if not was_dirty:
                victim = None  # its stored copy is current: the slot is simply reused
        fetch = _Fetch(sg, slot, victim, None if victim is None else self.placement.tier_for(victim))
        self._fetches[sg] = fetch
        read_tier = self.tiers[self.location[sg]] if load else None
        self._chain(fetch, read_tier)
        return True

    def _chain(self, f: _Fetch, read_tier: Tier | None) -> None:
        """Write the victim (if any), then read `f.sg` (if asked), then resolve `f.done`."""

        def finish(error: BaseException | None = None, write_failed: bool = False) -> None:
            f.error, f.write_failed = error, write_failed
            f.done.set_result(None)

        def after_read(fut: Future) -> None:
            if fut.exception() is None:
                f.read = fut.result()
            finish(fut.exception())

        def after_write(fut: Future | None) -> None:
            if fut is not None:
                if fut.exception() is not None:
                    return finish(fut.exception(), write_failed=True)
                f.write = fut.result()
            if read_tier is None:
                return finish()
            try:
                read_tier.read(f.sg, self.view(f.slot, f.sg)).add_done_callback(after_read)
            except BaseException as exc:
                finish(exc)

        if f.victim is None:
            return after_write(None)
        try:
            self.tiers[f.victim_tier].write(f.victim, self.view(f.slot, f.victim)).add_done_callback(after_write)
        except BaseException as exc:
            finish(exc, write_failed=True)

    def _settle(self, sg: int) -> BaseException | None:
        """Waits for `sg`'s fetch and records what it did; returns its error, if any."""
        f = self._fetches.pop(sg)
        f.done.result()
        if f.write is not None:
            self.location[f.victim] = f.victim_tier
            self.transfers.append(f.write)
            self.placement.observe(f.write)
        if f.write_failed:
            self.cache.admit(f.victim, f.slot, dirty=True)  # the host copy stays the only good one
            return f.error
        if f.error is not None:
            self.cache.give_back(f.slot)
            return f.error
        if f.read is not None:
            self.transfers.append(f.read)
            self.placement.observe(f.read)
        self.cache.admit(sg, f.slot, dirty=False)
        return None

    def _acquire(self, sg: int, load: bool, keep: set[int]) -> torch.Tensor:
        if self.cache.is_resident(sg):
            self.hits += 1
        else:
            if not self._start(sg, load, keep):
                raise RuntimeError(f"no host cache slot free for subgroup {sg}: the cache is below its minimum")
            error = self._settle(sg)
            if error is not None:
                raise error
        self.cache.touch(sg)
        return self.view(self.cache.slot_of[sg], sg)

    def drain(self) -> BaseException | None:
        """Settles every fetch in flight; returns the first error among them."""
        first = None
        for sg in list(self._fetches):
            err = self._settle(sg)
            first = first or err
        return first

    def flush(self) -> None:
        """Writes every dirty resident subgroup to its tier (the host copies stay resident, clean)."""
        futs = []
        for sg in sorted(self.cache.dirty):
            tier = self.placement.tier_for(sg)
            futs.append((sg, tier, self.tiers[tier].write(sg, self.view(self.cache.slot_of[sg], sg))))
        first = None
        for sg, tier, fut in futs:
            try:
                t = fut.result()
            except BaseException as exc:
                first = first or exc
                continue
            self.location[sg] = tier
            self.cache.dirty.discard(sg)
            self.transfers.append(t)
            self.placement.observe(t)
        if first is not None:
            raise first
