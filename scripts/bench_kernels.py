"""Throughput of the AdamW kernels on one subgroup, and how close the fused CPU kernel gets to memory.

    python scripts/bench_kernels.py --numel 100000000 --threads 16 --device-kind nvidia-h100-x1

CPU, all with bf16 grads in and bf16 params out: the fused C++ kernel, and its step on split masters
(kernels/split_masters.py: 10 bytes of state a param, joined and split in cache); torch's fused AdamW
(`torch._fused_adamw_` on FP32, plus the bf16 -> FP32 grad cast and FP32 -> bf16 param cast it needs);
the pure-torch path. The fused kernel's GB/s counts 28 bytes/param (read 2 grad + 12 state, write 12
state + 2 params) against the best of a copy, a triad and an in-place add over arrays of that size. On CUDA:
the Triton kernel against torch's fused CUDA AdamW (with the same two casts). Writes
benchmarks/results/bench_kernels_<device>_<timestamp>.json and prints a table last.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch

from fsdp_offload.kernels import get_adamw_kernel, torch_adamw_step
from fsdp_offload.kernels.contract import AdamWHyper
from fsdp_offload.kernels.split_masters import split_masters
from fsdp_offload.results import record

REPO = Path(__file__).resolve().parents[1]
BYTES_PER_PARAM = 28
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10)


def best_seconds(
    fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """Each fn's fastest of `repeats` runs. The fns take turns, so load from other processes on a
    shared machine hits them alike, and the best run is the one it hit least."""
    for fn in fns.values():
        fn()  # warm-up: first-touch page faults, lazy init, the build or the Triton compile
    sync()
    best = {name: math.inf for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def state(numel: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """FP32 param/exp_avg/exp_avg_sq, bf16 grad and bf16 param_out with realistic magnitudes."""
    param = torch.randn(numel, device=device)
    exp_avg = torch.randn(numel, device=device) * 1e-3
    exp_avg_sq = torch.rand(numel, device=device) * 1e-6
    grad = (torch.randn(numel, device=device) * 1e-3).bfloat16()
    return param, exp_avg, exp_avg_sq, grad, torch.empty_like(grad)


def torch_fused_step(param, exp_avg, exp_avg_sq, grad, param_out, grad32, step) -> None:
    """torch's fused AdamW as a bf16-grad optimizer would run it: cast in, update, cast out."""
    grad32.copy_(grad)
    torch._fused_adamw_(
        [param], [grad32], [exp_avg], [exp_avg_sq], [], [step],
        lr=HYPER["lr"], beta1=HYPER["beta1"], beta2=HYPER["beta2"],
        weight_decay=HYPER["weight_decay"], eps=HYPER["eps"], amsgrad=False, maximize=False,
    )  # fmt: skip
    param_out.copy_(param)


def bench_cpu(numel: int, repeats: int) -> dict[str, float | str]:
    """The three CPU paths, and memory probes over arrays of `numel` floats, all with torch's
    threads: STREAM's copy (8 B/element) and triad (12 B/element), which do not count the
    write-allocate reads of their destination, and an in-place add (a += b, 12 B/element, no
    write-allocate), whose pattern, like the kernel's, writes back lines it has just read."""
    _, fused = get_adamw_kernel("fused")
    tensors = state(numel)
    low, split_sq = torch.empty(numel, dtype=torch.int16), tensors[2].clone()
    lowp = split_masters(tensors[0].clone(), low, split_sq)
    split_out = torch.empty_like(lowp)
    grad32, step = torch.empty(numel), torch.tensor(float(HYPER["step"]))
    a, b, c = torch.empty(numel), torch.rand(numel), torch.rand(numel)
    seconds = best_seconds(
        {
            "fused": lambda: fused(*tensors, AdamWHyper(**HYPER)),
            # (lowp stays the first step's: its masters are joined as written params where they moved on)
            "fused_split": lambda: fused.step_split(low, tensors[1], split_sq, tensors[3], lowp, split_out, AdamWHyper(**HYPER)),
            "torch_fused": lambda: torch_fused_step(*tensors, grad32, step),
            "pure_torch": lambda: torch_adamw_step(*tensors, AdamWHyper(**HYPER)),
            "copy": lambda: a.copy_(b),
            "triad": lambda: torch.add(b, c, alpha=3.0, out=a),
            "inplace_add": lambda: b.add_(c),
        },
        repeats,
    )
    return {
        "fused_isa": getattr(fused, "isa", "?"),
        "fused_mparams_per_s": numel / seconds["fused"] / 1e6,
        "fused_split_mparams_per_s": numel / seconds["fused_split"] / 1e6,
        "split_time_over_whole": seconds["fused_split"] / seconds["fused"],
        "torch_mparams_per_s": numel / seconds["torch_fused"] / 1e6,
        "pure_torch_mparams_per_s": numel / seconds["pure_torch"] / 1e6,
        "fused_gbps": BYTES_PER_PARAM * numel / seconds["fused"] / 1e9,
        "copy_gbps": 8 * numel / seconds["copy"] / 1e9,
        "triad_gbps": 12 * numel / seconds["triad"] / 1e9,
        "inplace_add_gbps": 12 * numel / seconds["inplace_add"] / 1e9,
    }


def bench_cuda(numel: int, repeats: int) -> dict[str, float]:
    from fsdp_offload.kernels.triton_adamw import triton_adamw_step

    tensors = state(numel, "cuda")
    grad32 = torch.empty(numel, device="cuda")
    step = torch.tensor(float(HYPER["step"]), device="cuda")
    seconds = best_seconds(
        {
            "triton": lambda: triton_adamw_step(*tensors, AdamWHyper(**HYPER)),
            "torch": lambda: torch_fused_step(*tensors, grad32, step),
        },
        repeats,
        torch.cuda.synchronize,
    )
    return {
        "triton_mparams_per_s": numel / seconds["triton"] / 1e6,
        "torch_cuda_fused_mparams_per_s": numel / seconds["torch"] / 1e6,
        "triton_gbps": BYTES_PER_PARAM * numel / seconds["triton"] / 1e9,
        "triton_speedup_vs_torch_cuda": seconds["torch"] / seconds["triton"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=100_000_000, help="params in the subgroup")
    cores = len(os.sched_getaffinity(0))
    parser.add_argument("--threads", type=int, default=cores, help="CPU threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per kernel (best taken)")
    parser.add_argument("--device-kind", default="cpu", help="machine name recorded in the result")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    result: dict[str, object] = {
        "torch": torch.__version__,
        "threads": args.threads,
        "numel": args.numel,
        "timing": f"best of {args.repeats} runs each, taking turns, after one warm-up",
    }
    result.update(bench_cpu(args.numel, args.repeats))
    probes = ("copy_gbps", "triad_gbps", "inplace_add_gbps")
    result["memory_bw_gbps"] = max(result[name] for name in probes)
    result["fraction_of_memory_bw"] = result["fused_gbps"] / result["memory_bw_gbps"]
    result["speedup_vs_torch_fused"] = result["fused_mparams_per_s"] / result["torch_mparams_per_s"]
    result["triton_speedup_vs_torch_cuda"] = None
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
        result.update(bench_cuda(args.numel, args.repeats))

    path = record("bench_kernels", args.device_kind, str(args.out_dir), result)

    rows = [
        ("fused CPU kernel", result["fused_mparams_per_s"], f"{result['fused_gbps']:.1f} GB/s"),
        ("fused, split masters", result["fused_split_mparams_per_s"], f"{result['split_time_over_whole']:.2f}x the time"),
        ("torch fused + casts", result["torch_mparams_per_s"], ""),
        ("pure-torch path", result["pure_torch_mparams_per_s"], ""),
    ]
    if "triton_mparams_per_s" in result:
        rows += [
            ("Triton (GPU)", result["triton_mparams_per_s"], f"{result['triton_gbps']:.0f} GB/s"),
            ("torch fused CUDA + casts", result["torch_cuda_fused_mparams_per_s"], ""),
        ]
    print(f"wrote {path}")
    print(f"{args.numel / 1e6:g}M params, {args.threads} threads, {result['fused_isa']}")
    print(f"{'kernel':<26}{'M params/s':>12}  note")
    for name, rate, note in rows:
        print(f"{name:<26}{rate:>12.0f}  {note}")
    print(
        f"fused: {result['speedup_vs_torch_fused']:.2f}x torch fused, "
        f"{result['fraction_of_memory_bw']:.0%} of {result['memory_bw_gbps']:.1f} GB/s memory bandwidth"
    )
    if result["triton_speedup_vs_torch_cuda"] is not None:
        print(f"Triton: {result['triton_speedup_vs_torch_cuda']:.2f}x torch fused CUDA")


if __name__ == "__main__":
    main()
