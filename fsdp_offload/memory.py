"""The host budget of `offload.host_budget_gb="auto"`: the node's available memory, less stated
headroom, shared among the node's ranks."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from .config import GIB, OffloadConfig


def available_host_bytes() -> int:
    """Memory the kernel says can be taken without swapping (/proc/meminfo MemAvailable: free memory
    plus reclaimable page cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def node_ranks(group: dist.ProcessGroup | None) -> int:
    """Ranks of `group` on this node (by host name): launchers other than torchrun (srun, mp.spawn)
    set no LOCAL_WORLD_SIZE. Without a group: $LOCAL_WORLD_SIZE, else 1."""
    if group is None:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return hosts.count(socket.gethostname())


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
