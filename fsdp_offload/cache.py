"""Host memory: page-aligned (and, for staging, pinned) buffers under a byte budget, how many cache
slots the budget allows (`host_cache_slots`), and which subgroup is where.

`HostCache` owns the slot buffers that hold subgroups' FP32 state and tracks residency: which
subgroup is in which slot, whether its host copy is newer than its stored one (dirty), and the order
in which slots were last used (evict the least recently used first).
"""

from __future__ import annotations

import ctypes
import os
from collections import OrderedDict

import torch

from .units import format_bytes, in_unit
from .storage.base import ALIGN


def aligned_host_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` that starts on a page and owns every page it touches (O_DIRECT
    needs the alignment; registering pages with CUDA needs them not shared with another buffer)."""
    pages = -(-nbytes // ALIGN) * ALIGN
    raw = torch.empty(pages + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A 4 KiB-aligned uint8 host tensor of exactly `nbytes`, page-locked when `pin`.

    Pinning registers the buffer's own pages with CUDA: the caching host allocator would round the
    size up to a power of two and break the budget.
    """
    buf = aligned_host_buffer(nbytes)
    if pin and nbytes:
        pages = -(-nbytes // ALIGN) * ALIGN
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), pages, 0))
        if err != 0:
            torch.cuda.cudart().cudaGetLastError()  # clear it, so no later CUDA call reports it
            raise RuntimeError(
                f"cudaHostRegister of {format_bytes(pages)} failed (CUDA error {err}): lower "
                "offload.host_budget_gb or raise the locked-memory limit (ulimit -l)"
            )
    return buf


def host_cache_slots(
    budget: int | None, budget_name: str, unit: str, streamed: int, slot_bytes: int, reserved_bytes: int, prefetch: int,
    tiers: int,
) -> int:  # fmt: skip
    """Host cache slots for `streamed` subgroups that `budget` (named `budget_name` in errors, which
    answer in `unit`) allows after `reserved_bytes` (the grad staging and buffers), or a clear error
    when it is too small: short of all of them with no tier (nothing can leave host memory), or below
    what the pipeline holds at once (`prefetch` + 1 subgroups, or all where there are fewer)."""
    if budget is None:
        return streamed
    # an "auto" budget is what the machine has left: raised by a smaller headroom, or stated outright
    raise_it = ("raise the budget (lower offload.host_headroom_gb, or state offload.host_budget_gb)"
                if budget_name.startswith("offload.host_budget_gb=auto") else "raise the budget")  # fmt: skip
    slots = min(streamed, max(0, (budget - reserved_bytes) // slot_bytes))
    if slots == streamed:
        return streamed
    if not tiers:
        raise ValueError(
            f"{budget_name} holds {slots} of {streamed} subgroups and no tier "
            f"is given: add a tier (offload.tiers=['posix:/path']) or {raise_it} to "
            f"{in_unit(reserved_bytes + streamed * slot_bytes, unit)} "
            f"({reserved_bytes + streamed * slot_bytes} bytes)"
        )
    minimum = min(prefetch + 1, streamed)
    if slots < minimum:
        if minimum == prefetch + 1:
            held, fix = f"for prefetch={prefetch}", "lower offload.subgroup_numel or offload.prefetch"
        else:  # fewer subgroups than the pipeline holds at once: smaller ones would not all be held
            held = f"(all {streamed} streamed, fewer than prefetch + 1 = {prefetch + 1})"
            fix = "lower offload.subgroup_numel (more, smaller subgroups, of which the pipeline holds prefetch + 1)"
            if streamed > 1:
                fix += f", or offload.prefetch below {streamed - 1}"
        raise ValueError(
            f"{budget_name} is below the pipeline's minimum of "
            f"{in_unit(reserved_bytes + minimum * slot_bytes, unit)} "
            f"({reserved_bytes + minimum * slot_bytes} bytes): {format_bytes(reserved_bytes)} of grad "
            f"staging and buffers + {minimum} slots of {format_bytes(slot_bytes)} {held}; {raise_it}, or {fix}"
        )
    return slots


def resolve_split_masters(mode: bool | str, param_dtype: str, whole_slots: int | None, streamed: int, saves: bool) -> bool:
    """`offload.split_masters` made concrete: bf16 masters are split where it says so, or for "auto" where
    the host cache holds fewer than all `streamed` subgroups whole (`whole_slots`; None: the budget is
    short of the pipeline's minimum whole) and a split subgroup is smaller (`saves`: not at 1024 params,
    whose low halves take a 4 KiB page). Split, a subgroup takes 10 bytes a param, not 12; whole, its
    update is the cheaper kernel, so a cache that holds every subgroup either way keeps them whole."""
    if param_dtype != "bfloat16":
        return False  # (split_masters=true with other params is refused by the config)
    if mode != "auto":
        return bool(mode)
    return saves and (whole_slots is None or whole_slots < streamed)


_MADV_DONTNEED = 4  # Linux: the pages go back to the OS; touched again, they read as zeros


def release_pages(buf: torch.Tensor) -> int:
    """Hands the whole pages inside `buf` (a CPU tensor, not page-locked) back to the OS: resident
    memory drops by their size, and they read as zeros if touched again. Pages the buffer shares
    with its neighbours are kept (the OS page may be larger than the 4 KiB slots are aligned to).
    Returns the bytes released."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo = -(-buf.data_ptr() // page) * page
    hi = (buf.data_ptr() + buf.numel() * buf.element_size()) // page * page
    if hi <= lo:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED):
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) of {format_bytes(hi - lo)} of host cache failed: {os.strerror(err)}")
    return hi - lo


def unpin(buf: torch.Tensor) -> None:
    """Unregisters `buf` (from host_buffer(pin=True)) before its memory is freed, on the device it was
    registered on (the caller's current device)."""
    err = int(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))
    if err != 0:  # its pages stay registered: freed and reused, CUDA could still read them as locked
        torch.cuda.cudart().cudaGetLastError()  # clear it, so no later CUDA call reports it
        raise RuntimeError(f"cudaHostUnregister of {format_bytes(buf.numel() * buf.element_size())} of page-locked "
                           f"host memory failed (CUDA error {err})")  # fmt: skip


class HostCache:
    """`num_slots` buffers of `slot_bytes` each, and the residency of subgroups in them. Its memory is
    not page-locked: the FP32 state never meets the GPU (the bf16 staging buffer does), and pages given
    back to the OS (release_spare) must not be."""

    def __init__(self, slot_bytes: int, num_slots: int) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._arena = aligned_host_buffer(slot_bytes * num_slots)
        self.slots = [self._arena[i * slot_bytes : (i + 1) * slot_bytes] for i in range(num_slots)]
        self._free = list(range(num_slots - 1, -1, -1))
        self.slot_of: dict[int, int] = {}  # resident subgroup -> slot
        self.dirty: set[int] = set()
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident subgroups, least recent first

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def is_resident(self, sg: int) -> bool:
        return sg in self.slot_of

    def touch(self, sg: int) -> None:
        self._lru.move_to_end(sg)

    def take_free(self) -> int | None:
        return self._free.pop() if self._free else None

    def victim(self, keep: set[int]) -> int | None:
        """The least recently used resident subgroup not in `keep`, or None."""
        for sg in self._lru:
            if sg not in keep:
                return sg
        return None

    def admit(self, sg: int, slot: int, dirty: bool) -> None:
        self.slot_of[sg] = slot
        self._lru[sg] = None
        self._lru.move_to_end(sg)
        if dirty:
            self.dirty.add(sg)

    def mark_dirty(self, sg: int) -> None:
        """`sg`'s host copy is newer than its stored one: it must be written before its slot is reused."""
        self.dirty.add(sg)

    def remove(self, sg: int) -> int:
        """Takes `sg` out of residency and returns its slot (the caller decides what the slot holds)."""
        self._lru.pop(sg)
        self.dirty.discard(sg)
        return self.slot_of.pop(sg)

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def release_spare(self, needed: int) -> int:
        """Keeps `needed` slots and gives the memory of the free ones beyond them back to the OS, for
        good (subgroups moved to GPU memory leave fewer to cache than there are slots); returns the
        bytes given back. A slot whose release fails stays in use, and the error is raised."""
        released = 0
        while self._free and self.num_slots > needed:
            released += release_pages(self.slots[self._free[0]])
            self._free.pop(0)  # (the free list hands out from its end)
            self.num_slots -= 1
        return released

    def close(self) -> None:
        self._arena = None
        self.slots = []
