"""A client this project did not write: Hugging Face `LlamaForCausalLM` (tiny config) under FSDP2 on 2
gloo ranks, trained as its users would, with OffloadAdamW as the optimizer: `clip_grad_norm_`, an LR
scheduler, and a DCP checkpoint through torch's state-dict API in the middle, resumed into a fresh
model and optimizer. Losses and FP32 masters equal, bit for bit, an FP32-master torch AdamW reference
that computes the clip norm the same way, and the resumed run the uninterrupted one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import reference_clip, run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import cast_params

transformers = pytest.importorskip("transformers", reason="the HF integration test needs transformers (pip install -e '.[dev]')")

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
STEPS, SAVE_AFTER, LR, BETAS, WD, MAX_NORM, SG = 5, 3, 3e-3, (0.9, 0.95), 0.1, 0.5, 4096


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # FSDP2's default is the GPU where there is one
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def loss_at(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 33), generator=g)
    return model(input_ids=tokens, labels=tokens).loss


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def reference(rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build()
    names = [n for n, _ in model.named_parameters()]
    masters = [torch.nn.Parameter(p.to_local().detach().clone()) for p in model.parameters()]
    cast_params(model, torch.bfloat16)
    params = list(model.parameters())
    ref = torch.optim.AdamW(masters, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(ref, warmup)
    losses = []
    for step in range(STEPS):
        loss = loss_at(model, rank, step)
        loss.backward()
        losses.append(loss.item())
        _, clipped = reference_clip([p.grad.to_local() for p in params], MAX_NORM)
        for mp, g, p in zip(masters, clipped, params):
            mp.grad = g
            p.grad = None
        ref.step()
        sched.step()
        with torch.no_grad():
            for p, mp in zip(params, masters):
                p.to_local().copy_(mp)
    full = {}
    for name, p, mp in zip(names, params, masters):
        full[name] = torch.distributed.tensor.DTensor.from_local(
            mp.detach(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        ).full_tensor()
    return losses, full


def product(rank: int, tmp: str, steps: range, resume: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    tier = f"{tmp}/tier-{'b' if resume else 'a'}{rank}"
    os.makedirs(tier, exist_ok=True)
    model = build()
    budget = (2 * 16 * SG + 4 * 3 * SG * 4) / 2**30  # a few subgroups in memory, the rest on disk
    opt = OffloadAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, model=model,
                       offload=OffloadConfig(kernel="torch", subgroup_numel=SG, tiers=[f"posix:{tier}"], host_budget_gb=budget))  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    if resume:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{tmp}/ckpt")
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(torch.load(f"{tmp}/sched{rank}.pt"))
    losses = []
    for step in steps:
        loss = loss_at(model, rank, step)
        loss.backward()
        losses.append(loss.item())
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step + 1 == SAVE_AFTER and not resume:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{tmp}/ckpt")
            torch.save(sched.state_dict(), f"{tmp}/sched{rank}.pt")
    full = opt.full_fp32_state_dict(rank0_only=False)
    opt.close()
    return losses, full


def worker(rank: int, world: int, tmp: str) -> None:
    ref_losses, ref_masters = reference(rank)
    losses, masters = product(rank, tmp, range(STEPS), resume=False)
    assert losses == ref_losses, f"rank {rank}: losses {losses} vs the reference's {ref_losses}"
    for name, t in masters.items():
        assert torch.equal(t, ref_masters[name]), f"rank {rank}: FP32 master {name} differs from the reference's"
    if rank == 0:  # the FP32 export is a Hugging Face checkpoint: save_pretrained, then from_pretrained
        plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
        plain.load_state_dict(masters, strict=True)
        plain.save_pretrained(f"{tmp}/hf")
        loaded = transformers.LlamaForCausalLM.from_pretrained(f"{tmp}/hf", torch_dtype=torch.float32)
        for name, t in loaded.state_dict().items():
            if name in masters:
                assert torch.equal(t, masters[name]), f"{name} changed through save_pretrained/from_pretrained"
    resumed, resumed_masters = product(rank, tmp, range(SAVE_AFTER, STEPS), resume=True)
    assert resumed == losses[SAVE_AFTER:], f"rank {rank}: resumed losses {resumed} vs {losses[SAVE_AFTER:]}"
    for name, t in resumed_masters.items():
        assert torch.equal(t, masters[name]), f"rank {rank}: resumed master {name} differs"


def test_hf_llama_under_fsdp2_matches_an_fp32_master_adamw(tmp_path):
    run_ranks(2, worker, str(tmp_path))
