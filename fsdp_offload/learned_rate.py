"""The CPU update's rate as a run's own steps had it, kept in the bandwidth profile for the planner.

Timed alone before a run, the kernel's time came out 0.85-2.18x a step's own on nvidia-h200-x4
(session 24): the machines differ, and at 1 rank the step's kernel ran 1.2-2.2x faster than the timing
on all three that ran it. So a run with `offload.bandwidth_profile` set saves what its steps did
(`UpdateRateLearner`), and a plan on that host for the same kernel, ranks, threads, grads and subgroup
size predicts from it (`learned_rate_for`) instead of timing the kernel. Where that run's update streamed
nothing, it also saves what its update took a subgroup beside the kernel (its walk), which the planner
then takes instead of timing it over small subgroups: that timing read 0.08-3.3x the steps'
own walk at 4 ranks and 0.2-20x at 1 rank, on three machines (session 27).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch

from .bandwidth_profile import BandwidthProfile, locked_profile
from .config import OffloadConfig
from .kernels import get_adamw_kernel

log = logging.getLogger(__name__)

LEARN_STEPS = 3  # steps after the first whose median rate a run saves
SAVE_WAIT_S = 2.0  # a peer rank saves in milliseconds; a lock held longer (a tier being measured) is tried at the next step


@dataclass(frozen=True)
class CpuRate:
    """Each rank's CPU update speed for a prediction, and where it came from."""

    params_per_s: float
    source: str  # "given" (machine.cpu_mparams_per_s), "learned" (an earlier run's steps here) or "timed" (update_rate)
    detail: str = ""  # "learned": the run it came from; "timed": what would give a learned one (learned_rate.unlearned_note)
    # "learned", where that run's update streamed nothing: its steps' own walk a subgroup beside the kernel, the
    # slowest rank's, seconds (update_costs.UpdateCosts.subgroup_s)
    subgroup_s: float | None = None


def kernel_label(kernel: object, split: bool = False) -> str:
    """The CPU kernel as a rate is kept for: the fused one with its instruction set, or torch's; "-split"
    for its step on split masters (more work a param: its rate is kept apart)."""
    isa = getattr(kernel, "isa", None)
    return (f"fused-{isa}" if isa else "torch") + ("-split" if split else "")


def update_rate_key(kernel: str, ranks: int, threads: int, grad_dtype: torch.dtype, subgroup_numel: int) -> str:
    """What a learned rate holds for: the kernel, the node's ranks updating at once, each one's threads,
    the grads it reads (bf16 staged, or FP32 sums of several micro-batches: more bytes a param) and the
    subgroup size (a kernel call a subgroup: smaller ones ran up to a quarter slower, session 24)."""
    grads = str(grad_dtype).removeprefix("torch.")
    return f"{kernel} {ranks} ranks x {threads} threads, {grads} grads, subgroups of {subgroup_numel}"


def rate_key_for(cfg: OffloadConfig, ranks: int, threads: int, split: bool = False) -> str:
    """The key a run of `cfg` with `ranks` on the node, `threads` each, saves its rate under (the kernel's
    grads: FP32 where micro-batches are summed or the FP32 grad path is taken, else the params' dtype), for
    the step on whole masters or on `split` ones."""
    grads = torch.float32 if cfg.micro_batches > 1 or cfg.grad_path == "tier_fp32" else getattr(torch, cfg.param_dtype)
    return update_rate_key(kernel_label(get_adamw_kernel(cfg.kernel)[1], split), ranks, threads, grads, cfg.subgroup_numel)


def learned_rate_for(cfg: OffloadConfig, ranks: int, threads: int, split: bool = False) -> CpuRate | None:
    """The slowest local rank's rate (a step's update is its slowest rank's) that the last run here with
    that key saved in cfg.bandwidth_profile; None without a profile, without such a run, where that
    run saved fewer than `ranks` ranks' (it ended before its fourth step), or where its entry is broken
    (a hand edit: the profile warns of it). Reads only: a profile not there yet is not made."""
    if cfg.bandwidth_profile is None or not os.path.isfile(os.path.expanduser(cfg.bandwidth_profile)):
        return None
    key = rate_key_for(cfg, ranks, threads, split)
    with locked_profile(cfg.bandwidth_profile) as profile:
        _, rates, updated = profile.update_rate_entry(key)
        walks = profile.update_rate_walks(key)
    local = {str(r) for r in range(ranks)}
    if not local <= set(rates):  # every local rank of that run, or none of it
        return None
    walk = max(walks[r] for r in local) if local <= set(walks) else None
    return CpuRate(min(rates.values()), "learned", f"{key}, saved {updated}, {cfg.bandwidth_profile}", walk)


def step_walk(metrics, cpu_subgroups: int) -> float | None:
    """What a step's update (`metrics`, a StepMetrics) took beside its CPU kernel and grad norm, a subgroup of
    the `cpu_subgroups` it updated there, in seconds: the walk as the planner counts it (update_costs.
    UpdateCosts.subgroup_s). None where the update also read or wrote a tier or updated subgroups on the
    GPU, whose time is in its own. (The grad norm is not kept: it waits for backward's tail, which is the
    model's and the batch's, not in a rate's key.)"""
    if cpu_subgroups <= 0 or metrics.subgroups_read or metrics.subgroups_written or metrics.subgroups_on_gpu:
        return None
    return max(0.0, metrics.update_s - metrics.cpu_kernel_s - metrics.norm_s) / cpu_subgroups


def unlearned_note(cfg: OffloadConfig, ranks: int, threads: int, split: bool = False) -> str:
    """For a plan that found no learned rate in cfg.bandwidth_profile: what would give it one ("" without
    a profile), naming a run of this key that ended before every rank saved, and the keys of other runs."""
    if cfg.bandwidth_profile is None:
        return ""
    key = rate_key_for(cfg, ranks, threads, split)
    parts = [f"a run here of {LEARN_STEPS + 1} steps or more saves its own to {cfg.bandwidth_profile}, and the next plan uses it"]
    if os.path.isfile(os.path.expanduser(cfg.bandwidth_profile)):
        with locked_profile(cfg.bandwidth_profile) as profile:
            keys, own = profile.update_rate_keys(), profile.update_rate_entry(key)[1]
        if own:
            parts.append(f"the last run here for {key} ended before each of its {ranks} ranks saved its rate")
        others = [k for k in keys if k != key]
        if others:
            parts.append(f"it holds rates learned for other runs ({'; '.join(others)}): state machine.ranks_per_node and "
                         "train.cpu_threads as that run had them")  # fmt: skip
    return "; ".join(parts)


class UpdateRateLearner:
    """Keeps one rank's CPU update rate as its steps ran it: the median over LEARN_STEPS steps after the
    first (params the kernel updated over the time it took), saved once to the bandwidth profile under
    this local rank and the job's `run` (one id for all its ranks: a new run's first save clears the
    last run's ranks), for the planner's next prediction on this host."""

    def __init__(self, profile_path: str, ranks: int, local_rank: int, run: str, subgroup_numel: int) -> None:
        BandwidthProfile(profile_path).close()  # a path that cannot hold a profile fails now, naming itself
        self.profile_path, self.ranks, self.local_rank, self.run = profile_path, ranks, local_rank, run
        self.subgroup_numel = subgroup_numel
        self._seen = 0
        self._rates: list[float] = []
        self._walks: list[float | None] = []
        self._saved = False
        self._waited = False  # the first try waits SAVE_WAIT_S for a peer's save; later ones do not wait

    def observe(self, kernel: str, threads: int, grad_dtype: torch.dtype, params: int, seconds: float,
                walk_s: float | None = None) -> None:  # fmt: skip
        """One step's CPU kernel: `params` updated in `seconds` by `threads` threads; its update's walk a
        subgroup beside the kernel (step_walk), None where the step cannot tell it."""
        self._seen += 1
        if self._seen == 1 or self._saved or params <= 0 or seconds <= 0:
            return  # the first step warms up; once saved, the rate is kept
        if len(self._rates) < LEARN_STEPS:
            self._rates.append(params / seconds)
            self._walks.append(walk_s)
        if len(self._rates) == LEARN_STEPS:
            key = update_rate_key(kernel, self.ranks, threads, grad_dtype, self.subgroup_numel)
            walk = None if None in self._walks else statistics.median(self._walks)
            self._saved = self._save(key, statistics.median(self._rates), walk)

    def _save(self, key: str, rate: float, walk_s: float | None) -> bool:
        """Saves `rate`, the first time waiting at most SAVE_WAIT_S for the profile (this runs inside a
        step: a peer rank's save takes milliseconds, another process's tier measurement minutes), later
        not at all; True once done or given up, False to try again at the next step. Never raises."""
        try:
            profile = BandwidthProfile(self.profile_path)
            try:
                deadline = time.monotonic() + (0.0 if self._waited else SAVE_WAIT_S)
                self._waited = True
                while True:
                    with profile.locked(wait=False) as got:
                        if got:
                            profile.store_update_rate(key, self.run, self.local_rank, rate, walk_s)
                            break
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.01)
            finally:
                profile.close()
        except Exception as exc:  # the file or its dir gone, a symbolic link, a full disk: said, not raised
            log.warning("cannot save the learned CPU update rate to %s: %s (training goes on)", self.profile_path, exc)
            return True
        if self.local_rank == 0:  # said once a node
            beside = "" if walk_s is None else f", {walk_s * 1e3:.2f} ms a subgroup beside the kernel"
            log.info("learned the CPU update rate: %.0f M params/s a rank%s (%s), saved to %s for the planner", rate / 1e6,
                     beside, key, self.profile_path)  # fmt: skip
        return True
