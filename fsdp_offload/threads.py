"""How many threads each rank's CPU update gets: the node's physical cores divided among its ranks.

torchrun sets OMP_NUM_THREADS=1 when it starts several ranks per node, which would leave each rank's
CPU update on one core; the recipes and benchmarks give each rank its share of the cores instead.
"""

from __future__ import annotations

import math
import os

import torch

from .node import cgroup_dirs, node_ranks


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings count once), and no more than its
    cgroups' CPU quota grants (a container's `cpus: 8` on a 128-core host, a Slurm job's): OpenMP
    threads on sibling hyperthreads, or beyond the quota, slow the CPU update down rather than up."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    quota = cpu_quota()
    return max(1, min(len(cores), math.ceil(quota) if quota is not None else len(cores)))


def cpu_quota() -> float | None:
    """The CPUs' worth of time this process's cgroups grant it a period, the least over its cgroup and
    its ancestors (cgroup v2 cpu.max, v1 cpu.cfs_quota_us over cpu.cfs_period_us); None: no quota."""
    least = None
    for d in cgroup_dirs("cpu"):
        try:
            with open(os.path.join(d, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
        except (OSError, ValueError):
            try:
                with open(os.path.join(d, "cpu.cfs_quota_us")) as f, open(os.path.join(d, "cpu.cfs_period_us")) as g:
                    quota, period = f.read().strip(), g.read().strip()
            except OSError:
                continue
        if not quota.isdigit() or not period.isdigit() or int(period) <= 0:
            continue  # no quota here ("max", v1's -1), or a file we cannot read as one
        cpus = int(quota) / int(period)
        least = cpus if least is None else min(least, cpus)
    return least


def cpu_threads_per_rank(threads: int | None, local_ranks: int | None = None) -> int:
    """`threads` (train.cpu_threads) if given, else the physical cores this process may run on divided
    among the node's ranks (`local_ranks`, by default node.node_ranks()). Under a per-rank CPU binding
    (srun --cpu-bind) that undersubscribes: give train.cpu_threads. Its affinity alone cannot tell a
    rank's own binding from one that all the node's ranks share (taskset around torchrun), where not
    dividing would oversubscribe the cores."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"train.cpu_threads={threads} must be >= 1 (null: the physical cores per local rank)")
        return threads
    return max(1, physical_cores() // (node_ranks() if local_ranks is None else local_ranks))


def use_cpu_threads(threads: int) -> None:
    """Sets this thread's intra-op threads, only when that changes the count: torch.set_num_threads
    also turns MKL's dynamic threading off, and then the fused kernel's MKL sqrt, called inside its
    OpenMP loop, oversubscribes the cores (the CPU update ran 2x slower on nvidia-h100-x1 at the same
    16 threads)."""
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
