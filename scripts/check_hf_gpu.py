"""A Hugging Face client at scale on the GPU: `LlamaForCausalLM` of about 1B params under FSDP2 (one
rank, NCCL), trained a few steps with OffloadAdamW as a user's own loop does (2 micro-batches summed,
clipping through `opt.clip_grad_norm_`), against torch AdamW on FP32 masters of the same model: losses,
clip norms and the FP32 export must be equal, bit for bit (deterministic algorithms, eager attention,
the pure-torch CPU kernel, all state in host memory). tests/test_hf_clients.py is the CPU version.

    python3 scripts/check_hf_gpu.py --device-kind nvidia-h100-x1 --out $OUT
"""

from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (before CUDA starts) deterministic cuBLAS
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from fsdp_offload import OffloadAdamW, OffloadConfig  # noqa: E402
from fsdp_offload.fsdp import cast_params  # noqa: E402
from fsdp_offload.grads import square_sum  # noqa: E402
from fsdp_offload.results import record  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=18, num_attention_heads=16,
              num_key_value_heads=8, max_position_embeddings=1024, attn_implementation="eager")  # fmt: skip
LR, BETAS, WD, MAX_NORM, MICRO = 3e-4, (0.9, 0.95), 0.1, 0.5, 2


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def loss_of(model: torch.nn.Module, step: int, micro: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, seq + 1), generator=g).cuda()
    return model(input_ids=tokens, labels=tokens).loss / MICRO


def reference(steps: int, seq: int) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """torch AdamW on FP32 masters in host memory (the CPU's torch ops, as the product's torch kernel);
    the model in bf16 on the GPU, its micro-batch grads summed there in FP32."""
    model = build()
    params = list(model.parameters())
    masters = [torch.nn.Parameter(p.to_local().detach().cpu().clone()) for p in params]
    cast_params(model, torch.bfloat16, params)
    ref = torch.optim.AdamW(masters, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    losses, norms = [], []
    for step in range(steps):
        sums, total = None, 0.0
        for micro in range(MICRO):
            loss = loss_of(model, step, micro, seq)
            loss.backward()
            total += loss.item()
            grads = [p.grad.to_local() for p in params]
            sums = [g.float() for g in grads] if sums is None else [s + g.float() for s, g in zip(sums, grads)]
            for p in params:
                p.grad = None
        losses.append(total)
        norms.append(math.sqrt(float(torch.stack([square_sum(s.reshape(-1)) for s in sums]).sum())))
        clip = min(1.0, MAX_NORM / (norms[-1] + 1e-6))
        for mp, s in zip(masters, sums):
            mp.grad = (s * clip).cpu()
        ref.step()
        with torch.no_grad():
            for p, mp in zip(params, masters):
                p.to_local().copy_(mp)
    names = [name for name, _ in model.named_parameters()]
    return losses, norms, {name: mp.detach() for name, mp in zip(names, masters)}


def product(steps: int, seq: int) -> tuple[list[float], list[float], dict[str, torch.Tensor], float]:
    model = build()
    params = sum(p.numel() for p in model.parameters())
    opt = OffloadAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, model=model,
                       offload=OffloadConfig(kernel="torch", micro_batches=MICRO))  # fmt: skip
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(MICRO):
            loss = loss_of(model, step, micro, seq)
            opt.scale_loss(loss).backward()
            total += loss.item()
        losses.append(total)
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    full = opt.full_fp32_state_dict(rank0_only=False)
    opt.close()
    return losses, norms, full, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--device-kind", required=True)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    torch.use_deterministic_algorithms(True)
    ref_losses, ref_norms, ref_full = reference(args.steps, args.seq)
    torch.cuda.empty_cache()
    losses, norms, full, params = product(args.steps, args.seq)
    differing = [name for name, t in ref_full.items() if not torch.equal(full[name], t)]
    result = {"params": params, "steps": args.steps, "seq": args.seq, "micro_batches": MICRO, "max_grad_norm": MAX_NORM,
              "losses": losses, "reference_losses": ref_losses, "clip_norms": norms, "reference_clip_norms": ref_norms,
              "losses_equal": losses == ref_losses, "norms_equal": norms == ref_norms,
              "masters_equal": not differing, "differing": differing[:10]}  # fmt: skip
    path = record("check_hf_gpu", args.device_kind, args.out, result)
    print(f"{params / 1e6:.0f}M params: losses equal {result['losses_equal']}, clip norms equal {result['norms_equal']}, "
          f"masters equal {result['masters_equal']} ({len(differing)} differ); clip norms {norms}; wrote {path}")
    dist.destroy_process_group()
    sys.exit(0 if result["losses_equal"] and result["norms_equal"] and result["masters_equal"] else 1)


if __name__ == "__main__":
    main()
