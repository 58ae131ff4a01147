"""Gradient accumulation: a step's micro-batch grads are summed in FP32, in micro-batch order, and the
step equals torch AdamW on those FP32 sums bit for bit, wherever the state lives, with clipping, with
some params taking fewer grads than others, and when a second backward comes unplanned.
(On FSDP2 with gloo, test_fsdp.py's "accum" variant; the "gpu" sums, test_grad_accumulation_gpu.py.)"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.grads import square_sum
from test_optimizer import SG, assert_same_as_reference, budget_for, grads_for, groups, make_params

STEPS = 3


def micro_grads(step: int, micro: int) -> list[list[torch.Tensor]]:
    return [grads_for(100 * step + m) for m in range(micro)]


def run_accumulating(cfg: OffloadConfig, micro: int, max_norm: float | None, skip: set[tuple[int, int]] = frozenset()):
    """OffloadAdamW fed `micro` grads a param a step (as hooks feed it), and torch AdamW on their FP32
    sums, clipped by the same norm; `skip`: (micro-batch, param) pairs that give no grad."""
    init = make_params()
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = torch.optim.AdamW(groups(ref), foreach=False)
    opt = OffloadAdamW(groups(mine), offload=cfg)
    for step in range(STEPS):
        sums: list[torch.Tensor | None] = [None] * len(ref)
        for m, grads in enumerate(micro_grads(step, micro)):
            for i, g in enumerate(grads):
                if (m, i) in skip:
                    continue
                opt.stage_grad(i, g)
                sums[i] = g.float() if sums[i] is None else sums[i] + g.float()
        # as the optimizer takes it: a param's FP32 sum, or its one low-precision grad as it came
        once = [sum(1 for m in range(micro) if (m, i) not in skip) == 1 for i in range(len(ref))]
        lowp = [next(g[i] for m, g in enumerate(micro_grads(step, micro)) if (m, i) not in skip) for i in range(len(ref))]
        norm_of = [lowp[i] if once[i] else sums[i] for i in range(len(ref))]
        norm = math.sqrt(float(torch.stack([square_sum(g.reshape(-1)) for g in norm_of]).sum()))
        clip = 1.0 if max_norm is None else min(1.0, max_norm / (norm + 1e-6))
        for r, s in zip(ref, sums):
            r.grad = s * clip if clip != 1.0 else s
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        if max_norm is not None:
            assert opt.last_grad_norm == norm
    return opt, ref_opt, mine, ref


@pytest.mark.parametrize("micro", [1, 2, 8])
def test_accumulation_equals_torch_adamw_on_fp32_sums(tmp_path, micro):
    """State on disk behind a small host cache, clipping that bites: bit for bit."""
    cfg = OffloadConfig(kernel="torch", subgroup_numel=SG, micro_batches=micro, tiers=[f"posix:{tmp_path}"],
                        host_budget_gb=budget_for(3) + (6 * 11 + 4) * SG / 2**30, max_grad_norm=0.5)  # fmt: skip
    opt, ref_opt, mine, ref = run_accumulating(cfg, micro, max_norm=0.5)
    assert opt.grad_accumulation == "host"  # the params are on the CPU
    assert opt.last_grad_norm > 0.5  # the clip bit
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


def test_params_with_fewer_grads_share_subgroups_with_summed_ones():
    """Param 1 gets one grad of three, param 3 two: a subgroup holds summed params and a once-staged one."""
    cfg = OffloadConfig(kernel="torch", subgroup_numel=SG, micro_batches=3)
    opt, ref_opt, mine, ref = run_accumulating(cfg, 3, max_norm=None, skip={(0, 1), (2, 1), (1, 3)})
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


def test_an_unplanned_second_backward_is_summed_exactly_and_said(caplog):
    cfg = OffloadConfig(kernel="torch", subgroup_numel=SG)  # micro_batches=1
    with caplog.at_level(logging.WARNING, logger="fsdp_offload.grad_sums"):
        opt, ref_opt, mine, ref = run_accumulating(cfg, 2, max_norm=None)
    said = [r.getMessage() for r in caplog.records if "second backward" in r.getMessage()]
    assert len(said) == 1 and "offload.micro_batches" in said[0]
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


def test_sums_on_the_gpu_need_cuda_params():
    with pytest.raises(ValueError, match=r"grad_accumulation='gpu'.*params are on cpu.*'host'"):
        OffloadAdamW([torch.nn.Parameter(torch.ones(8))], offload=OffloadConfig(grad_accumulation="gpu", micro_batches=2))


def test_the_host_budget_counts_the_sums():
    """6 bytes a param of sums and landing buffer come out of the host budget: a budget that held three
    cache slots without accumulation is short with it, and the error says the budget's name."""
    with pytest.raises(ValueError, match="host_budget_gb"):
        OffloadAdamW(groups([torch.nn.Parameter(t) for t in make_params()]),
                     offload=OffloadConfig(kernel="torch", subgroup_numel=SG, micro_batches=2, tiers=["posix:/tmp"],
                                           host_budget_gb=budget_for(3)))  # fmt: skip


def test_overlap_backward_refuses_accumulation():
    with pytest.raises(ValueError, match="micro_batches=2"):
        OffloadConfig(overlap="backward", micro_batches=2)
    assert OffloadConfig(overlap="auto", micro_batches=2).resolved_overlap() == "next_forward"


def test_grads_summed_in_bf16_by_autograd_are_refused():
    """Without model= no hook hands each micro-batch's grad in: autograd sums them in p.grad in bf16, which
    a step promising FP32 sums refuses (before it changes anything), naming the fix."""
    p = torch.nn.Parameter(torch.ones(8))
    opt = OffloadAdamW([p], offload=OffloadConfig(kernel="torch", micro_batches=2))
    for _ in range(2):
        (p * 2).sum().backward()
    with pytest.raises(RuntimeError, match=r"summed over the micro-batches in their dtype.*pass model="):
        opt.step()
    assert torch.equal(opt.state_dict()["state"][0]["master_param"], torch.ones(8))
    opt.close()


def test_gpu_sums_need_several_micro_batches():
    with pytest.raises(ValueError, match=r"grad_accumulation='gpu'.*micro_batches=1"):
        OffloadConfig(grad_accumulation="gpu")


def cleared_between_backwards(rank: int, world: int, tmp: str) -> None:
    """model.zero_grad() between two backwards (p.grad set to None, or zeroed in place) drops the first
    one's grads, as torch does; close() leaves no held grad behind."""
    from test_fsdp import batch, build_model, loss_of

    def trained(set_to_none: bool | None) -> list[torch.Tensor]:
        model = build_model(rank)
        opt = OffloadAdamW(model.parameters(), model=model, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
        if set_to_none is not None:
            loss_of(model, batch(rank, 0)).backward()  # a bad batch, dropped
            model.zero_grad(set_to_none=set_to_none)
        loss_of(model, batch(rank, 1)).backward()
        opt.step()
        masters = [t.clone() for t in opt.full_fp32_state_dict(rank0_only=False).values()]
        opt.zero_grad()
        loss_of(model, batch(rank, 2)).backward()
        opt.close()
        assert all(p.grad is None for p in model.parameters()), "close() left held grads"
        return masters

    kept = trained(None)
    for set_to_none in (True, False):
        assert all(torch.equal(a, b) for a, b in zip(trained(set_to_none), kept)), set_to_none


def test_a_cleared_grad_is_dropped_as_torch_drops_it(tmp_path):
    from dist_utils import run_ranks

    run_ranks(2, cleared_between_backwards, str(tmp_path))


def test_a_unit_refused_for_the_workers_error_is_summed_once_when_handed_over_again(monkeypatch):
    """Host sums: a subgroup updated where its grads are (summed in place) beside one whose later grads the
    worker adds. The worker's error surfaces at the next hand-over, before anything of it is taken, so the
    unit handed over again (as UnitGrads does) is summed once, from the staged first grad."""
    import fsdp_offload.grad_sums as grad_sums
    from fsdp_offload.staging import LowpStaging
    from fsdp_offload.subgroups import SubgroupLayout

    layout, in_place = SubgroupLayout([4096, 100], 4096), frozenset({0})
    staging = LowpStaging(layout, torch.bfloat16, False, on_device=in_place, device=torch.device("cpu"))
    sums = grad_sums.GradSums(layout, staging, "host", torch.device("cpu"), in_place, planned=True)
    grads = [torch.randn(4196).bfloat16() for _ in range(3)]
    staging.stage([0, 1], [grads[0][:4096], grads[0][4096:]])
    def failing_fold(*args) -> None:
        raise RuntimeError("the worker failed")

    fold = grad_sums._fold
    monkeypatch.setattr(grad_sums, "_fold", failing_fold)
    sums.add([1], [grads[1][4096:]])
    monkeypatch.setattr(grad_sums, "_fold", fold)
    unit = [grads[2][:4096], grads[2][4096:]]  # a view each of one buffer, as the hooks hand them over
    with pytest.raises(RuntimeError, match="the worker failed"):
        sums.add([0, 1], unit)
    assert sums.summed == [False, True]  # param 0 untouched
    sums.add([0, 1], unit)
    sums.drain()
    assert torch.equal(sums.param_sum(0), grads[0][:4096].float() + grads[2][:4096].float())
    sums.close()
    staging.close()
