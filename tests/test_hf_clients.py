"""Real-client tests: Hugging Face `LlamaForCausalLM` under FSDP2 on 2 gloo ranks, as users train it,
with OffloadAdamW: tied and untied embeddings, a frozen decoder layer, and a LoRA-like adapter (a frozen
base with small trainable params beside it in the same FSDP units). Each trains a few steps clipping
through `opt.clip_grad_norm_`; losses, clip norms and the FP32 export (FP32 masters for the trained
params, the frozen params' own FP32 values, both names of a tied weight) equal, bit for bit, a torch
AdamW reference with FP32 masters, and the export loads strictly into a plain FP32 model.

Frozen params stay FP32 in the model (OffloadAdamW casts only its own): the frozen variants give their
units `MixedPrecisionPolicy(param_dtype=torch.bfloat16)` so that they compute in bf16 beside the cast
ones, as such a model must under FSDP2."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from dist_utils import reference_clip, run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import cast_params

transformers = pytest.importorskip("transformers", reason="the HF client tests need transformers (pip install -e '.[dev]')")

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
STEPS, LR, BETAS, WD, MAX_NORM, SG = 3, 3e-3, (0.9, 0.95), 0.1, 0.05, 4096  # clipping bites in every variant


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update, as PEFT's LoRA adds one."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.05)
        self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, rank) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def build(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, tie_word_embeddings=variant == "tied"))
    if variant == "frozen_layer":
        model.model.layers[0].requires_grad_(False)
    if variant == "lora":
        model.requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
            layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = {} if variant == "tied" else {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)
    return model


def loss_at(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 33), generator=g)
    return model(input_ids=tokens, labels=tokens).loss


def whole(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()


def reference(rank: int, variant: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """torch AdamW on FP32 masters of the trainable params; the model in bf16 where OffloadAdamW casts it."""
    model = build(variant)
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.to_local().detach().clone()) for p in trainable]
    cast_params(model, torch.bfloat16, trainable)
    ref = torch.optim.AdamW(masters, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_at(model, rank, step)
        loss.backward()
        losses.append(loss.item())
        norm, clipped = reference_clip([p.grad.to_local() for p in trainable], MAX_NORM)
        norms.append(norm)
        for mp, g, p in zip(masters, clipped, trainable):
            mp.grad = g
            p.grad = None
        ref.step()
        with torch.no_grad():
            for p, mp in zip(trainable, masters):
                p.to_local().copy_(mp)
    master_of = {id(p): mp for p, mp in zip(trainable, masters)}
    full = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        full[name] = whole(master_of[id(p)].detach(), p) if id(p) in master_of else p.full_tensor()
    return losses, norms, full


def product(rank: int, variant: str) -> tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, torch.dtype]]:
    model = build(variant)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = OffloadAdamW(trainable, lr=LR, betas=BETAS, weight_decay=WD, model=model,
                       offload=OffloadConfig(kernel="torch", subgroup_numel=SG))  # fmt: skip
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    losses, norms = [], []
    for step in range(STEPS):
        loss = loss_at(model, rank, step)
        loss.backward()
        losses.append(loss.item())
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    full = opt.full_fp32_state_dict(rank0_only=False)
    opt.close()
    return losses, norms, full, dtypes


def worker(rank: int, world: int, variant: str) -> None:
    ref_losses, ref_norms, ref_full = reference(rank, variant)
    losses, norms, full, dtypes = product(rank, variant)
    assert losses == ref_losses, f"rank {rank}: losses {losses} vs the reference's {ref_losses}"
    assert norms == ref_norms and norms[0] > MAX_NORM, f"rank {rank}: clip norms {norms} vs {ref_norms}"
    for name, t in ref_full.items():
        assert t.dtype == torch.float32 and torch.equal(full[name], t), f"rank {rank}: {name} differs from the reference's"
    frozen = [n for n, d in dtypes.items() if d == torch.float32]
    if variant == "tied":
        assert full["lm_head.weight"] is full["model.embed_tokens.weight"]
    assert bool(frozen) == (variant in ("frozen_layer", "lora")), f"params left FP32: {frozen}"  # only the frozen ones
    assert all("lora" not in n for n in frozen)
    if rank == 0:
        plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, tie_word_embeddings=variant == "tied"))
        if variant == "lora":
            for layer in plain.model.layers:
                layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
                layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
        plain.load_state_dict(full, strict=True)


@pytest.mark.parametrize("variant", ["untied", "tied", "frozen_layer", "lora"])
def test_hf_llama_trains_exactly_with_clipping(variant):
    run_ranks(2, worker, variant)
