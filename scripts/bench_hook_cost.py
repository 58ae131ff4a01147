"""What OffloadAdamW's grad hooks cost the thread that launches backward: a deep, narrow LLaMA (many
params, tiny ops, so the launching CPU bounds the backward) under FSDP2 on one rank, twice in one
process: plain (bf16 params, no hook; what GPU-only FSDP2 runs) and with OffloadAdamW taking every
grad in its hooks (staged, its norm taken for clipping, a HeldGrad left in p.grad). The two take turns
step by step; each reports its median backward (synchronized on a GPU), and their difference a param
is the hooks' cost. With --micro-batches N each step runs N backwards (every one timed): plain FSDP2
adds each into p.grad, OffloadAdamW sums the later ones in FP32 (on a GPU, `grad_accumulation=gpu`).

    python scripts/bench_hook_cost.py --device cpu --device-kind cpu-2core
    python scripts/bench_hook_cost.py --device cuda --device-kind nvidia-h100-x1 --micro-batches 8

One JSON under --out (result keys: device_type, params, micro_batches, grad_accumulation,
backward_ms_plain, backward_ms_offload, hook_us_per_param, steps); a line on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from fsdp_offload.config import OffloadConfig
from fsdp_offload.fsdp import cast_params
from fsdp_offload.models.llama import LlamaArgs
from fsdp_offload.parallelize import build_fsdp_model, build_offloaded_model
from fsdp_offload.results import record


def timed_backward(model: torch.nn.Module, tokens: torch.Tensor, device: torch.device) -> float:
    loss = model(tokens).float().mean()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--device-kind", required=True)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=100, help="timed steps of each, after 10 untimed")
    ap.add_argument("--micro-batches", type=int, default=1, help="backwards a step")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (the launching thread's work is serial)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    # one rank: its rendezvous in this process (no port to collide on), under torchrun or not
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    shape = LlamaArgs(dim=32, n_layers=args.layers, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=8)
    plain = build_fsdp_model(shape, device)
    cast_params(plain, torch.bfloat16)
    offloaded, opt = build_offloaded_model(shape, device, offload=OffloadConfig(
        subgroup_numel=1 << 16, max_grad_norm=1.0, overlap="none", micro_batches=args.micro_batches))
    tokens = torch.randint(0, shape.vocab_size, (1, 4), device=device)
    times: dict[str, list[float]] = {"plain": [], "offload": []}
    for step in range(10 + args.steps):
        t_plain = [timed_backward(plain, tokens, device) for _ in range(args.micro_batches)]
        plain.zero_grad(set_to_none=True)
        t_offload = [timed_backward(offloaded, tokens, device) for _ in range(args.micro_batches)]
        opt.step()
        opt.zero_grad()
        if step >= 10:
            times["plain"] += t_plain
            times["offload"] += t_offload
    params = len(list(offloaded.parameters()))
    plain_ms, offload_ms = (statistics.median(times[k]) * 1e3 for k in ("plain", "offload"))
    per_param_us = (offload_ms - plain_ms) * 1e3 / params
    result = {"device_type": device.type, "micro_batches": args.micro_batches, "grad_accumulation": opt.grad_accumulation,
              "threads": args.threads, "layers": args.layers, "params": params, "steps": args.steps,
              "backward_ms_plain": plain_ms, "backward_ms_offload": offload_ms, "hook_us_per_param": per_param_us}  # fmt: skip
    path = record("bench_hook_cost", args.device_kind, args.out, result)
    print(f"{params} params, {args.micro_batches} micro-batches ({opt.grad_accumulation} sums): backward {plain_ms:.2f} ms plain, {offload_ms:.2f} ms with the hooks: {per_param_us:.1f} us a param; wrote {path}")
    opt.close()  # its threads and pinned buffers, before the group they were made under goes
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
