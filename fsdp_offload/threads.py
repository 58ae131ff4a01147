"""How many threads each rank's CPU update gets: the node's physical cores divided among its ranks,
less one core a rank that drives a GPU.

torchrun sets OMP_NUM_THREADS=1 when it starts several ranks per node, which would leave each rank's
CPU update on one core; the recipes and benchmarks give each rank its share of the cores instead.

A GPU rank's step can be bound by the thread that launches its kernels (the 1.35B, seq 2048, one
micro-batch: 0.09 s of GPU compute in a 0.4-0.5 s step on nvidia-h200-x4), and with several ranks
every collective waits for the slowest rank's launches (`scripts/trace_waits.py`). The CPU update
runs beside the next forward and is bound by memory bandwidth, not cores, so it gives that thread a
core. Measured interleaved (`benchmarks/results/bench_scale_nvidia-h200-x4_20261126-115127.json`): at
4 ranks 0.490 and 0.477 s a step against 0.490 and 0.495 with all cores; at 1 rank 0.482 (the call's
first run) and 0.388 against 0.440 and 0.391: within the machine's noise, the update as fast.
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


def cpu_threads_per_rank(threads: int | None, local_ranks: int | None = None, *, drives_gpu: bool) -> int:
    """`threads` (train.cpu_threads) if given, else the physical cores this process may run on divided
    among the node's ranks (`local_ranks`, by default node.node_ranks()), less the core that a rank
    which `drives_gpu` keeps for the thread launching its kernels. Under a per-rank CPU binding (srun
    --cpu-bind) that undersubscribes: give train.cpu_threads. Its affinity alone cannot tell a rank's
    own binding from one that all the node's ranks share (taskset around torchrun), where not dividing
    would oversubscribe the cores."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"train.cpu_threads={threads} must be >= 1 (null: the physical cores per local rank, "
                             "less one a GPU rank keeps for launching its kernels)")  # fmt: skip
        return threads
    per_rank = physical_cores() // (node_ranks() if local_ranks is None else local_ranks)
    return max(1, per_rank - 1 if drives_gpu else per_rank)


def use_cpu_threads(threads: int) -> None:
    """Sets this thread's intra-op threads, only when that changes the count: torch.set_num_threads
    also turns MKL's dynamic threading off, and then the fused kernel's MKL sqrt, called inside its
    OpenMP loop, oversubscribes the cores (the CPU update ran 2x slower on nvidia-h100-x1 at the same
    16 threads)."""
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
