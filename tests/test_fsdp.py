"""OffloadAdamW on FSDP2 (CPU, gloo, 2 and 4 ranks).

Per variant (plain, clipping, grad accumulation, fp16 + loss scaling), three runs of a tiny LLaMA:
state on disk with a small host cache, state all in memory, and a reference that keeps FP32 masters
in memory and updates them with torch.optim.AdamW. On disk and in memory must agree bit for bit;
both must track the reference's losses within 1e-3 relative.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import cast_params, local_data
from fsdp_offload.models import LlamaArgs, Transformer
from fsdp_offload.parallelize import build_fsdp_model

STEPS = 20
SG = 4096
ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32)
VARIANTS = {
    "plain": dict(),
    "clip": dict(max_grad_norm=0.5),
    "accum": dict(micro_batches=2),
    "fp16": dict(dtype="float16"),
}
LR, WD = 3e-3, 0.1


def build_model(rank: int) -> torch.nn.Module:
    return build_fsdp_model(ARGS, torch.device("cpu"))


def batch(rank: int, micro: int) -> torch.Tensor:
    """A fixed pair of sequences per rank and micro-batch, so the loss has something to learn."""
    g = torch.Generator().manual_seed(7 + rank * 13 + micro)
    return torch.randint(0, ARGS.vocab_size, (2, 33), generator=g)


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def train_offload(rank: int, variant: dict, tiers: list[str], budget: float | None) -> tuple[list[float], list[torch.Tensor]]:
    model = build_model(rank)
    cfg = OffloadConfig(
        tiers=tiers, host_budget_gb=budget, subgroup_numel=SG, kernel="torch",
        param_dtype=variant.get("dtype", "bfloat16"), max_grad_norm=variant.get("max_grad_norm"),
        loss_scale_init=2.0**10,
    )  # fmt: skip
    opt = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WD, model=model, offload=cfg)
    micro = variant.get("micro_batches", 1)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for m in range(micro):
            loss = loss_of(model, batch(rank, m)) / micro
            opt.scale_loss(loss).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    state = opt.state_dict()["state"]
    masters = [local_data(state[i]["master_param"]) for i in range(len(state))]
    opt.close()
    return losses, masters


def train_reference(rank: int, variant: dict) -> list[float]:
    """FP32 masters in memory, torch.optim.AdamW, the model in bf16/fp16 for forward and backward."""
    model = build_model(rank)
    params = list(model.parameters())
    masters = [torch.nn.Parameter(p.to_local().detach().clone()) for p in params]
    dtype = torch.float16 if variant.get("dtype") == "float16" else torch.bfloat16
    cast_params(model, dtype)  # as OffloadAdamW casts it: params only
    params = list(model.parameters())
    ref = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, foreach=False)
    scale, micro, losses = (2.0**10 if dtype == torch.float16 else 1.0), variant.get("micro_batches", 1), []
    for step in range(STEPS):
        total = 0.0
        for m in range(micro):
            loss = loss_of(model, batch(rank, m)) / micro
            (loss * scale).backward()
            total += loss.item()
        grads = [p.grad.to_local().float() / scale for p in params]
        sq = torch.tensor([sum(float(g.double().square().sum()) for g in grads)], dtype=torch.float64)
        dist.all_reduce(sq)
        losses.append(total)
        for p in params:
            p.grad = None
        if not math.isfinite(float(sq)):
            scale /= 2
            continue
        clip = 1.0
        if variant.get("max_grad_norm"):
            clip = min(1.0, variant["max_grad_norm"] / (math.sqrt(float(sq)) + 1e-6))
        for mp, g in zip(masters, grads):
            mp.grad = g * clip
        ref.step()
        with torch.no_grad():
            for p, mp in zip(params, masters):
                p.to_local().copy_(mp)
    return losses


def worker(rank: int, world: int, tmp: str) -> None:
    out = {}
    for name, variant in VARIANTS.items():
        # bf16 staging for up to 40 subgroups plus 3 cache slots: most state lives on disk
        disk_budget = (2 * 40 * SG + 3 * 3 * SG * 4) / 2**30
        disk = train_offload(rank, variant, [f"posix:{tmp}"], disk_budget)
        mem = train_offload(rank, variant, [], None)
        ref = train_reference(rank, variant)
        out[name] = (disk, mem, ref)
    torch.save(out, f"{tmp}/rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_offload_matches_memory_and_reference(tmp_path, world):
    run_ranks(world, worker, str(tmp_path))
    for rank in range(world):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        for name, ((disk_loss, disk_p), (mem_loss, mem_p), ref_loss) in out.items():
            assert disk_loss == mem_loss, f"{name} rank {rank}: disk and memory losses differ"
            for i, (a, b) in enumerate(zip(disk_p, mem_p)):
                assert torch.equal(a, b), f"{name} rank {rank}: param {i} differs between disk and memory"
            for step, (a, b) in enumerate(zip(disk_loss, ref_loss)):
                assert abs(a - b) <= 1e-3 * abs(b), f"{name} rank {rank} step {step}: loss {a} vs reference {b}"
            assert disk_loss[-1] < disk_loss[0], f"{name}: loss did not fall"


def bad_input_worker(rank: int, world: int, tmp: str) -> None:
    plain = Transformer(ARGS)
    with pytest.raises(TypeError, match="not an FSDP2-sharded model"):
        OffloadAdamW(plain.parameters(), model=plain)
    model = build_model(rank)
    with pytest.raises(ValueError, match="pass model=model"):
        OffloadAdamW(model.parameters())
    opt = OffloadAdamW(model.parameters(), model=model, offload=OffloadConfig(subgroup_numel=SG))
    with pytest.raises(RuntimeError, match="before any backward"):
        opt.step()
    with pytest.raises(RuntimeError, match="cannot be added later"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    loss_of(model, batch(rank, 0)).backward()
    assert all(p.grad is None for p in model.parameters())  # the hooks took the grads to host
    opt.step()
    opt.close()
    with pytest.raises(ValueError, match="mixed device types"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, device="meta"))])
    (Path(tmp) / f"ok{rank}").touch()


def test_bad_inputs_fail_clearly(tmp_path):
    run_ranks(2, bad_input_worker, str(tmp_path))
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
