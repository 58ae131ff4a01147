"""torch's distributed state-dict API (what torchtitan, accelerate and the DCP tutorials call) on
OffloadAdamW under FSDP2, 2 gloo ranks: `get_optimizer_state_dict` takes nothing from the optimizer
(torch initialises an empty `opt.state` by running a zero-lr step, which would count an Adam step and
decay the moments), and a round trip through it, sharded with DCP or full from rank 0, gives a fresh
optimizer the same state bit for bit, and the same losses after."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from test_fsdp import ARGS, SG, batch, build_model, loss_of
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import local_data
from fsdp_offload.node import node_ranks
from fsdp_offload.models import Transformer

KEYS = ("step", "master_param", "exp_avg", "exp_avg_sq")


def make(rank: int, tier: str):
    os.makedirs(tier, exist_ok=True)
    model = build_model(rank)
    budget = (2 * 40 * SG + 4 * 3 * SG * 4) / 2**30  # most state on disk
    cfg = OffloadConfig(tiers=[f"posix:{tier}"], host_budget_gb=budget, subgroup_numel=SG, kernel="torch", max_grad_norm=0.5)
    return model, OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model, offload=cfg)


def train(model, opt, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        loss = loss_of(model, batch(rank, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(opt) -> list[torch.Tensor]:
    state = opt.state_dict()["state"]
    return [local_data(state[i][k]).clone() for i in range(len(state)) for k in KEYS]


def same(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: state tensor {i} ({KEYS[i % 4]}) differs"


def check_fp32_export(model, opt, osd, rank: int) -> None:
    """opt.full_fp32_state_dict() on rank 0: whole FP32 masters by name, which an unsharded FP32 copy
    of the model loads strictly, equal to the masters torch's API gathers, rounding to the model's bf16."""
    full = opt.full_fp32_state_dict()
    gathered = {fqn: s["master_param"].full_tensor() for fqn, s in osd["state"].items()}
    bf16 = {name: p.full_tensor() for name, p in model.named_parameters()}
    if rank != 0:
        assert full == {}
        return
    copy = Transformer(ARGS)
    copy.load_state_dict(full, strict=True)
    assert set(full) == set(gathered) == set(bf16)
    for name, t in full.items():
        assert t.dtype == torch.float32 and torch.equal(t, gathered[name]), name
        assert torch.equal(t.bfloat16(), bf16[name]), name


def worker(rank: int, world: int, tmp: str) -> None:
    model, opt = make(rank, f"{tmp}/a{rank}")
    assert node_ranks(dist.group.WORLD) == 2  # host_budget_gb=auto's split, counted without LOCAL_WORLD_SIZE
    # params only are cast, as FSDP2's mixed precision does: the RoPE tables stay fp32
    assert model.rope_cos.dtype == torch.float32 and model.layers[0].attention.wq.weight.dtype == torch.bfloat16
    train(model, opt, range(3), rank)
    before = snapshot(opt)
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [3] * len(before[::4])

    first = next(iter(model.parameters()))
    assert torch.equal(local_data(opt.state[first]["exp_avg"]), before[2])  # opt.state[p] reads the store
    osd = get_optimizer_state_dict(model, opt)
    same(snapshot(opt), before, "get_optimizer_state_dict changed the optimizer")
    fqn = next(iter(osd["state"]))
    assert osd["state"][fqn]["exp_avg"].shape == dict(model.named_parameters())[fqn].shape  # whole, sharded
    dcp.save({"optim": osd}, checkpoint_id=f"{tmp}/ckpt")
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    same(snapshot(opt), before, "the full get_optimizer_state_dict changed the optimizer")
    if rank == 0:
        assert not hasattr(full["state"][fqn]["exp_avg"], "device_mesh")  # plain, whole tensors
    check_fp32_export(model, opt, osd, rank)
    expected = train(model, opt, range(3, 5), rank)

    # sharded, through DCP, into a fresh model and optimizer
    model_b, opt_b = make(rank, f"{tmp}/b{rank}")
    osd_b = get_optimizer_state_dict(model_b, opt_b)
    dcp.load({"optim": osd_b}, checkpoint_id=f"{tmp}/ckpt")
    set_optimizer_state_dict(model_b, opt_b, osd_b)
    same(snapshot(opt_b), before, "sharded round trip")
    assert opt_b.step_count == 3
    assert train(model_b, opt_b, range(3, 5), rank) == expected

    # full, broadcast from rank 0
    model_c, opt_c = make(rank, f"{tmp}/c{rank}")
    set_optimizer_state_dict(model_c, opt_c, full if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))  # fmt: skip
    same(snapshot(opt_c), before, "full round trip")
    assert train(model_c, opt_c, range(3, 5), rank) == expected
    with pytest.raises(ValueError, match="an earlier OffloadAdamW cast this model"):
        OffloadAdamW(model.parameters(), model=model)
    for o in (opt, opt_b, opt_c):
        o.close()
    dist.barrier()


def test_torch_state_dict_api_round_trips_bit_for_bit(tmp_path):
    run_ranks(2, worker, str(tmp_path))
