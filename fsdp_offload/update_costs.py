"""What a step's update takes beyond the CPU kernel's params / rate and the tiers' bytes / bandwidth: its
fixed costs, timed once as the optimizer's own code runs them, the node's ranks side by side.

A tiny model's update is mostly these (the tiny LLaMA on 2 CPU cores: 9 subgroups of 16Ki params, 4 of
them through a tier, 5-6 ms a step of which 1 ms in the kernel), a large one's a few percent at most; the
planner that predicted the kernel and the I/O alone said 0.2-0.35 of the measured update at the tiny
size (session 25). Three costs, each a count the plan knows times a time measured here:
- once a step: the grad norm (its sum, and the all-reduce that waits for the node's other ranks);
- each subgroup updated on the CPU, beside its kernel: its turn in the walk through the host cache, the
  kernel's call, the copy of its new params back into the model;
- each read or write of a subgroup through a tier: what it adds to the update's thread (submitting it,
  taking it in, the wait for it that a small subgroup's update does not hide, the kernel's slowing down
  beside the I/O threads).
Timed on two real OffloadAdamW over SUBGROUPS small subgroups in each of the node's ranks (processes:
their Python runs side by side only there, and their all-reduce is between processes), stepping in
turns: one with all in host memory, one with half streamed through a tier dir. A step's cost is its
slowest rank's, as a run's is.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from .config import OffloadConfig
from .learned_rate import CpuRate
from .machine import MachineConfig
from .storage.base import TierError
from .storage.private_files import host_tag, process_alive
from .subgroups import SubgroupLayout
from .threads import cpu_threads_per_rank, use_cpu_threads
from .update_rate import COLD_BYTES

SUBGROUPS = 8  # timed subgroups: half of them stream through the tier, 8 transfers a step
MAX_NUMEL = 1 << 16  # params a timed subgroup holds at most (its kernel's time is subtracted, not counted) ...
# ... unless its threads need more: each takes the fused kernel's work a chunk at a time (8 blocks of 2048
# params), and a run's subgroup gives every thread of its team many chunks. A subgroup of fewer chunks than
# threads left most of a team of 64 idle at its barriers: 9-14 ms a subgroup beside the kernel where a
# 1-rank run's walk took about 1 ms; at a chunk a thread 0.4-1.1 ms, and 0.4-1.3 ms a kernel call
# (session 27, nvidia-h200-x4: benchmarks/logs/session27_call2). Its
# tier reads and writes then also move more bytes: 10 ms each there at 64 threads, 2-3 ms at 16.
THREAD_CHUNK = 1 << 14
STEPS = 24  # timed steps after WARM_UP, the median taken (a step of the tiny model's took 1-60 ms on 2 shared cores)
WARM_UP = 2
TIMEOUT_S = 300  # for the ranks' processes, their start included
WORK_PREFIX = ".fsdp-offload-costs-"  # the timing's dir in the tier dir: <prefix><host>-pid<p>-<random>


@dataclass(frozen=True)
class UpdateCosts:
    """A rank's update beyond its kernel and its tiers' bandwidth (see the module's note); all 0: none."""

    step_s: float = 0.0  # once a step: the grad norm and its all-reduce among the node's ranks
    subgroup_s: float = 0.0  # each subgroup updated on the CPU, beside its kernel
    transfer_s: float = 0.0  # each subgroup read or written through a tier
    call_s: float = 0.0  # each kernel call beyond params / a timed rate (0 for a learned one: a step's own)

    def walk_seconds(self, subgroups: int, transfers: float) -> float:
        """The update thread's time beside params / rate for `subgroups` updated on the CPU and
        `transfers` reads and writes through the tiers."""
        return subgroups * (self.subgroup_s + self.call_s) + transfers * self.transfer_s

    def describe(self) -> str:
        return (f"{self.step_s * 1e3:.2f} ms a step, {self.subgroup_s * 1e3:.3f} ms a subgroup"
                + (f" and {self.call_s * 1e3:.3f} ms its kernel's call" if self.call_s else "")
                + f", {self.transfer_s * 1e3:.3f} ms a tier read or write")  # fmt: skip


def measured_costs(cfg: OffloadConfig, machine: MachineConfig, cpu_threads: int | None, rate: CpuRate,
                   streams: bool = True) -> UpdateCosts | None:  # fmt: skip
    """The update's fixed costs beside `rate`, timed here (time_update_costs) as the node's ranks run them,
    through the run's first tier's dir where it is here (`streams` False, the plan writing no tier: none
    timed), with the walk a subgroup that a learned rate's run saved beside it (learned_walk) in place of
    the timed one; None beside a stated rate (another machine's). A kernel call is costed beyond a timed
    rate only: a learned one is a step's own kernel time."""
    if rate.source == "given":
        return None
    here = machine.tier_read_gbps is None and bool(cfg.tier_specs) and os.path.isdir(cfg.tier_specs[0].dir)
    timed = time_update_costs(cfg.kernel, cfg.subgroup_numel, cpu_threads_per_rank(cpu_threads, machine.ranks_per_node),
                              machine.ranks_per_node, cfg.tier_specs[0].dir if here else None, cfg.tier_access,
                              rate.params_per_s if rate.source == "timed" else None, streams=streams)  # fmt: skip
    return timed if rate.subgroup_s is None else dataclasses.replace(timed, subgroup_s=rate.subgroup_s)


def learned_walk(rate: CpuRate) -> UpdateCosts | None:
    """The walk a subgroup that a learned rate's run saved beside it (its steps' own, the slowest rank's:
    learned_rate.step_walk) as the only fixed cost, for a prediction that times nothing; None where it
    saved none."""
    return None if rate.subgroup_s is None else UpdateCosts(subgroup_s=rate.subgroup_s)


def time_update_costs(kernel: str, subgroup_numel: int, threads: int, ranks: int, tier_dir: str | None = None,
                      tier_access: str | int = "exclusive", timed_rate: float | None = None,
                      streams: bool = True) -> UpdateCosts:  # fmt: skip
    """UpdateCosts timed here: `ranks` processes (this one alone for one rank) of `threads` intra-op
    threads, their tier one temp dir under `tier_dir` (the run's first tier's dir; None: the system's
    temp dir), taken as offload.tier_access says, as a run's ranks take theirs. With `timed_rate` (the
    params/s of the kernel run back to back, update_rate.node_update_rate), a step's kernel call is
    costed beyond it: a kernel called once a subgroup wakes its threads and finds its state cold.
    `streams` False (the plan writes no tier): no tier is timed and transfer_s is 0.
    Several ranks take the start of `ranks` Python processes (seconds). Raises TierError naming the dir
    and the fix where the timing cannot run there (a dir not writable, or full)."""
    numel = timed_numel(subgroup_numel, threads)
    try:
        remove_stale_work_dirs(tier_dir or tempfile.gettempdir())
        with tempfile.TemporaryDirectory(dir=tier_dir, prefix=f"{WORK_PREFIX}{host_tag()}-pid{os.getpid()}-") as work:
            if ranks == 1:
                before = torch.get_num_threads()
                try:
                    rows = [_rank_rows(0, 1, kernel, numel, threads, work, tier_access, streams)]
                finally:
                    if torch.get_num_threads() != before:
                        torch.set_num_threads(before)
            else:
                rows = _side_by_side(ranks, kernel, numel, threads, work, tier_access, streams)
    except (OSError, _RankFailed) as exc:  # the planner's own timing: said as the dir's fault it is, with the fix
        where = f"{tier_dir} (offload.tiers' first dir)" if tier_dir is not None else f"{tempfile.gettempdir()} (the temp dir)"
        raise TierError(f"timing the update's fixed costs for the prediction in {where} failed: {exc}; where the dir is at "
                        "fault, give one this user can write with a few MiB free; or state the CPU rate "
                        "(machine.cpu_mparams_per_s=<M params/s>: nothing is timed beside it)") from exc  # fmt: skip
    return fitted_costs(rows, numel, timed_rate)


def timed_numel(subgroup_numel: int, threads: int) -> int:
    """Params a timed subgroup holds: the run's subgroup, at most MAX_NUMEL or a THREAD_CHUNK for each of
    `threads`, whichever is more (a multiple of 1024)."""
    return max(1024, min(subgroup_numel, max(MAX_NUMEL, threads * THREAD_CHUNK)) // 1024 * 1024)


def remove_stale_work_dirs(directory: str) -> list[str]:
    """Removes the timing dirs that killed planners of this host left in `directory` (a SIGKILL skips the
    temp dir's own removal): those whose process is gone. Other hosts' (a shared file system) stay."""
    pattern = re.compile(re.escape(WORK_PREFIX + host_tag()) + r"-pid(\d+)-")
    removed = []
    for name in os.listdir(directory):
        match = pattern.match(name)
        if match and not process_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed.append(os.path.join(directory, name))
    return removed


class _RankFailed(RuntimeError):
    """A rank of _side_by_side that ended with an error (its last line)."""


def _side_by_side(ranks: int, kernel: str, numel: int, threads: int, work: str, tier_access: str | int,
                  streams: bool) -> list[dict]:  # fmt: skip
    """Each rank's steps, from `ranks` processes of this module (its `__main__`: a caller's own script is
    not imported again, as multiprocessing's spawn would), each one's errors in `work`."""
    args = [kernel, str(numel), str(threads), work, str(tier_access), str(int(streams))]
    logs = [open(os.path.join(work, f"rank{r}.err"), "w+") for r in range(ranks)]
    procs: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        try:  # one that fails leaves the others waiting at a collective: they are ended at once, as are those
            # started where a later one cannot start, or at Ctrl-C
            for r in range(ranks):
                procs.append(subprocess.Popen([sys.executable, "-m", __name__, str(r), str(ranks), *args],
                                              stdout=subprocess.DEVNULL, stderr=logs[r]))  # fmt: skip
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.returncode for p in procs):
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [r for r, p in enumerate(procs) if p.returncode]
        if failed:
            logs[failed[0]].seek(0)
            last = (logs[failed[0]].read().strip().splitlines() or ["(nothing said)"])[-1]
            raise _RankFailed(f"rank {failed[0]} of {ranks} ended with "
                               f"{procs[failed[0]].returncode}: {last}")  # fmt: skip
    finally:
        for f in logs:
            f.close()
    rows = []
    for r in range(ranks):
        with open(os.path.join(work, f"rank{r}.json")) as f:
            rows.append(json.load(f))
    return rows


def fitted_costs(rows: list[dict[str, list[dict[str, float]]]], numel: int, timed_rate: float | None) -> UpdateCosts:
    """UpdateCosts from each rank's steps ({"host": [...], "tier": [...]}, a dict a step; no "tier": none
    streamed, transfer_s 0) over subgroups of `numel`: each step's figure is its slowest rank's, the median
    step's taken."""

    steps = range(len(rows[0]["host"]))
    slowest = lambda kind, i, figure: max(figure(rank[kind][i]) for rank in rows)  # noqa: E731
    median = lambda kind, figure: statistics.median(slowest(kind, i, figure) for i in steps)  # noqa: E731
    subgroup_s = max(0.0, median("host", lambda s: s["update_s"] - s["kernel_s"] - s["norm_s"])) / SUBGROUPS
    # all that streaming adds to the step, its pair's step in host memory beside it: the kernel too runs
    # slower beside the I/O threads (on 2 cores, 1.0-1.8 ms against 0.5 ms for the tiny model's 9 subgroups)
    # beside a timed rate (the kernel back to back, no I/O); a learned rate is a run's own steps' kernel time,
    # which holds that slowing down where its run streamed: the kernel's time is then left out of both
    kernel = (lambda s: 0.0) if timed_rate is not None else (lambda s: s["kernel_s"])  # noqa: E731
    beside = lambda s: s["update_s"] - s["norm_s"] - kernel(s)  # noqa: E731
    kinds = [kind for kind in ("host", "tier") if kind in rows[0]]
    transfer_s = 0.0
    if "tier" in kinds:
        added = statistics.median(slowest("tier", i, beside) - slowest("host", i, beside) for i in steps)
        transfer_s = max(0.0, added) / max(1.0, median("tier", lambda s: s["transfers"]))
    # a kernel's call: latency + params / rate (the rate timed with the calls back to back)
    call_s = 0.0 if timed_rate is None else max(0.0, median("host", lambda s: s["kernel_s"]) / SUBGROUPS - numel / timed_rate)
    norm = lambda s: s["norm_s"] + s["all_reduce_s"]  # noqa: E731
    norm_s = statistics.median([slowest(kind, i, norm) for kind in kinds for i in steps])
    return UpdateCosts(norm_s, subgroup_s, transfer_s, call_s)


def _rank_main(rank: int, ranks: int, kernel: str, numel: int, threads: int, work: str, tier_access: str | int,
               streams: bool) -> None:  # fmt: skip
    """A rank of _side_by_side: its steps to `work`/rank<r>.json."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(work, 'store')}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        rows = _rank_rows(rank, ranks, kernel, numel, threads, work, tier_access, streams)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(work, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)


def _rank_rows(rank: int, ranks: int, kernel: str, numel: int, threads: int, work: str, tier_access: str | int,
               streams: bool = True) -> dict[str, list[dict[str, float]]]:  # fmt: skip
    """One rank's steps of two OffloadAdamW over SUBGROUPS subgroups of `numel`, a param each, in turns
    (a step's pair a few ms apart: a shared machine's bursts, seconds long, meet both or neither): one
    with all of them in host memory, one with a host cache of half of them and a tier in `work` (each
    process's file its own, as a run's ranks'; the node locks there). Before each step, the backward
    that a run's update follows (it leaves other data in the CPU's caches) and the grad norm's
    all-reduce among the `ranks` (these optimizers have no process group). `streams` False: the first alone."""
    import torch.distributed as dist

    use_cpu_threads(threads)
    opts = {"host": _optimizer(kernel, numel, None, tier_access, work)}
    if streams:
        tier = os.path.join(work, "tier")
        os.makedirs(tier, exist_ok=True)
        opts["tier"] = _optimizer(kernel, numel, tier, tier_access, work)
    norm = torch.zeros(1, dtype=torch.float64)
    backward = torch.empty(COLD_BYTES // 4)
    waits: dict[str, list[float]] = {kind: [] for kind in opts}
    try:
        for _ in range(WARM_UP + STEPS):
            for kind, (opt, params) in opts.items():
                backward.fill_(1.0)
                for p in params:
                    p.grad = torch.full_like(p, 1e-3)
                if ranks > 1:  # a run's ranks come to the norm together, from backward's last reduce-scatter
                    dist.barrier()
                began = time.perf_counter()
                if ranks > 1:
                    dist.all_reduce(norm)
                waits[kind].append(time.perf_counter() - began)
                opt.step()
                opt.finish_update()
        metrics = {kind: opt.take_metrics()[WARM_UP:] for kind, (opt, _) in opts.items()}
    finally:
        for opt, _ in opts.values():
            opt.close()
    return {kind: [{"update_s": m.update_s, "kernel_s": m.cpu_kernel_s, "norm_s": m.norm_s, "all_reduce_s": w,
                    "transfers": m.subgroups_read + m.subgroups_written} for m, w in zip(metrics[kind], waits[kind][WARM_UP:])]
            for kind in opts}  # fmt: skip


def _optimizer(kernel: str, numel: int, tier_dir: str | None, tier_access: str | int, lock_dir: str) -> tuple:
    """An OffloadAdamW and its params: all in host memory, or with a tier in `tier_dir` and a host cache of
    half the subgroups (the staging buffer and their slots, not one more)."""
    from .optimizer import OffloadAdamW  # (the optimizer's rooms: not needed to import the planner)

    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(SUBGROUPS)]
    kw: dict = {}
    if tier_dir is not None:
        layout = SubgroupLayout([numel] * SUBGROUPS, numel)
        budget = 2 * numel * SUBGROUPS + layout.slot_bytes * (SUBGROUPS // 2) + layout.slot_bytes // 2
        kw = dict(tiers=[f"posix:{tier_dir}"], host_budget_gb=budget / 2**30, placement="fixed", tier_ratios=[1.0],
                  tier_access=tier_access, tier_lock_dir=lock_dir)  # (not a run's lock)  # fmt: skip
    cfg = OffloadConfig(subgroup_numel=numel, kernel=kernel, max_grad_norm=1.0, overlap="auto", prefetch=2, **kw)
    return OffloadAdamW(params, lr=1e-4, offload=cfg), params


if __name__ == "__main__":  # a rank of _side_by_side: rank, ranks, kernel, numel, threads, work, tier access, streams
    _r, _ranks, _kernel, _numel, _threads, _work, _access, _streams = sys.argv[1:9]
    _rank_main(int(_r), int(_ranks), _kernel, int(_numel), int(_threads), _work, int(_access) if _access.isdigit() else _access,
               _streams == "1")  # fmt: skip
