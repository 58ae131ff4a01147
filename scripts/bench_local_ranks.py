"""The CPU update with 1, 2 and 4 ranks on one node: each rank's share of the cores against one core each.

torchrun starts several ranks per node with OMP_NUM_THREADS=1. Each rank here is a process that holds
1/N of the model's FP32 state in host memory and runs OffloadAdamW steps on it, all ranks together
(a barrier before each step), with either the physical cores divided among the N ranks (what
train.py gives each rank, `fsdp_offload.threads`) or one thread each (torchrun's default). A step's
update time is its slowest rank's; the median over the steps after --warmup is reported.

    python scripts/bench_local_ranks.py --model 1b --ranks 1,2,4 --device-kind nvidia-h200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.models import MODEL_PRESETS, num_params
from fsdp_offload.results import record
from fsdp_offload.threads import cpu_threads_per_rank, physical_cores, use_cpu_threads

CHUNK = 1 << 26  # elements per param tensor


def rank_steps(rank: int, numel: int, threads: int, args: argparse.Namespace, barrier, queue) -> None:
    use_cpu_threads(threads)  # as train.py does
    g = torch.Generator().manual_seed(rank)
    sizes = [min(CHUNK, numel - lo) for lo in range(0, numel, CHUNK)]
    params = [torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in sizes]
    grads = [torch.randn(n, generator=g).bfloat16() for n in sizes]
    opt = OffloadAdamW(params, lr=1e-4, offload=OffloadConfig(kernel=args.kernel, subgroup_numel=args.subgroup_numel))
    times = []
    for _ in range(args.warmup + args.steps):
        for p, grad in zip(params, grads):
            p.grad = grad
        barrier.wait()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    queue.put((rank, opt.kernel_name, times[args.warmup :]))
    barrier.wait()  # every rank's state stays allocated until all have measured
    opt.close()


def run(ranks: int, threads: int, numel: int, args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=rank_steps, args=(r, numel // ranks, threads, args, barrier, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a rank of the {ranks}-rank run exited with {p.exitcode}")
    per_step = [max(r[2][k] for r in results) for k in range(args.steps)]
    update_s = statistics.median(per_step)
    return {"ranks": ranks, "threads_per_rank": threads, "params_per_rank": numel // ranks, "kernel": results[0][1],
            "update_s": update_s, "steps_s": per_step, "mparams_per_s": numel / update_s / 1e6}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", help="preset whose param count is split among the ranks")
    ap.add_argument("--params", type=int, default=None, help="total params instead of --model's")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--subgroup-numel", type=int, default=100 * (1 << 20))
    ap.add_argument("--device-kind", default="cpu")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    numel = args.params or num_params(MODEL_PRESETS[args.model])
    runs = []
    for n in (int(r) for r in args.ranks.split(",")):
        for threads in dict.fromkeys((cpu_threads_per_rank(None, n), 1)):  # divided cores, then torchrun's one
            row = run(n, threads, numel, args)
            runs.append(row)
            print(f"{n} rank(s) x {threads:2d} threads: update {row['update_s']:.3f} s, {row['mparams_per_s']:.0f} M params/s", flush=True)
    path = record("bench_local_ranks", args.device_kind, args.out, {
        "params": numel, "model": None if args.params else args.model, "physical_cores": physical_cores(),
        "timing": f"median over {args.steps} steps after {args.warmup} warm-up of the slowest rank's step()",
        "runs": runs,
    })  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
