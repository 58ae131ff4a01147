"""The node's host memory (stated, or what is available: MemAvailable, or the job's memory cgroup's room
where that is less) and the host budget of `offload.host_budget_gb="auto"` from it: less stated headroom,
shared among the node's ranks."""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist

from .config import OffloadConfig
from .node import cgroup_dirs, node_ranks
from .units import readable_size


log = logging.getLogger(__name__)
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


def node_host_bytes(stated: int | None) -> int:
    """The host memory of the node's ranks: `stated` (train.host_memory_gb), else what is available now."""
    return available_host_bytes() if stated is None else stated


def stated_host_problem(stated: int | None) -> str | None:
    """What is wrong with a stated host memory of the node's ranks (train.host_memory_gb) here, or None:
    one above what the memory cgroup still lets the job take, where the kernel OOM-kills however much
    the machine grows (a machine whose memory grows as it is used reads less than it will hold)."""
    limited = None if stated is None else cgroup_available_bytes()
    if limited is None or stated <= limited:
        return None
    return (f"train.host_memory_gb={readable_size(stated)} is more than the {readable_size(limited)} that this job's memory "
            "cgroup still lets it take (its limit less its use: a Slurm job's --mem, a container's limit), past which the "
            "kernel ends the job; state at most that, or null")  # fmt: skip


def resolve_host_budget(
    cfg: OffloadConfig, group: dist.ProcessGroup | None, device: torch.device, stated: int | None = None
) -> tuple[int | None, str]:
    """This rank's host budget in bytes (None: no limit) and how to name it in messages. With "auto":
    (the node's host memory - host_headroom_gb) / the node's ranks (config.HostBudget), the smallest any
    rank saw; the node's host memory is `stated` (train.host_memory_gb), else what is available now."""
    budget = cfg.host_budget
    if not budget.auto:  # (whether the node's ranks can take it: the plan's fit check, or warn_over_memory)
        return budget.named(budget.nbytes)
    host, local_ranks = node_host_bytes(stated), node_ranks(group)
    mine = torch.tensor([budget.for_rank(host, local_ranks)], dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
    what = "available" if stated is None else "stated (train.host_memory_gb)"
    how = f": {readable_size(host)} {what} less host_headroom_gb={cfg.host_headroom_gb}, over {local_ranks} local rank(s)"
    return budget.named(int(mine.item()), how)


def warn_over_memory(cfg: OffloadConfig, most_bytes: int, local_ranks: int, says: bool) -> None:
    """Warns (where `says`: a node's first rank) where a stated budget lets the node's `local_ranks` take
    more host memory than is available: each takes its budget, or `most_bytes` (all its state off the GPU,
    and its staging), whichever is less. train.py's plan refuses such a run; a loop of one's own is warned here."""
    budget = cfg.host_budget
    if budget.auto or budget.nbytes is None:
        return
    available = available_host_bytes()
    take = min(budget.nbytes, most_bytes) * local_ranks
    if take > available and says:
        log.warning(
            "%s over %d local rank(s) lets them take %s, more than the %s of host memory this machine has available "
            "now (MemAvailable, or the memory cgroup's limit less its use): the run may swap or be OOM-killed once "
            "the cache fills. Lower it, or use offload.host_budget_gb=auto; where the machine's memory grows as it "
            "is used (MemTotal rising), this is expected", budget.option, local_ranks, readable_size(take), readable_size(available),
        )  # fmt: skip
