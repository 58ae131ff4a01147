"""train.compile on the GPU: each block's math compiled by inductor (models.compile_blocks) trains under FSDP2
with OffloadAdamW's grad hooks and overlapped update as the eager blocks do, one graph for every block.
Apart from test_llama.py's CPU check (aot_eager, the eager kernels): inductor's own kernels round
differently, so the losses are compared within a tolerance, not bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import one_rank_group
from test_fsdp import ARGS, loss_of

from fsdp_offload import OffloadConfig
from fsdp_offload.models import compile_blocks
from fsdp_offload.parallelize import build_offloaded_model

pytestmark = pytest.mark.gpu  # keeps the GPU visible to what it starts (conftest.py)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: inductor's GPU kernels under FSDP2 on NCCL")
def test_compiled_blocks_train_as_the_eager_ones_on_the_gpu(monkeypatch):
    with one_rank_group(monkeypatch, "nccl"):
        _compiled_against_eager()


def _compiled_against_eager() -> None:
    from torch._dynamo.utils import counters

    args = dataclasses.replace(ARGS, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=1024, max_seq_len=128)
    device = torch.device("cuda")
    x = torch.randint(0, args.vocab_size, (2, 129), generator=torch.Generator().manual_seed(0)).to(device)
    losses = {}
    for compiled in (False, True):
        cfg = OffloadConfig(subgroup_numel=1 << 18, kernel="torch", max_grad_norm=1.0)
        model, opt = build_offloaded_model(args, device, seed=3, lr=1e-3, offload=cfg)
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            compile_blocks(model)
        run = []
        for _ in range(4):  # the same batch: the loss falls
            loss = loss_of(model, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        opt.close()
        losses[compiled] = run
    eager, comp = losses[False], losses[True]
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert comp[-1] < comp[0], comp
    for a, b in zip(eager, comp):
        assert abs(a - b) <= 2e-2 * abs(a), (eager, comp)
