"""How many threads each rank's CPU update gets: the node's physical cores divided among its ranks.

torchrun sets OMP_NUM_THREADS=1 when it starts several ranks per node, which would leave each rank's
CPU update on one core; the recipes and benchmarks give each rank its share of the cores instead.
"""

from __future__ import annotations

import os

import torch

from .node import node_ranks


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthread siblings count once): OpenMP threads on
    sibling hyperthreads slow the CPU update down rather than up."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


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
