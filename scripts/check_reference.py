"""Multi-rank check on GPUs: FSDP2 + OffloadAdamW (state on disk) against a reference that keeps FP32
masters in host memory and updates them with torch.optim.AdamW. Same model, data and init.

    torchrun --nproc-per-node 2 scripts/check_reference.py --model 1b --steps 10 --device-kind nvidia-h200-x2

Records both loss curves, their largest relative difference, and the file each rank's subgroups went to.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.data import DataConfig, TokenBatches
from fsdp_offload.fsdp import cast_params
from fsdp_offload.models import MODEL_PRESETS, num_params
from fsdp_offload.parallelize import build_fsdp_model
from fsdp_offload.results import record

DEVICE = torch.device("cpu")  # the GPU of this rank when there is one (gloo on CPU for a smoke run)


def losses_of(model, step_fn, args, margs) -> list[float]:
    batches = TokenBatches(DataConfig(seq_len=args.seq, micro_batch=1), margs.vocab_size, dist.get_rank(), dist.get_world_size())
    out = []
    for _ in range(args.steps):
        tokens = next(batches).to(DEVICE)
        loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        step_fn()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out.append(total.item() / dist.get_world_size())
    return out


def run_offload(args, margs, tier_dir: str) -> tuple[list[float], str]:
    model = build_fsdp_model(margs, DEVICE)
    cfg = OffloadConfig(tiers=[f"posix:{tier_dir}"], host_budget_gb=args.host_budget_gb, max_grad_norm=1.0)
    opt = OffloadAdamW(model.parameters(), lr=args.lr, model=model, offload=cfg)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    losses = losses_of(model, step, args, margs)
    path = opt.store.tiers[0].path
    opt.close()
    return losses, path


def run_reference(args, margs) -> list[float]:
    model = build_fsdp_model(margs, DEVICE)
    # FP32 masters in host memory, updated by torch.optim.AdamW's single-tensor CPU path
    masters = [torch.nn.Parameter(p.to_local().detach().cpu().clone()) for p in model.parameters()]
    cast_params(model, torch.bfloat16)  # as OffloadAdamW casts it
    params = list(model.parameters())
    ref = torch.optim.AdamW(masters, lr=args.lr, weight_decay=1e-2, foreach=False)

    def step() -> None:
        grads = [p.grad.to_local().float() for p in params]
        sq = torch.stack([g.double().square().sum() for g in grads]).sum()
        dist.all_reduce(sq)
        clip = min(1.0, 1.0 / (sq.sqrt().item() + 1e-6))
        for m, g in zip(masters, grads):
            m.grad = (g * clip).cpu()
        ref.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.to_local().copy_(m)
                p.grad = None

    return losses_of(model, step, args, margs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--host-budget-gb", type=float, default=6.0)
    ap.add_argument("--tier-dir", default=None)
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic kernels (math attention, deterministic cuBLAS), and the reference run twice "
                         "to show the noise floor")  # fmt: skip
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    global DEVICE
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
    margs = dataclasses.replace(MODEL_PRESETS[args.model], activation_checkpointing=True, max_seq_len=args.seq)
    tier_dir = args.tier_dir or tempfile.mkdtemp(prefix="check-ref-")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        attention = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)
    else:
        attention = contextlib.nullcontext()
    with attention:
        offload, path = run_offload(args, margs, tier_dir)
        reference = run_reference(args, margs)
        repeat = run_reference(args, margs) if args.deterministic else None
    paths = [None] * dist.get_world_size()
    dist.all_gather_object(paths, path)
    if dist.get_rank() == 0:
        rel = [abs(a - b) / abs(b) for a, b in zip(offload, reference)]
        result = {
            "world_size": dist.get_world_size(),
            "params_billion": num_params(margs) / 1e9,
            "losses_offload": offload,
            "losses_reference": reference,
            "max_rel_loss_diff": max(rel),
            "deterministic": args.deterministic,
            "reference": "FP32 masters in host memory, torch.optim.AdamW(foreach=False) on CPU",
            "max_rel_loss_diff_reference_repeat": None if repeat is None else max(abs(a - b) / abs(b) for a, b in zip(repeat, reference)),
            "tier_files_per_rank": paths,
            "tier_files_distinct": len(set(paths)) == len(paths),
        }
        out = record("check_reference", args.device_kind, args.out, result, launcher=f"torchrun --nproc-per-node {dist.get_world_size()}")
        print(f"{'step':>4} {'offload':>10} {'reference':>10} {'rel diff':>9}")
        for i, (a, b, r) in enumerate(zip(offload, reference, rel)):
            print(f"{i:>4} {a:>10.5f} {b:>10.5f} {r:>9.2e}")
        print(f"max rel diff {max(rel):.2e}; subgroup files {paths}; wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
