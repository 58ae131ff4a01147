"""How fast the node's GPUs all-gather and reduce-scatter at FSDP2's per-unit sizes, alone: what a
multi-rank step's collectives cost when no rank is late. Beside a profile of a training step, it tells
time spent moving bytes from time spent waiting in the collective for the slowest rank.

    torchrun --standalone --nproc-per-node 4 scripts/bench_collectives.py --device-kind nvidia-h200-x4

One JSON under --out (rank 0 writes it): per size and op, the mean time of --iters calls after a warm-up
and the bus bandwidth (bytes x (world - 1) / world / time, NCCL's convention).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from fsdp_offload.results import record


def time_op(op: str, numel: int, iters: int) -> float:
    """Mean seconds of one bf16 `op` whose unsharded tensor holds `numel` elements."""
    world = dist.get_world_size()
    shard = torch.ones(numel // world, dtype=torch.bfloat16, device="cuda")
    full = torch.empty(shard.numel() * world, dtype=torch.bfloat16, device="cuda")
    if op == "all_gather":
        call = lambda: dist.all_gather_into_tensor(full, shard)  # noqa: E731
    else:
        call = lambda: dist.reduce_scatter_tensor(shard, full)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, action="append",
                    help="unsharded elements per call (repeat; default: 56M, a 1.35B layer, and 4M)")  # fmt: skip
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device-kind", required=True)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_collectives needs CUDA GPUs (NCCL); this machine has none", file=sys.stderr)
        return 2
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    rows = []
    for numel in args.numel or [56_000_000, 4_000_000]:
        for op in ("all_gather", "reduce_scatter"):
            seconds = time_op(op, numel, args.iters)
            nbytes = numel // world * world * 2
            rows.append({"op": op, "numel": numel, "bytes": nbytes, "ms": seconds * 1e3,
                         "bus_gbps": nbytes * (world - 1) / world / seconds / 1e9})  # fmt: skip
    if rank == 0:
        for r in rows:
            print(f"{r['op']:15} {r['bytes'] / 1e6:7.0f} MB  {r['ms']:7.3f} ms  bus {r['bus_gbps']:6.1f} GB/s")
        path = record("bench_collectives", args.device_kind, args.out, {
            "world_size": world, "nccl": ".".join(map(str, torch.cuda.nccl.version())), "iters": args.iters, "runs": rows,
        }, launcher=f"torchrun --nproc-per-node {world}")  # fmt: skip
        print(f"wrote {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
