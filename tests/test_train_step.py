"""train.py's step over several micro-batches (FSDP2, CPU, gloo, 2 ranks): with the units kept gathered
from forward to backward (`model.reshard_after_forward=false`), they stay gathered from one micro-batch
to the next and are resharded by the last backward; the losses, params and optimizer state are the
same bits as with every unit resharded, for OffloadAdamW and for torch AdamW alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import optimizer_tensors, run_ranks
from torch.distributed.tensor import DTensor

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.data import DataConfig, TokenBatches
from fsdp_offload.fsdp import local_data
from fsdp_offload.models import LlamaArgs
from fsdp_offload.parallelize import build_fsdp_model
from fsdp_offload.recipe import TrainConfig
from fsdp_offload.train_step import gathered_between_micro_batches, run_step

ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32)
MICRO, STEPS = 3, 2


def train(rank: int, world: int, reshard: bool, optimizer: str) -> dict:
    """Two steps of MICRO micro-batches; per forward of the first block, whether its params were
    sharded as the forward began (before FSDP2's own pre-hook gathers them)."""
    model = build_fsdp_model(dataclasses.replace(ARGS, reshard_after_forward=reshard), torch.device("cpu"))
    if optimizer == "offload":
        cfg = OffloadConfig(kernel="torch", subgroup_numel=4096, micro_batches=MICRO, max_grad_norm=0.5)
        opt = OffloadAdamW(model.parameters(), lr=3e-3, model=model, offload=cfg)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sharded_at_forward = []
    model.layers[0].register_forward_pre_hook(
        lambda m, _: sharded_at_forward.append(isinstance(m.attention.wq.weight, DTensor)), prepend=True)
    batches = TokenBatches(DataConfig(seq_len=16, micro_batch=2), vocab_size=ARGS.vocab_size, rank=rank, world_size=world)
    tcfg = TrainConfig(micro_batches=MICRO)
    losses = [run_step(model, opt, batches, tcfg, 0.5, torch.device("cpu"))["loss"] for _ in range(STEPS)]
    out = {"losses": losses, "sharded_at_forward": sharded_at_forward, "gathered_between": gathered_between_micro_batches(model)}
    if optimizer == "offload":
        out["state"] = optimizer_tensors(opt)  # waits for the overlapped update, which writes the params last
        opt.close()
    out["sharded_after"] = all(isinstance(p, DTensor) for p in model.parameters())
    out["params"] = [local_data(p).detach().clone() for p in model.parameters()]
    return out


def both(rank: int, world: int, optimizer: str) -> None:
    kept, resharded = train(rank, world, False, optimizer), train(rank, world, True, optimizer)
    assert kept["gathered_between"] and not resharded["gathered_between"]
    # gathered once a step, at the first micro-batch, against once every micro-batch
    assert kept["sharded_at_forward"] == [True, False, False] * STEPS
    assert resharded["sharded_at_forward"] == [True, True, True] * STEPS
    assert kept["sharded_after"] and resharded["sharded_after"]  # the step wrote the shards, nothing shadows them
    assert kept["losses"] == resharded["losses"]
    assert kept["losses"][1] != kept["losses"][0]  # the step moved the params
    for a, b in zip(kept["params"] + kept.get("state", []), resharded["params"] + resharded.get("state", [])):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer", ["offload", "torch"])
def test_units_stay_gathered_between_micro_batches_and_the_step_is_the_same_bits(optimizer):
    run_ranks(2, both, optimizer)
