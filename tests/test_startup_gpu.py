"""Start-up that streams, on the GPU: the same masters as the plain start-up with a GPU-resident share,
and a start-up peak well under the FP32 model's size (the plain start-up holds it whole). Apart from
test_startup.py: its gloo ranks must not see CUDA, which this module's skip condition would query."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import one_rank_group
from test_fsdp import ARGS

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import local_data
from fsdp_offload.parallelize import build_fsdp_model, build_offloaded_model

SEED = 5


pytestmark = pytest.mark.gpu  # keeps the GPU visible to what it starts (conftest.py)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the start-up's GPU peak")
def test_streamed_startup_gpu_peak_and_resident_share(tmp_path, monkeypatch):
    """On the GPU: the same weights as the plain start-up with a GPU-resident share, and a start-up peak
    well under the FP32 model's size (the plain start-up holds it whole)."""
    with one_rank_group(monkeypatch, "nccl"):
        _streamed_startup_gpu_peak_and_resident_share()


def _streamed_startup_gpu_peak_and_resident_share() -> None:
    args = dataclasses.replace(ARGS, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=4096)
    device = torch.device("cuda")
    cfg = dict(subgroup_numel=1 << 20, kernel="torch", gpu_fraction=0.5)
    torch.cuda.reset_peak_memory_stats()
    plain = build_fsdp_model(args, device, seed=SEED)
    fp32_bytes = sum(local_data(p).numel() * 4 for p in plain.parameters())
    plain_opt = OffloadAdamW(plain.parameters(), model=plain, offload=OffloadConfig(**cfg))
    plain_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model, opt = build_offloaded_model(args, device, seed=SEED, offload=OffloadConfig(**cfg))
    streamed_peak = torch.cuda.max_memory_allocated() - base
    largest_module = max(sum(p.numel() for p in m.parameters()) for _, m in model.init_modules()) * 4
    kept = fp32_bytes // 2 + sum(s.numel() for s in opt.store.gpu_state.values()) + opt.grads.staging.device_buffer.numel() * 2
    assert plain_peak >= fp32_bytes
    assert streamed_peak <= kept + 2 * largest_module + (1 << 20), (streamed_peak, kept, largest_module)
    a, b = plain_opt.full_fp32_state_dict(plain, rank0_only=False), opt.full_fp32_state_dict(model, rank0_only=False)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    plain_opt.close()
    opt.close()
