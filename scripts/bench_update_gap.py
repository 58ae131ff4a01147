"""Why a step's CPU update can run slower than the planner's timed kernel: the fused AdamW kernel timed
as `ranks` teams side by side (as `update_rate.node_update_rate` times it), on four kinds of memory
and company:

- `planner`: torch.zeros state and an ordinary bf16 grad buffer (what the planner times);
- `cold`: planner memory, but each round on the next of --cold-sets sets of it, as a step meets each
  subgroup's state once (the planner's one set may stay partly in a large last-level cache);
- `sweep`: planner memory, each round --cold-sets kernels back to back, each on its own set, as a step
  updates its subgroups one after another (the planner's rounds are one kernel each, after a pause);
- `repeat`: as `sweep`, but the --cold-sets kernels of a round all on one set (back to back, not distinct);
- `step_memory`: the step's own allocations, page-aligned state (`cache.host_buffer`) and page-locked
  grads (`host_buffer(pin=True)` where CUDA is there), as the host cache and the staging buffer hold them;
- `with_launcher`: step memory, with one more thread a team launching GPU work on the team's GPU all the
  while (a rank's forward runs beside its update);
- `with_copies`: step memory, with each team's new bf16 params copied to the GPU after its kernel and
  waited for, as the step copies each subgroup's back into the model (the step overlaps that copy
  with the next subgroup's kernel: this variant's extra time is the copy's own, an upper bound).

Each variant's rate is the median round (its slowest team) of at least --rounds rounds after a warm-up.

    python scripts/bench_update_gap.py --ranks 2 --threads 16 --numel 67108864 --device-kind nvidia-h100-x2
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Callable

import torch

from fsdp_offload.cache import host_buffer, unpin
from fsdp_offload.kernels import get_adamw_kernel
from fsdp_offload.kernels.contract import AdamWHyper
from fsdp_offload.results import record
from fsdp_offload.threads import use_cpu_threads

VARIANTS = ("planner", "cold", "sweep", "repeat", "step_memory", "with_launcher", "with_copies")
PLANNER_MEMORY = ("planner", "cold", "sweep", "repeat")


def buffers(variant: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 state [params | exp_avg | exp_avg_sq] and the bf16 grads, allocated as `variant` says."""
    if variant in PLANNER_MEMORY:
        return torch.zeros(3, n), torch.empty(n, dtype=torch.bfloat16)
    state = host_buffer(3 * n * 4, pin=False).view(torch.float32).view(3, n)
    state.zero_()
    grads = host_buffer(n * 2, pin=torch.cuda.is_available()).view(torch.bfloat16)
    return state, grads


def team_device(i: int) -> torch.device:
    """Team `i`'s GPU, as rank i of a node has its own (teams share them where the node has fewer)."""
    return torch.device("cuda", i % torch.cuda.device_count())


def launcher(stop: threading.Event, device: torch.device) -> None:
    """Launches small GPU matmuls until `stop`, syncing every 64: a thread as busy as a forward's."""
    a = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(64):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize(device)


def time_variant(variant: str, kernel: Callable, n: int, threads: int, ranks: int, rounds: int, cold_sets: int) -> dict:
    durations = [0.0] * ranks
    times: list[float] = []
    crossings, done = [0], [False]

    def close_round() -> None:
        crossings[0] += 1
        if crossings[0] > 2:  # after the warm-up round
            times.append(max(durations))
            done[0] = len(times) >= rounds

    barrier = threading.Barrier(ranks, action=close_round)
    stop = threading.Event()
    helpers = [threading.Thread(target=launcher, args=(stop, team_device(i))) for i in range(ranks if variant == "with_launcher" else 0)]
    for h in helpers:
        h.start()
    errors: list[BaseException] = []

    def team(i: int) -> None:
        use_cpu_threads(threads)
        sets = [buffers(variant, n) for _ in range(cold_sets if variant in ("cold", "sweep") else 1)]
        calls = cold_sets if variant in ("sweep", "repeat") else 1  # kernels a round, back to back
        gpu_params = torch.empty(n, dtype=torch.bfloat16, device=team_device(i)) if variant == "with_copies" else None
        step = 0
        try:
            while True:
                chosen = [sets[k % len(sets)] for k in range(calls)] if calls > 1 else [sets[step % len(sets)]]
                for _, grads in chosen:
                    grads.fill_(1e-3)
                barrier.wait()
                if done[0]:
                    return
                step += 1
                t0 = time.perf_counter()
                for state, grads in chosen:
                    kernel(state[0], state[1], state[2], grads, grads, AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.0, step))
                if gpu_params is not None:
                    gpu_params.copy_(grads, non_blocking=True)
                    torch.cuda.synchronize(gpu_params.device)
                durations[i] = time.perf_counter() - t0
        except threading.BrokenBarrierError:
            return  # another team failed: its error is the one to report
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()  # the other teams stop waiting for this one
        finally:
            if variant not in PLANNER_MEMORY and torch.cuda.is_available():  # the next variant may get these pages
                unpin(sets[0][1])

    before = torch.get_num_threads()
    workers = [threading.Thread(target=team, args=(i,)) for i in range(ranks)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        stop.set()
        for h in helpers:
            h.join()
        torch.set_num_threads(before)
    if errors:
        raise errors[0]
    median = statistics.median(times)
    calls = cold_sets if variant in ("sweep", "repeat") else 1
    return {"variant": variant, "ranks": ranks, "threads": threads, "numel": n, "kernels_a_round": calls, "rounds_s": times,
            "median_round_s": median, "mparams_per_s_per_rank": n * calls / median / 1e6}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1, help="teams timed side by side (a node's ranks)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(), help="intra-op threads a team")
    ap.add_argument("--numel", type=int, default=64 << 20, help="params a team updates a round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2, help="passes over the variants, interleaved")
    ap.add_argument("--kernel", default="fused")
    ap.add_argument("--cold-sets", type=int, default=3,
                    help="buffer sets `cold` cycles through and `sweep` updates a round; kernels a round of `repeat`")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device-kind", required=True)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants {unknown} unknown: choose from {', '.join(VARIANTS)}")
    if not torch.cuda.is_available() and any(v in ("with_launcher", "with_copies") for v in variants):
        ap.error("--variants with_launcher and with_copies need a GPU: leave them out on a CPU machine")
    _, kernel = get_adamw_kernel(args.kernel)
    rows = []
    for _ in range(args.repeat):
        for v in variants:
            rows.append(time_variant(v, kernel, args.numel, args.threads, args.ranks, args.rounds, args.cold_sets))
            print(f"{v:14} {rows[-1]['median_round_s'] * 1e3:8.1f} ms  {rows[-1]['mparams_per_s_per_rank']:7.0f} M params/s a rank")
    path = record("bench_update_gap", args.device_kind, args.out, {"args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
