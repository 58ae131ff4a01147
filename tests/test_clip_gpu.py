"""Clipping on a CUDA FSDP2 model (one NCCL rank): the grad hooks take each grad's sum of squares on
the GPU (`grads.gpu_norms`, an FSDP unit's grads in one FP32-accumulating multi-tensor reduction),
which the CPU tests cannot reach. The norm a step clips by equals the one computed the same way from the same grads taken
without the hooks, bit for bit, and an FP64 norm of them to 1e-6; the overlapped and the synchronous
step clip the same way, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_on_one_gpu, trained_state

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import cast_params, local_data
from fsdp_offload.grads import square_sum
from fsdp_offload.models import LlamaArgs
from fsdp_offload.parallelize import build_fsdp_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="the grad hooks' GPU norm needs a GPU")]

ARGS = LlamaArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=128, activation_checkpointing=True)
MAX_NORM = 0.05  # below the tiny model's grad norm: every step clips
STEPS = 3


def batches(device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, ARGS.vocab_size, (2, 65), generator=g).to(device) for _ in range(STEPS)]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def reference_norms(device: torch.device, tokens: torch.Tensor) -> tuple[float, float]:
    """The first step's grad norm from the bf16 model's own grads (no hooks): as the hooks take it,
    and in FP64."""
    model = build_fsdp_model(ARGS, device)
    cast_params(model, torch.bfloat16)  # as OffloadAdamW casts it
    loss_of(model, tokens).backward()
    grads = [local_data(p.grad).reshape(-1) for p in model.parameters()]
    same_way = float(torch.stack([square_sum(g) for g in grads]).sum().sqrt())
    fp64 = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    return same_way, fp64


def train(overlap: str, device: torch.device, data: list[torch.Tensor]) -> tuple[list[float], list[torch.Tensor]]:
    model = build_fsdp_model(ARGS, device)
    cfg = OffloadConfig(subgroup_numel=1 << 16, kernel="torch", overlap=overlap, max_grad_norm=MAX_NORM)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, model=model, offload=cfg)
    norms = []
    for tokens in data:
        loss_of(model, tokens).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    out = trained_state(opt, model)
    opt.close()
    return norms, out


def reference_and_runs(tmp: str) -> None:
    device = torch.device("cuda")
    data = batches(device)
    out = {"reference": reference_norms(device, data[0])}
    for overlap in ("none", "next_forward"):
        out[overlap] = train(overlap, device, data)
    torch.save(out, f"{tmp}/out.pt")


def test_the_gpu_grad_norm_is_exact_and_clips_alike_in_every_overlap(tmp_path):
    run_on_one_gpu(reference_and_runs, str(tmp_path))
    out = torch.load(tmp_path / "out.pt")
    same_way, fp64 = out["reference"]
    sync_norms, sync_state = out["none"]
    assert sync_norms[0] == same_way  # the hooks' sums, in param order, one all-reduce: the same bits
    assert sync_norms[0] == pytest.approx(fp64, rel=1e-6)  # FP32 accumulation on the GPU is this close
    assert all(n > MAX_NORM for n in sync_norms)  # every step clipped
    norms, state = out["next_forward"]
    assert norms == sync_norms
    for i, (a, b) in enumerate(zip(state, sync_state)):
        assert torch.equal(a, b), f"tensor {i}: the overlapped step clipped differently"
