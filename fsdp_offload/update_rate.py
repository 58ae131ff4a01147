"""How fast this node's CPU updates params: the AdamW kernel timed as a node's ranks run it, side by
side (where no earlier run here has saved the rate its steps had: learned_rate.py)."""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from .kernels.contract import AdamWHyper
from .threads import use_cpu_threads

WINDOW_S = 0.3  # rounds are timed for at least this long after the warm-up round ...
MIN_ROUNDS = 4  # ... and at least this many
_NODE_NUMEL = 128 << 20  # params all teams time at once, at most (14 bytes each: 1.8 GB)
# A step updates each subgroup once, its state not in the CPU's caches: a team's rounds go round copies
# of at least this many bytes together (a 16Ki-param subgroup timed over one copy, in the caches, ran
# 26 us a call where a step's took 40-60 us; on 2 cores, session 25).
COLD_BYTES = 64 << 20


def node_update_rate(kernel_name: str, subgroup_numel: int, threads: int, ranks: int, split: bool = False) -> float:
    """Params per second of each rank's CPU update while the node's `ranks` update at once, `threads`
    intra-op threads each: the step on whole masters, or on `split` ones (kernels/split_masters.py: the
    masters' low halves, joined with the model's bf16 params, 14 bytes a param in memory as well).

    The ranks are timed as they run: `ranks` kernels side by side in this process, each called from its
    own Python thread with its own `threads` (the kernels release the GIL, and the intra-op thread count
    is per calling thread), each over a subgroup's worth of params (at most 64M, and 128M among all
    teams: 1.75 GiB held while timing) laid out as a step finds them (FP32 params and moments, the
    staged bf16 grads, the new bf16 params written over them), round after round over copies of it
    that the CPU's caches cannot hold together (COLD_BYTES), as a step finds them. The update is bound
    by host memory bandwidth, which the ranks share, and separate teams reach more of it than one team
    of all their threads: on nvidia-h200-x4 the 1.35B's update took 0.27 s at 1 rank of 64
    threads and 0.21 s at 4 ranks of 16, each holding a quarter (session 21). A round's time is its
    slowest team's, as a step's update is its slowest rank's. The rate is from the median round of at
    least WINDOW_S after a warm-up round: the best of three short rounds of one team of all the node's
    threads, as this was timed before, read 0.77-1.47x a step's update at 4 ranks (session 20), a
    straggling core of a shared machine slowing a whole round.

    The kernel alone, called back to back: a step's update also walks its subgroups, wakes the kernel's
    threads once a subgroup and copies the new params to the model (update_costs.py times what those
    add), and runs beside the next forward."""
    from .kernels import get_adamw_kernel, split_step_of

    _, kernel = get_adamw_kernel(kernel_name)
    split_step = split_step_of(kernel) if split else None
    n = max(1, min(subgroup_numel, 64 << 20, _NODE_NUMEL // ranks))
    durations = [0.0] * ranks
    rounds: list[float] = []
    crossings, deadline, done = [0], [math.inf], [False]

    def close_round() -> None:  # run by the last team to reach the barrier, before any goes on
        crossings[0] += 1
        if crossings[0] == 2:  # the warm-up round has ended
            deadline[0] = time.perf_counter() + WINDOW_S
        elif crossings[0] > 2:
            rounds.append(max(durations))
            done[0] = len(rounds) >= MIN_ROUNDS and time.perf_counter() >= deadline[0]

    barrier = threading.Barrier(ranks, action=close_round)

    def team(i: int) -> None:
        try:
            use_cpu_threads(threads)
            # (split: the low halves, of 2 bytes, in the first row's place, and the model's bf16 params beside them)
            copies = [(torch.zeros(3, n), torch.empty(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.int16) if split else None,
                       torch.zeros(n, dtype=torch.bfloat16) if split else None) for _ in range(-(-COLD_BYTES // (14 * n)))]  # fmt: skip
            step = 0
            while True:
                state, grads, low, lowp = copies[step % len(copies)]
                grads.fill_(1e-3)  # the step before wrote new params over them
                barrier.wait()  # every team starts a round together
                if done[0]:
                    return
                step += 1
                hyper = AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.0, step)
                t0 = time.perf_counter()
                if split_step is None:
                    kernel(state[0], state[1], state[2], grads, grads, hyper)
                else:
                    split_step(low, state[1], state[2], grads, lowp, grads, hyper)
                durations[i] = time.perf_counter() - t0
        except threading.BrokenBarrierError:
            raise
        except BaseException:
            barrier.abort()  # the other teams stop waiting for this one
            raise

    before = torch.get_num_threads()
    with ThreadPoolExecutor(max_workers=ranks, thread_name_prefix="fsdp-offload-rate") as pool:
        futures = [pool.submit(team, i) for i in range(ranks)]
    if threads != before:  # a team's set_num_threads is also the count threads started later begin with
        torch.set_num_threads(before)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return n / statistics.median(rounds)


BUSY_CORES = 1.0  # CPU time others took while the rate was timed, in cores, from which the plan says so
MIN_LOAD_WALL_S = 0.1  # /proc/stat counts in ticks (10 ms): a shorter measure is not judged


@dataclass(frozen=True)
class OtherLoad:
    """What the rest of the node took of its CPUs while this process timed a rate, in cores (CPU seconds over
    wall seconds): other processes, and time the hypervisor gave to other guests (steal). The timing's threads
    take every core, so either slows its kernel, and the rate then reads below what a quiet node's steps get."""

    others_cores: float
    steal_cores: float

    @staticmethod
    def between(before: tuple[int, int], after: tuple[int, int], own_s: float, wall_s: float, ticks_per_s: int) -> OtherLoad:
        """From two (busy, steal) readings of the node's CPU ticks (`node_cpu_ticks`) and this process's own
        CPU seconds in between."""
        busy_s, steal_s = ((a - b) / ticks_per_s for a, b in zip(after, before))
        wall = max(wall_s, 1e-9)
        return OtherLoad(max(0.0, busy_s - steal_s - own_s) / wall, steal_s / wall)

    @property
    def busy(self) -> bool:
        """Whether the rest of the node took enough to slow the timing (a core or more, either way)."""
        return self.others_cores >= BUSY_CORES or self.steal_cores >= BUSY_CORES

    @property
    def cores(self) -> float:
        return self.others_cores + self.steal_cores

    def warning(self) -> str:
        """A sentence for the plan where the node was busy enough to slow the timing ("" where it was not)."""
        busy = [f"other processes took {self.others_cores:.1f} cores" if self.others_cores >= BUSY_CORES else "",
                f"the hypervisor gave {self.steal_cores:.1f} cores to other guests (steal)" if self.steal_cores >= BUSY_CORES else ""]
        if not self.busy:
            return ""
        return (f"while the CPU rate was timed, {' and '.join(b for b in busy if b)}: the rate may read below a quiet "
                "node's, and the predicted update above it; plan again on a quiet node, or let a run learn its rate "
                "(offload.bandwidth_profile)")


def node_cpu_ticks(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """The node's busy CPU ticks since boot (all but idle and iowait; steal included) and its steal ticks,
    from /proc/stat's first line; None where there is none to read (not Linux)."""
    try:
        with open(stat) as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    return user + nice + system + irq + softirq + steal, steal


def timed_beside_load(measure: Callable[[], float]) -> tuple[float, OtherLoad | None]:
    """`measure()` (a rate), and what the rest of the node took of its CPUs meanwhile (None where the node's
    CPU ticks cannot be read, or `measure` took too few of them to tell)."""
    before, own0, t0 = node_cpu_ticks(), time.process_time(), time.perf_counter()
    value = measure()
    after, own_s, wall_s = node_cpu_ticks(), time.process_time() - own0, time.perf_counter() - t0
    if before is None or after is None or wall_s < MIN_LOAD_WALL_S:
        return value, None
    return value, OtherLoad.between(before, after, own_s, wall_s, os.sysconf("SC_CLK_TCK"))
