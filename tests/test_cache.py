"""HostCache: slots under the budget, and giving back the ones no subgroup needs any more; and the host
resources it is sized from: the memory a cgroup leaves (host_budget_gb=auto) and each rank's CPU cores."""

from __future__ import annotations

import os

import pytest

from fsdp_offload import memory, node, threads
from fsdp_offload.cache import HostCache, aligned_host_buffer, host_cache_slots, release_pages

MIB = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_spare_slots_go_back_to_the_os_for_good():
    """After subgroups moved to GPU memory, the free slots beyond what the rest needs are handed back:
    resident memory drops by their size and they are never handed out again."""
    cache = HostCache(64 * MIB, 4)
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
    cache = HostCache(MIB, 3)
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


def fake_cgroups(tmp_path, monkeypatch, version: int, files: dict[str, str]) -> None:
    """This process in cgroup /job/step (v1: of the memory and cpuset hierarchies), whose dirs hold
    `files` ({"job/memory.max": "...", ...}, relative to the hierarchy's root)."""
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n" if version == 2 else "5:memory:/job/step\n3:cpuset:/job/step\n0::/\n")
    root = tmp_path / "sys"
    for name, text in files.items():
        for hierarchy in [root] if version == 2 else [root / "memory", root / "cpuset"]:
            (hierarchy / name).parent.mkdir(parents=True, exist_ok=True)
            (hierarchy / name).write_text(text)
    monkeypatch.setattr(node, "PROC_CGROUP", str(proc))
    monkeypatch.setattr(node, "CGROUP_ROOT", str(root))


GIB = 1 << 30


@pytest.mark.parametrize("version", [1, 2])
def test_auto_budget_takes_the_cgroup_limit_where_it_is_less(tmp_path, monkeypatch, version):
    """A Slurm job's --mem or a container's limit is what the job can take, however much the node has
    free: the least limit less usage over the process's cgroup and its ancestors, page cache that the
    kernel reclaims first not counted as used."""
    limit, usage, stat = ("memory.max", "memory.current", "inactive_file") if version == 2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")  # fmt: skip
    no_limit = "max" if version == 2 else str(2**63 - 4096)
    fake_cgroups(tmp_path, monkeypatch, version, {
        f"job/{limit}": str(8 * GIB), f"job/{usage}": str(5 * GIB), "job/memory.stat": f"anon 1\n{stat} {1 * GIB}\n",
        f"job/step/{limit}": no_limit, f"job/step/{usage}": str(5 * GIB),
    })  # fmt: skip
    assert memory.cgroup_available_bytes() == 4 * GIB
    assert memory.available_host_bytes() <= 4 * GIB


def test_no_cgroup_limit_leaves_the_node_s_available_memory(tmp_path, monkeypatch):
    fake_cgroups(tmp_path, monkeypatch, 2, {"job/step/memory.max": "max", "job/step/memory.current": str(GIB)})
    assert memory.cgroup_available_bytes() is None
    monkeypatch.setattr(node, "PROC_CGROUP", str(tmp_path / "none"))  # no cgroups at all
    assert memory.cgroup_available_bytes() is None
    assert memory.available_host_bytes() > 0


def test_cores_are_divided_among_the_node_s_ranks_counted_by_node_ranks(monkeypatch):
    """The node's rank count is node.node_ranks(): srun and mp.spawn set no LOCAL_WORLD_SIZE."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(node, "_job_node_ranks", 2)  # as node_ranks(group) counted them
    assert threads.cpu_threads_per_rank(None) == max(1, threads.physical_cores() // 2)
    assert threads.cpu_threads_per_rank(3) == 3


@pytest.mark.parametrize("version", [1, 2])
def test_the_cores_are_no_more_than_the_cgroups_cpu_quota(tmp_path, monkeypatch, version):
    """A container's or a Slurm job's CPU quota (not its affinity) bounds the threads: the least over the
    process's cgroup and its ancestors, rounded up to whole CPUs; no quota leaves the cores."""
    if version == 2:
        files = {"job/cpu.max": "50000 100000\n", "job/step/cpu.max": "max 100000\n"}
    else:  # under v1 the cpu hierarchy: the root's -1 is no quota
        files = {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n",
                 "job/cpu.cfs_quota_us": "150000\n", "job/cpu.cfs_period_us": "100000\n"}  # fmt: skip
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n" if version == 2 else "4:cpu,cpuacct:/job/step\n0::/\n")
    root = tmp_path / "sys"
    for name, text in files.items():
        path = (root if version == 2 else root / "cpu") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "cpu" / "job" / "step" if version == 1 else root / "job" / "step").mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(node, "PROC_CGROUP", str(proc))
    monkeypatch.setattr(node, "CGROUP_ROOT", str(root))
    assert threads.cpu_quota() == (0.5 if version == 2 else 1.5)
    assert threads.physical_cores() == 1 if version == 2 else threads.physical_cores() <= 2  # half a CPU's time: one thread
    monkeypatch.setattr(node, "PROC_CGROUP", str(tmp_path / "none"))
    assert threads.cpu_quota() is None and threads.physical_cores() >= 1


def test_a_host_budget_above_the_available_memory_is_said_naming_both(monkeypatch, caplog):
    """A stated budget the node's ranks could fill beyond what the machine holds now is warned of in a loop
    of one's own (not refused: on a machine whose memory grows as it is used, it can be right), naming
    the option and both sizes. Each rank takes its budget or all its state, whichever is less: a budget
    above the machine over a small state is not warned of. (train.py's plan refuses what does not fit.)"""
    import logging

    from fsdp_offload import OffloadConfig

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 3 * GIB)
    with caplog.at_level(logging.WARNING, logger="fsdp_offload.memory"):
        memory.warn_over_memory(OffloadConfig(host_budget_gb=2), 100 * GIB, 1, True)
        memory.warn_over_memory(OffloadConfig(host_budget_gb=4), 1 * GIB, 1, True)  # a small state: it takes 1 GiB
        assert not caplog.records
        memory.warn_over_memory(OffloadConfig(host_budget_gb=4), 100 * GIB, 1, True)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "offload.host_budget_gb=4" in said and "4.00 GiB" in said and "3.00 GiB" in said and "auto" in said


def test_a_budget_short_of_a_few_subgroups_names_the_minimum_they_need():
    """One subgroup streamed (a small model over several ranks): the minimum is its one slot, not
    prefetch + 1 of them; with no tier the budget must hold them all, and the error says to add one."""
    slot, reserved = 100 * MIB, 10 * MIB
    args = dict(budget_name="offload.host_budget_gb=0.1", unit="GiB", slot_bytes=slot, reserved_bytes=reserved, prefetch=2)
    assert host_cache_slots(reserved + slot, streamed=1, tiers=1, **args) == 1
    with pytest.raises(ValueError, match=rf"minimum of [0-9.]+ GiB \({reserved + slot} bytes\).* 1 slots .*all 1 streamed"):
        host_cache_slots(reserved + slot - 1, streamed=1, tiers=1, **args)
    with pytest.raises(ValueError, match=rf"\({reserved + 2 * slot} bytes\).* 2 slots .*all 2 streamed.*or offload.prefetch below 1$"):
        host_cache_slots(reserved + slot, streamed=2, tiers=1, **args)
    with pytest.raises(ValueError, match=rf"minimum of [0-9.]+ GiB \({reserved + 3 * slot} bytes\).* 3 slots .*prefetch=2"):
        host_cache_slots(reserved + 2 * slot, streamed=5, tiers=1, **args)
    with pytest.raises(ValueError, match=r"holds 0 of 5 subgroups and no tier is given: add a tier"):  # not "lower prefetch"
        host_cache_slots(reserved, streamed=5, tiers=0, **args)


def test_a_short_auto_budget_is_raised_by_a_smaller_headroom_or_a_stated_budget():
    args = dict(unit="GiB", slot_bytes=100 * MIB, reserved_bytes=10 * MIB, prefetch=2, streamed=5)
    auto = "offload.host_budget_gb=auto (100.00 MiB per rank: 8.00 GiB available less host_headroom_gb=7.9, over 1 local rank(s))"
    with pytest.raises(ValueError, match=r"raise the budget \(lower offload.host_headroom_gb, or state offload.host_budget_gb\), or lower"):
        host_cache_slots(100 * MIB, budget_name=auto, tiers=1, **args)
    with pytest.raises(ValueError, match=r"; raise the budget, or lower"):  # a stated budget is raised as it is
        host_cache_slots(100 * MIB, budget_name="offload.host_budget_gb=0.1", tiers=1, **args)
