"""Migration both ways between torch.optim.AdamW and OffloadAdamW (FSDP2, 2 gloo ranks, DCP): a torch
AdamW run's checkpoint continues in OffloadAdamW (the FP32 model loaded first gives the masters, the
checkpoint the moments, step counts and hyperparameters, bit for bit), and OffloadAdamW writes one
that torch AdamW on the FP32 model loads (params = masters, moments and steps bit for bit) and steps on."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from test_fsdp import SG, batch, build_model, loss_of
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_state_dict

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import local_data
from fsdp_offload.torch_adamw_state import load_torch_adamw, save_for_torch_adamw

TORCH_LR, BETAS, WD = 2e-3, (0.9, 0.95), 0.1


def torch_steps(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        loss_of(model, batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()


def same_state(opt, torch_model, torch_opt, what: str) -> None:
    """OffloadAdamW's masters, moments and steps equal torch AdamW's params and state."""
    for i, p in enumerate(torch_model.parameters()):
        assert torch.equal(local_data(opt.param_state(i, "master_param")), local_data(p)), f"{what}: param {i}"
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(local_data(opt.param_state(i, key)), local_data(torch_opt.state[p][key])), f"{what}: {key} {i}"
        assert float(opt.state[opt._params[i]]["step"]) == float(torch_opt.state[p]["step"]), f"{what}: step {i}"


def worker(rank: int, world: int, tmp: str) -> None:
    # a torch AdamW run on the FP32 model, checkpointed as torch's DCP tutorials do
    torch_model = build_model(rank)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=TORCH_LR, betas=BETAS, weight_decay=WD, foreach=False)
    torch_steps(torch_model, torch_opt, rank, range(2))
    dcp.save({"model": get_model_state_dict(torch_model), "optim": get_optimizer_state_dict(torch_model, torch_opt)},
             checkpoint_id=f"{tmp}/torch")  # fmt: skip

    # into OffloadAdamW: the FP32 model first, then the optimizer on it, then the moments
    model = build_model(rank)
    msd = get_model_state_dict(model)
    dcp.load({"model": msd}, checkpoint_id=f"{tmp}/torch")
    set_model_state_dict(model, msd)
    os.makedirs(f"{tmp}/tier{rank}", exist_ok=True)
    cfg = OffloadConfig(kernel="torch", subgroup_numel=SG, tiers=[f"posix:{tmp}/tier{rank}"],
                        host_budget_gb=(2 * 40 * SG + 3 * 3 * SG * 4) / 2**30)  # fmt: skip
    opt = OffloadAdamW(model.parameters(), lr=1.0, model=model, offload=cfg)
    torch_named = r"has no 'master_param': it was not saved by OffloadAdamW \(a torch AdamW checkpoint loads with .*load_torch_adamw"
    with pytest.raises(ValueError, match=torch_named):
        opt.load_state_dict(torch_opt.state_dict())  # what a user tries first: refused, naming the way that loads it
    load_torch_adamw(model, opt, f"{tmp}/torch")
    same_state(opt, torch_model, torch_opt, "loaded from torch AdamW")
    assert opt.param_groups[0]["lr"] == TORCH_LR and tuple(opt.param_groups[0]["betas"]) == BETAS
    assert opt.param_groups[0]["weight_decay"] == WD and opt.step_count == 0
    torch_steps(model, opt, rank, range(2, 4))

    # out to torch AdamW on a fresh FP32 model
    save_for_torch_adamw(model, opt, f"{tmp}/offload")
    back = build_model(rank)
    back_opt = torch.optim.AdamW(back.parameters(), lr=1.0, foreach=False)
    msd, osd = get_model_state_dict(back), get_optimizer_state_dict(back, back_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/offload")
    set_state_dict(back, back_opt, model_state_dict=msd, optim_state_dict=osd)
    same_state(opt, back, back_opt, "written for torch AdamW")
    assert back_opt.param_groups[0]["lr"] == TORCH_LR and float(back_opt.state[next(back.parameters())]["step"]) == 4.0
    torch_steps(back, back_opt, rank, range(4, 5))
    opt.close()


def test_torch_adamw_checkpoints_migrate_both_ways(tmp_path):
    run_ranks(2, worker, str(tmp_path))


def adam_worker(rank: int, world: int, tmp: str) -> None:
    for wd in (WD, 0.0):  # torch.optim.Adam: L2 decay (decoupled_weight_decay=False), the same as AdamW's with none
        torch_model = build_model(rank)
        torch_opt = torch.optim.Adam(torch_model.parameters(), lr=TORCH_LR, weight_decay=wd, foreach=False)
        torch_steps(torch_model, torch_opt, rank, range(1))
        dcp.save({"optim": get_optimizer_state_dict(torch_model, torch_opt)}, checkpoint_id=f"{tmp}/adam{wd}")
        model = build_model(rank)
        opt = OffloadAdamW(model.parameters(), model=model, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
        if wd:
            with pytest.raises(ValueError, match=r"param group 0 decays its weights as Adam does \(L2, decoupled_weight_decay=False"):
                load_torch_adamw(model, opt, f"{tmp}/adam{wd}")
        else:
            load_torch_adamw(model, opt, f"{tmp}/adam{wd}")
            assert opt.param_groups[0]["weight_decay"] == 0.0 and float(opt.state[opt._params[0]]["step"]) == 1.0
        opt.close()


def test_a_torch_adam_checkpoint_with_l2_weight_decay_is_refused(tmp_path):
    """torch.optim.Adam's weight decay is L2 (in the grad); continued as AdamW's, the run would differ silently.
    Without weight decay the two are the same, and the checkpoint loads."""
    run_ranks(2, adam_worker, str(tmp_path))
