"""HostCache: slots under the budget, and giving back the ones no subgroup needs any more."""

from __future__ import annotations

import os

from fsdp_offload.cache import HostCache, aligned_host_buffer, release_pages

MIB = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_spare_slots_go_back_to_the_os_for_good():
    """After subgroups moved to GPU memory, the free slots beyond what the rest needs are handed back:
    resident memory drops by their size and they are never handed out again."""
    cache = HostCache(64 * MIB, 4, pin=False)
    for slot in cache.slots:
        slot.fill_(1)  # every page resident
    for sg in range(2):
        cache.admit(sg, cache.take_free(), dirty=True)
    before = resident_bytes()
    assert cache.release_spare(needed=2) == 2 * 64 * MIB
    assert before - resident_bytes() >= 120 * MIB
    assert cache.num_slots == 2 and cache.take_free() is None
    assert cache.release_spare(needed=2) == 0  # nothing spare is left
    assert all(bool((cache.slots[cache.slot_of[sg]] == 1).all()) for sg in range(2))  # the resident ones kept their bytes
    cache.close()


def test_no_slot_goes_back_while_the_subgroups_left_need_it():
    cache = HostCache(MIB, 3, pin=False)
    assert cache.release_spare(needed=5) == 0 and cache.num_slots == 3
    assert cache.release_spare(needed=3) == 0
    cache.close()


def test_only_whole_pages_go_back():
    """A buffer that does not start or end on a page gives back only the pages wholly inside it: the
    bytes beside it (another slot's, on a system whose pages are larger than the slots' alignment)
    keep their values."""
    page = os.sysconf("SC_PAGE_SIZE")
    raw = aligned_host_buffer(4 * page)
    raw.fill_(7)
    assert release_pages(raw[page // 2 : 3 * page + page // 2]) == 2 * page
    assert bool((raw[: page] == 7).all()) and bool((raw[3 * page :] == 7).all())
    assert bool((raw[page : 3 * page] == 0).all())
    assert release_pages(raw[10 : page - 10]) == 0
