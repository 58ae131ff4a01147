"""The host budget of `offload.host_budget_gb="auto"`: the node's available memory (or the job's
cgroup's, where that is less), less stated headroom, shared among the node's ranks; and the count of
the node's ranks."""

from __future__ import annotations

import contextlib
import os
import socket

import torch
import torch.distributed as dist

from .config import GIB, OffloadConfig


# This process's cgroups and where their hierarchies are mounted (tests point them at fake ones).
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number (2**63 less a page)


def available_host_bytes() -> int:
    """Memory this process can take without swapping or being OOM-killed: the kernel's MemAvailable
    (free memory plus reclaimable page cache), or less where a cgroup limits it (cgroup_available_bytes)."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limited = cgroup_available_bytes()
    return available if limited is None else min(available, limited)


def cgroup_dirs(v1_controller: str) -> list[str]:
    """This process's cgroup dirs, its own first, then its ancestors up to the hierarchy's root: of
    `v1_controller`'s hierarchy under cgroup v1, of the unified one under v2 (from PROC_CGROUP)."""
    try:
        with open(PROC_CGROUP) as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return []
    for _, controllers, path in entries:
        if v1_controller in controllers.split(","):
            root = os.path.join(CGROUP_ROOT, v1_controller)
            break
    else:
        path = next((path for hid, controllers, path in entries if hid == "0" and not controllers), None)
        if path is None:
            return []
        root = CGROUP_ROOT
    parts = [p for p in path.split("/") if p]
    dirs = [os.path.join(root, *parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if os.path.isdir(d)]  # a container shows only its own part of the path


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


# (limit, usage, the usage's inactive page cache in memory.stat): cgroup v2, v1
_MEMORY_FILES = [
    ("memory.max", "memory.current", "inactive_file"),
    ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
]


def cgroup_available_bytes() -> int | None:
    """What this process's memory cgroups (a Slurm job's --mem, a container's limit) still let it take:
    the least, over its cgroup and its ancestors, of the limit less the usage, the usage without the
    inactive page cache that the kernel reclaims before it OOM-kills. None where none sets a limit."""
    least = None
    for d in cgroup_dirs("memory"):
        for limit_file, usage_file, cache_key in _MEMORY_FILES:
            limit, usage = _read_int(os.path.join(d, limit_file)), _read_int(os.path.join(d, usage_file))
            if limit is None or usage is None or limit >= _NO_LIMIT:
                continue
            left = limit - max(0, usage - _memory_stat(d, cache_key))
            least = left if least is None else min(least, left)
    return None if least is None else max(0, least)


def _memory_stat(cgroup: str, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(cgroup, "memory.stat")) as f:
            for line in f:
                name, value = line.split()
                if name == key:
                    return int(value)
    return 0


_job_node_ranks: int | None = None  # the job's ranks on this node, once node_ranks has counted them


def node_ranks(group: dist.ProcessGroup | None = None) -> int:
    """The ranks on this node. With `group` (a collective: every rank of it calls), those of `group`, by
    host name: launchers other than torchrun (srun, mp.spawn) set no LOCAL_WORLD_SIZE. Without one (before
    init_process_group, or where one rank alone asks: a tier's file, a calibration): the job's count if a
    call with a group spanning the job has counted it, else $LOCAL_WORLD_SIZE, else 1."""
    global _job_node_ranks
    if group is None:
        return _job_node_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    count = hosts.count(socket.gethostname())
    if dist.get_world_size(group) == dist.get_world_size():
        _job_node_ranks = count
    return count


def auto_host_budget(available: int, headroom_gb: float, local_ranks: int) -> int:
    """host_budget_gb="auto" for one rank: `available` bytes less the headroom, shared by the node's ranks."""
    return int((available - headroom_gb * GIB) / local_ranks)


def resolve_host_budget(
    cfg: OffloadConfig, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[int | None, str]:
    """This rank's host budget in bytes (None: no limit) and how to name it in messages. With "auto":
    (available - host_headroom_gb) / the node's ranks, the smallest any rank saw."""
    if cfg.host_budget_gb != "auto":
        return cfg.host_budget_bytes, f"offload.host_budget_gb={cfg.host_budget_gb}"
    available = available_host_bytes()
    local_ranks = node_ranks(group)
    mine = torch.tensor([auto_host_budget(available, cfg.host_headroom_gb, local_ranks)], dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
    budget = int(mine.item())
    what = (
        f"offload.host_budget_gb=auto ({budget / GIB:.2f} GiB per rank: {available / GIB:.2f} GiB available less "
        f"host_headroom_gb={cfg.host_headroom_gb}, over {local_ranks} local rank(s))"
    )
    if budget <= 0:
        raise ValueError(
            f"{what}: no host memory is left for the optimizer; lower offload.host_headroom_gb or give "
            "offload.host_budget_gb in GiB"
        )
    return budget, what
