"""OffloadAdamW on FSDP2 (CPU, gloo, 2 and 4 ranks).

Per variant (plain, clipping, grad accumulation, fp16 + loss scaling), three runs of a tiny LLaMA:
state on disk with a small host cache, state all in memory, and a reference that keeps FP32 masters
in memory and updates them with torch.optim.AdamW, taking the grad norm as the optimizer does
(`square_sum` of each low-precision grad shard, summed in param order, one all-reduce) and applying the
unscale x clip factor to the upcast grads. All three agree bit for bit: losses, masters and moments.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from dist_utils import run_ranks

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.grads import square_sum
from fsdp_offload.held_grad import is_held
from fsdp_offload.fsdp import cast_params, local_data
from fsdp_offload.models import LlamaArgs, Transformer
from fsdp_offload.parallelize import build_fsdp_model

STEPS = 5  # enough for the bf16 rounding, the moments and the fp16 scale to diverge if anything differs
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
    micro = variant.get("micro_batches", 1)
    cfg = dataclasses.replace(cfg, micro_batches=micro)
    opt = OffloadAdamW(model.parameters(), lr=LR, weight_decay=WD, model=model, offload=cfg)
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
    masters = [[local_data(state[i][k]) for k in KEYS] for i in range(len(state))]
    opt.close()
    return losses, masters


KEYS = ("master_param", "exp_avg", "exp_avg_sq")


def train_reference(rank: int, variant: dict) -> tuple[list[float], list[list[torch.Tensor]]]:
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
        total, grads = 0.0, None
        for m in range(micro):
            loss = loss_of(model, batch(rank, m)) / micro
            (loss * scale).backward()
            total += loss.item()
            lowp = [p.grad.to_local() for p in params]
            # one backward: the low-precision grads as they are; several: summed in FP32, micro-batch by micro-batch
            grads = lowp if grads is None else [(g if g.dtype == torch.float32 else g.float()) + x for g, x in zip(grads, lowp)]
            for p in params:
                p.grad = None
        sq = torch.stack([square_sum(g.reshape(-1)) for g in grads]).sum().reshape(1)
        dist.all_reduce(sq)
        losses.append(total)
        norm = math.sqrt(float(sq)) / scale
        if not math.isfinite(norm):
            scale /= 2
            continue
        clip = 1.0
        if variant.get("max_grad_norm"):
            clip = min(1.0, variant["max_grad_norm"] / (norm + 1e-6))
        factor = (1.0 / scale) * clip
        for mp, g in zip(masters, grads):
            mp.grad = g.float() * factor if factor != 1.0 else g.float()
        ref.step()
        with torch.no_grad():
            for p, mp in zip(params, masters):
                p.to_local().copy_(mp)
    state = [[mp.detach(), ref.state[mp]["exp_avg"], ref.state[mp]["exp_avg_sq"]] for mp in masters]
    return losses, state


def worker(rank: int, world: int, tmp: str) -> None:
    out = {}
    for name, variant in VARIANTS.items():
        # bf16 staging for up to 40 subgroups plus 3 cache slots: most state lives on disk
        # (and, accumulating, 6 bytes a param of FP32 grad sums and their landing buffer)
        sums = (6 * 40 + 4) * SG if variant.get("micro_batches", 1) > 1 else 0
        disk_budget = (2 * 40 * SG + 3 * 3 * SG * 4 + sums) / 2**30
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
        for name, ((disk_loss, disk_p), (mem_loss, mem_p), (ref_loss, ref_p)) in out.items():
            assert disk_loss == mem_loss == ref_loss, f"{name} rank {rank}: losses differ (disk, memory, reference)"
            for i, (a, b, r) in enumerate(zip(disk_p, mem_p, ref_p)):
                for key, x, y, z in zip(KEYS, a, b, r):
                    assert torch.equal(x, y), f"{name} rank {rank}: param {i} {key} differs between disk and memory"
                    assert torch.equal(x, z), f"{name} rank {rank}: param {i} {key} differs from the reference"
            assert disk_loss[-1] < disk_loss[0], f"{name}: loss did not fall"


def bad_input_worker(rank: int, world: int, tmp: str) -> None:
    plain = Transformer(ARGS)
    with pytest.raises(TypeError, match="not an FSDP2-sharded model"):
        OffloadAdamW(plain.parameters(), model=plain)
    # FSDP2 settles its units at the first forward: an optimizer built after one would break the next
    for before in ("a dry run", "an evaluation", "a bf16 evaluation"):  # (an evaluation leaves the root gathered)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if "bf16" in before else None  # (gathered: bf16 plain tensors)
        model = build_fsdp_model(ARGS, torch.device("cpu"), **({"mp_policy": mp} if mp else {}))
        with torch.set_grad_enabled(before == "a dry run"):
            loss = loss_of(model, batch(rank, 0))
        if before == "a dry run":
            loss.backward()
        with pytest.raises(ValueError, match="has run a forward already: build OffloadAdamW right after fully_shard"):
            OffloadAdamW(model.parameters(), model=model, offload=OffloadConfig(subgroup_numel=SG))
        if mp is None:  # refused before anything was cast (with mp the gathered root holds FSDP2's own bf16 copies)
            assert all(p.dtype == torch.float32 for p in model.parameters()), before
    model = build_model(rank)
    with pytest.raises(ValueError, match="pass model=model"):
        OffloadAdamW(model.parameters())
    opt = OffloadAdamW(model.parameters(), model=model, offload=OffloadConfig(subgroup_numel=SG))
    opt.step()  # no grads: nothing to do, as torch's optimizers (tests/test_torch_idioms.py)
    assert opt.step_count == 0
    with pytest.raises(RuntimeError, match="cannot be added later"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    loss_of(model, batch(rank, 0)).backward()
    # the hooks took the grads to host: what p.grad holds now refuses every read, naming the optimizer's clip
    assert all(is_held(p.grad) for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # (makes the scaler's scale, as scaling a loss does)
    with pytest.raises(RuntimeError, match=r"GradScaler .* cannot unscale .* opt\.scale_loss\(loss\)\.backward\(\)"):
        scaler.step(opt)  # (bf16 grads: its unscale_ reads them)
    opt.step()
    opt.close()
    with pytest.raises(ValueError, match="mixed device types"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, device="meta"))])
    (Path(tmp) / f"ok{rank}").touch()


def test_bad_inputs_fail_clearly(tmp_path):
    run_ranks(2, bad_input_worker, str(tmp_path))
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
