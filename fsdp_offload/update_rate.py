"""How fast this node's CPU updates params: learned from the steps of an earlier run on this host
(`UpdateRateLearner` saves it to the bandwidth profile, `learned_update_rate` reads it), else the AdamW
kernel timed as a node's ranks run it, side by side (`node_update_rate`)."""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .bandwidth_profile import BandwidthProfile
from .config import OffloadConfig
from .kernels.contract import AdamWHyper
from .threads import use_cpu_threads

log = logging.getLogger(__name__)

WINDOW_S = 0.3  # rounds are timed for at least this long after the warm-up round ...
MIN_ROUNDS = 4  # ... and at least this many
_NODE_NUMEL = 128 << 20  # params all teams time at once, at most (14 bytes each: 1.8 GB)


def node_update_rate(kernel_name: str, subgroup_numel: int, threads: int, ranks: int) -> float:
    """Params per second of each rank's CPU update while the node's `ranks` update at once, `threads`
    intra-op threads each.

    The ranks are timed as they run: `ranks` kernels side by side in this process, each called from its
    own Python thread with its own `threads` (the kernels release the GIL, and the intra-op thread count
    is per calling thread), each over a subgroup's worth of params (at most 64M, and 128M among all
    teams: 1.75 GiB held while timing) laid out as a step finds them (FP32 params and moments, the
    staged bf16 grads, the new bf16 params written over them). The update is bound by host memory
    bandwidth, which the ranks share, and separate teams reach more of it than one team of all their
    threads: on nvidia-h200-x4 the 1.35B's update took 0.27 s at 1 rank of 64
    threads and 0.21 s at 4 ranks of 16, each holding a quarter (session 21). A round's time is its
    slowest team's, as a step's update is its slowest rank's. The rate is from the median round of at
    least WINDOW_S after a warm-up round: the best of three short rounds of one team of all the node's
    threads, as this was timed before, read 0.77-1.47x a step's update at 4 ranks (session 20), a
    straggling core of a shared machine slowing a whole round.

    The kernel alone: a step's update also copies the new params to the model and runs beside the
    next forward."""
    from .kernels import get_adamw_kernel

    _, kernel = get_adamw_kernel(kernel_name)
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
            state = torch.zeros(3, n)
            grads = torch.empty(n, dtype=torch.bfloat16)
            step = 0
            while True:
                grads.fill_(1e-3)  # the step before wrote new params over them
                barrier.wait()  # every team starts a round together
                if done[0]:
                    return
                step += 1
                t0 = time.perf_counter()
                kernel(state[0], state[1], state[2], grads, grads, AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.0, step))
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


# -- learned from a run's steps -----------------------------------------------------------------------

LEARN_STEPS = 3  # steps after the first whose median rate a run saves


@dataclass(frozen=True)
class CpuRate:
    """Each rank's CPU update speed for a prediction, and where it came from."""

    params_per_s: float
    source: str  # "given" (machine.cpu_mparams_per_s), "learned" (an earlier run's steps here) or "timed" (node_update_rate)


def kernel_label(kernel: object) -> str:
    """The CPU kernel as a rate is kept for: the fused one with its instruction set, or torch's."""
    isa = getattr(kernel, "isa", None)
    return f"fused-{isa}" if isa else "torch"


def update_rate_key(kernel: str, ranks: int, threads: int, grad_dtype: torch.dtype) -> str:
    """What a learned rate holds for: the kernel, the node's ranks updating at once, each one's threads,
    and the grads it reads (bf16 staged, or FP32 sums of several micro-batches: more bytes a param)."""
    return f"{kernel} {ranks} ranks x {threads} threads, {str(grad_dtype).removeprefix('torch.')} grads"


def learned_rate_for(cfg: OffloadConfig, ranks: int, threads: int) -> float | None:
    """The rate an earlier run's steps saved in cfg.bandwidth_profile on this host for a run of `cfg` with
    `ranks` on the node, `threads` each (the kernel's grads: FP32 where micro-batches are summed or the
    FP32 grad path is taken, else the params' dtype); None without a profile or such a run."""
    if cfg.bandwidth_profile is None:
        return None
    from .kernels import get_adamw_kernel

    grads = torch.float32 if cfg.micro_batches > 1 or cfg.grad_path == "tier_fp32" else getattr(torch, cfg.param_dtype)
    key = update_rate_key(kernel_label(get_adamw_kernel(cfg.kernel)[1]), ranks, threads, grads)
    return learned_update_rate(cfg.bandwidth_profile, key)


def learned_update_rate(profile_path: str, key: str) -> float | None:
    """The slowest local rank's rate under `key` in the profile (a step's update is its slowest rank's);
    None where no run here has saved one."""
    profile = BandwidthProfile(profile_path)
    try:
        with profile.locked():
            rates = profile.update_rates(key)
    finally:
        profile.close()
    return min(rates.values()) if rates else None


class UpdateRateLearner:
    """Keeps one rank's CPU update rate as its steps ran it: the median over LEARN_STEPS steps after the
    first (params the kernel updated over the time it took), saved once to the bandwidth profile under
    this local rank, for the planner's next prediction on this host. Timed alone before a run, the
    kernel's time came out 0.85-2.18x a step's own on nvidia-h200-x4 (session 24): the machines differ,
    and at 1 rank the step's kernel ran 1.2-2.2x faster than the timing on all three that ran it."""

    def __init__(self, profile_path: str, ranks: int, local_rank: int) -> None:
        BandwidthProfile(profile_path).close()  # a path that cannot hold a profile fails now, naming itself
        self.profile_path, self.ranks, self.local_rank = profile_path, ranks, local_rank
        self._seen = 0
        self._rates: list[float] = []
        self._saved = False

    def observe(self, kernel: str, threads: int, grad_dtype: torch.dtype, params: int, seconds: float) -> None:
        """One step's CPU kernel: `params` updated in `seconds` by `threads` threads."""
        self._seen += 1
        if self._seen == 1 or self._saved or params <= 0 or seconds <= 0:
            return  # the first step warms up; once saved, the rate is kept
        if len(self._rates) < LEARN_STEPS:
            self._rates.append(params / seconds)
        if len(self._rates) == LEARN_STEPS:  # (a profile busy now is tried again at the next step)
            self._saved = self._save(update_rate_key(kernel, self.ranks, threads, grad_dtype), statistics.median(self._rates))

    def _save(self, key: str, rate: float) -> bool:
        """Saves `rate` if the profile is free right now (another process may hold it for minutes while it
        measures a tier, and this runs inside a step); True once done or given up. Never raises: training
        goes on."""
        try:
            profile = BandwidthProfile(self.profile_path)
            try:
                with profile.locked(wait=False) as got:
                    if not got:
                        return False
                    profile.store_update_rate(key, self.local_rank, rate)
            finally:
                profile.close()
        except Exception as exc:  # the file or its dir gone, a symbolic link, a full disk: said, not raised
            log.warning("cannot save the learned CPU update rate to %s: %s (training goes on)", self.profile_path, exc)
            return True
        if self.local_rank == 0:  # said once a node
            log.info("learned the CPU update rate: %.0f M params/s a rank (%s), saved to %s for the planner", rate / 1e6, key,
                     self.profile_path)  # fmt: skip
        return True
