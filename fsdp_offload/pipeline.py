"""The fetch -> update -> flush pipeline: moves subgroups between the host cache and the tiers as a
pass over them (an update, a fill, a save) walks them.

While subgroup i is updated, the next `prefetch` subgroups that are not in host memory are being
fetched (the window looks past cached ones, so the tier works while they are updated); fetching one
into a slot whose occupant is dirty first writes the occupant to the tier the placement picks (a lazy
flush: nothing is written until its slot is needed). A subgroup's host copy is dropped only once its write is
known good, so an I/O error loses nothing. When the next subgroup is still on its way (its tier busy,
or held by another process of the node) while a later one of the window is ready, the later one goes
first. Every finished transfer is handed to the placement as it finishes, to learn bandwidths from.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .cache import HostCache
from .storage.base import Tier, TierError, Transfer
from .subgroups import SubgroupLayout

log = logging.getLogger(__name__)

class Placement(Protocol):
    def tier_for(self, sg: int) -> int: ...

    def observe(self, tier: int, transfer: Transfer) -> None:
        """Called from an I/O thread as each transfer on tiers[tier] finishes."""

    def drop(self, tier: int) -> None:
        """Never picks tiers[tier] again (it failed a write); ValueError when no other tier is left."""


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
    read_tier: int | None = None  # the tier it is read from
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
        self._evicting: dict[int, int] = {}  # subgroup being written out -> the fetch that evicts it
        self._position: dict[int, int] = {}  # subgroup -> its place in the current pass's order
        self._visited: set[int] = set()  # this pass
        self.transfers: list[Transfer] = []  # since the last take_transfers()
        self.hits = 0
        self._read_ahead: set[int] = set()  # fetched and settled before their visit: no cache hit
        self.failed_tiers: set[int] = set()  # dropped after a failed write; still read from

    def view(self, slot: int, sg: int) -> torch.Tensor:
        return self.cache.slots[slot][: self.layout.subgroups[sg].stored_bytes]

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
        in_order: bool = False,
    ) -> None:
        """Calls `visit(sg, state)` on each subgroup of `order` with its state resident.

        Subgroups go in order, except that a ready one of the prefetch window goes before one still on
        its way (subgroups are independent: the order of visits changes no result). `order` is
        rearranged in place into the order of the visits, so that after an error `order[k:]` are the
        subgroups not visited, k being how many were.
        `load=False` skips reading stored copies (the visit overwrites the whole state);
        `dirty=False` says the visit only reads the state; `in_order=True` keeps the visits in `order` (a
        fill whose source is read in order).
        """
        self._position = {sg: k for k, sg in enumerate(order)}
        self._visited = set()
        try:
            for i in range(len(order)):
                window = order[i : self._window_end(order, i)]
                keep = set(window)
                for nxt in window:
                    self._start(nxt, load, keep)
                ready = 0 if in_order else self._first_ready(window)
                if ready:
                    order.insert(i, order.pop(i + ready))
                sg = order[i]
                state = self._acquire(sg, load, keep)
                if dirty:  # before the visit: one that raises part-way may have changed the state
                    self.cache.mark_dirty(sg)
                    self._discard_stored(sg)
                visit(sg, state)
                self._visited.add(sg)
        except BaseException:
            self.drain()
            raise

    def _window_end(self, order: list[int], i: int) -> int:
        """End of the window that starts at order[i]: it runs on past subgroups already in host memory
        until it holds `prefetch` that are not, so that reads start while the cached ones are updated
        (with most subgroups cached, a window of the next few alone would leave the tier idle until
        the update reached the first subgroup to read)."""
        wanted, j = self.prefetch, i + 1
        while j < len(order) and wanted:
            wanted -= not self.cache.is_resident(order[j])
            j += 1
        return j

    def _discard_stored(self, sg: int) -> None:
        """Frees the tier space of `sg`'s stored copy, stale now that its host copy is dirty: a tier
        then holds only what is not in host memory (plus the prefetch window), not every subgroup
        that ever left the cache."""
        tier = self.location.pop(sg, None)
        if tier is not None:
            self.tiers[tier].discard(sg)

    def _first_ready(self, window: list[int]) -> int:
        """Index in `window` of the first subgroup that is resident or whose fetch has finished,
        waiting for one if need be; 0 when nothing in the window is under way."""
        while True:
            pending = []
            for j, sg in enumerate(window):
                f = self._fetches.get(sg)
                if f is None:
                    if self.cache.is_resident(sg):
                        return j
                elif f.done.done():
                    return j
                else:
                    pending.append(f.done)
            if not pending:
                return 0
            wait(pending, return_when=FIRST_COMPLETED)

    def _start(self, sg: int, load: bool, keep: set[int]) -> bool:
        """Begins bringing `sg` into a slot; False when every slot is spoken for right now."""
        if self.cache.is_resident(sg) or sg in self._fetches:
            return True
        if sg in self._evicting:
            # Its newest copy is still being written out: let that write land (or fail and put it back).
            error = self._settle(self._evicting[sg])
            if error is not None:
                raise error
            if self.cache.is_resident(sg):
                return True
        if load and sg not in self.location:
            raise RuntimeError(f"subgroup {sg} is neither in host memory nor stored on any tier")
        slot, victim, victim_tier = self.cache.take_free(), None, None
        if slot is None:
            chosen = self._victim(keep)
            if chosen is None:
                return False
            if chosen in self.cache.dirty:  # written out first; a clean one's stored copy is current
                # its tier is chosen before it leaves residency, so a failing choice loses nothing
                victim, victim_tier = chosen, self.placement.tier_for(chosen)
            slot = self.cache.remove(chosen)
        fetch = _Fetch(sg, slot, victim, victim_tier)
        self._fetches[sg] = fetch
        if victim is not None:
            self._evicting[victim] = sg
        self._chain(fetch, self.location[sg] if load else None)
        return True

    def _victim(self, keep: set[int]) -> int | None:
        """The resident subgroup to evict: the least recently used of those this pass has not visited,
        else the visited one earliest in the pass's order. Visits that went out of order thus evict as
        strict order would have: a subgroup that was overtaken must not outlive its overtaker, or the
        next step (in the reverse order) would find the wrong subgroups cached."""
        victim = self.cache.victim(keep | self._visited)
        if victim is not None:
            return victim
        done = [sg for sg in self._visited if sg not in keep and self.cache.is_resident(sg)]
        return min(done, key=self._position.__getitem__, default=None)

    def _learn(self, tier: int, t: Transfer) -> None:
        """Hands a finished transfer to the placement. This runs inside a fetch's chain of callbacks on
        an I/O thread, where an exception would leave the fetch unresolved forever: it is logged."""
        try:
            self.placement.observe(tier, t)
        except Exception:
            log.exception("placement failed to learn from %s", t)

    def _read_error(self, sg: int, tier: int | None, error: BaseException) -> BaseException:
        """A failed read as an error that names the subgroup, the tier and its file (a checksum error
        already names them)."""
        if tier is None or not isinstance(error, OSError):
            return error
        t = self.tiers[tier]
        wrapped = TierError(
            f"subgroup {sg}: reading it from {t.name} ({t.path}) failed: {error}. Its newest copy is there and "
            "nowhere else: retry step() once the tier reads again, or resume from the last good checkpoint"
        )
        wrapped.__cause__ = error
        return wrapped

    def _chain(self, f: _Fetch, read_tier: int | None) -> None:
        """Write the victim (if any), then read `f.sg` (if asked), then resolve `f.done`."""
        f.read_tier = read_tier

        def finish(error: BaseException | None = None, write_failed: bool = False) -> None:
            f.error, f.write_failed = error, write_failed
            f.done.set_result(None)

        def after_read(fut: Future) -> None:
            if fut.exception() is None:
                f.read = fut.result()
                self._learn(read_tier, f.read)
            finish(fut.exception())

        def after_write(fut: Future | None) -> None:
            if fut is not None:
                if fut.exception() is not None:
                    return finish(fut.exception(), write_failed=True)
                f.write = fut.result()
                self._learn(f.victim_tier, f.write)
            if read_tier is None:
                return finish()
            try:
                self.tiers[read_tier].read(f.sg, self.view(f.slot, f.sg)).add_done_callback(after_read)
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
        if f.write_failed and self._fail_over(f):
            return self._settle(sg)
        if f.victim is not None:
            del self._evicting[f.victim]
        if f.write is not None:
            self.location[f.victim] = f.victim_tier
            self.transfers.append(f.write)
        if f.write_failed:
            self.cache.admit(f.victim, f.slot, dirty=True)  # the host copy stays the only good one
            return f.error
        if f.error is not None:
            self.cache.give_back(f.slot)
            return self._read_error(sg, f.read_tier, f.error)
        if f.read is not None:
            self.transfers.append(f.read)
        self.cache.admit(sg, f.slot, dirty=False)
        self._read_ahead.add(sg)
        return None

    def _fail_over(self, f: _Fetch) -> bool:
        """After a failed write of `f.victim`: with another tier left, drops the failed one from the
        placement (saying so once) and starts the fetch again, the victim going where the placement
        now says. False when there is nowhere else: the error stands and the victim stays in host memory.
        Subgroups already stored on the dropped tier are still read from it; if it cannot read either,
        that read names it, and the last good checkpoint is the recovery point."""
        tier = f.victim_tier
        if not isinstance(f.error, OSError):
            return False
        if tier not in self.failed_tiers:
            if len(self.failed_tiers) + 1 >= len(self.tiers):
                return False
            try:
                self.placement.drop(tier)
            except ValueError:  # no other tier takes a share (fixed ratios with zeros)
                return False
            self.failed_tiers.add(tier)
            t = self.tiers[tier]
            log.warning(
                "%s (%s) failed writing subgroup %d: %s. It is dropped: subgroups leaving host memory go to the other "
                "tiers from now on (subgroups stored there are still read from it)", t.name, t.path, f.victim, f.error,
            )  # fmt: skip
        retry = _Fetch(f.sg, f.slot, f.victim, self.placement.tier_for(f.victim))
        if retry.victim_tier in self.failed_tiers:
            return False
        self._fetches[f.sg] = retry
        self._chain(retry, f.read_tier)
        return True

    def _keep_but_furthest(self, sg: int, keep: set[int]) -> set[int]:
        """`keep` less the resident subgroup the pass visits last after `sg`: where the window holds every
        resident subgroup (all but the few not in host memory, which come first), the one needed now
        takes the slot of the one needed latest."""
        later = [s for s in keep if s != sg and self.cache.is_resident(s)]
        if not later:
            return keep
        return keep - {max(later, key=lambda s: self._position.get(s, -1))}

    def _acquire(self, sg: int, load: bool, keep: set[int]) -> torch.Tensor:
        if self.cache.is_resident(sg):
            self.hits += sg not in self._read_ahead  # else its fetch was settled early, by another's
        else:
            if not self._start(sg, load, keep) and not self._start(sg, load, self._keep_but_furthest(sg, keep)):
                raise RuntimeError(f"no host cache slot free for subgroup {sg}: the cache is below its minimum")
            error = self._settle(sg)
            if error is not None:
                raise error
        self._read_ahead.discard(sg)
        self.cache.touch(sg)
        return self.view(self.cache.slot_of[sg], sg)

    # -- one subgroup at a time, between passes (checkpoints) -----------------------------------

    def resident_state(self, sg: int) -> torch.Tensor | None:
        """`sg`'s state in its cache slot, or None when it is only stored."""
        slot = self.cache.slot_of.get(sg)
        return None if slot is None else self.view(slot, sg)

    def read_stored(self, sg: int, out: torch.Tensor) -> None:
        """Reads `sg`'s stored copy into `out` (an aligned host buffer), leaving the cache as it is."""
        self._check_idle()
        tier = self.location[sg]
        try:
            self.tiers[tier].read(sg, out).result()
        except OSError as exc:
            raise self._read_error(sg, tier, exc) from exc

    def store(self, sg: int, state: torch.Tensor) -> None:
        """Writes `state` (an aligned host buffer) as `sg`'s stored copy, on the tier its placement picks
        (a resident subgroup is overwritten in its slot instead: see resident_state)."""
        self._check_idle()
        if self.cache.is_resident(sg):
            raise RuntimeError(f"subgroup {sg} is in host memory: its stored copy is not the one to replace")
        tier = self.placement.tier_for(sg)
        self.tiers[tier].write(sg, state).result()
        self.location[sg] = tier

    def forget(self, sg: int) -> None:
        """Drops `sg` from the host cache and the tiers (it moved to GPU memory): its slot is free again."""
        self._check_idle()
        if self.cache.is_resident(sg):
            self.cache.give_back(self.cache.remove(sg))
        self.location.pop(sg, None)

    def _check_idle(self) -> None:
        if self._fetches:
            raise RuntimeError(f"subgroups {sorted(self._fetches)} are still being fetched: finish the pass first")

    def drain(self) -> BaseException | None:
        """Settles every fetch in flight; returns the first error among them."""
        first = None
        for sg in list(self._fetches):
            err = self._settle(sg)
            first = first or err
        return first
