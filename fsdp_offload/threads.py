"""How many threads each rank's CPU update gets: the node's physical cores divided among its ranks
(or, where the launcher bound each rank to its own CPUs, the cores of that binding).

torchrun sets OMP_NUM_THREADS=1 when it starts several ranks per node, which would leave each rank's
CPU update on one core; the recipes and benchmarks give each rank its share of the cores instead.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .node import cgroup_dirs, node_ranks


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


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a kernel CPU list ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_cpus() -> set[int]:
    """The CPUs that this node's ranks share: those of this process's cpuset cgroup (a container, a
    Slurm job), else every online CPU."""
    for d in cgroup_dirs("cpuset"):
        for name in ("cpuset.cpus.effective", "cpuset.effective_cpus"):  # cgroup v2, v1
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(d, name)) as f:
                    cpus = _cpu_list(f.read())
                if cpus:
                    return cpus
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/devices/system/cpu/online") as f:
            return _cpu_list(f.read())
    return set(range(os.cpu_count() or 1))


def cpu_threads_per_rank(threads: int | None, local_ranks: int | None = None) -> int:
    """`threads` (train.cpu_threads) if given, else the physical cores this process may run on, divided
    among the node's ranks (`local_ranks`, by default node.node_ranks()) where its CPU affinity spans
    the node's CPUs: under a binding (taskset, numactl, srun --cpu-bind) the affinity is already this
    rank's share."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"train.cpu_threads={threads} must be >= 1 (null: the physical cores per local rank)")
        return threads
    if hasattr(os, "sched_getaffinity") and os.sched_getaffinity(0) < node_cpus():
        return physical_cores()
    return max(1, physical_cores() // (node_ranks() if local_ranks is None else local_ranks))


def use_cpu_threads(threads: int) -> None:
    """Sets this thread's intra-op threads, only when that changes the count: torch.set_num_threads
    also turns MKL's dynamic threading off, and then the fused kernel's MKL sqrt, called inside its
    OpenMP loop, oversubscribes the cores (the CPU update ran 2x slower on nvidia-h100-x1 at the same
    16 threads)."""
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
