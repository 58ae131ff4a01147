"""Gradient accumulation on the GPU machine: sums kept on the GPU ("gpu") and on the host ("host") give
torch AdamW on the FP32 sums bit for bit (state off the GPU, torch kernel), handed over a param at a
time or a micro-batch's grads together (as the hooks hand over an FSDP unit's: views of one buffer, summed
one add a run), and the same bits as each other where some state lives on the GPU (Triton kernel)."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.grads import square_sum
from test_optimizer import SG, make_params

pytestmark = pytest.mark.gpu  # keeps the GPU visible to what it starts (conftest.py)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="sums on the GPU need CUDA")
STEPS, MICRO, LR, MAX_NORM = 3, 4, 1e-2, 0.5


def micro_grads(step: int) -> list[list[torch.Tensor]]:
    out = []
    for m in range(MICRO):
        g = torch.Generator().manual_seed(7 * step + m)
        out.append([torch.randn(t.shape, generator=g).bfloat16().cuda() for t in make_params()])
    return out


def as_views_of_one_buffer(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    flat = torch.cat([g.reshape(-1) for g in grads])
    views, lo = [], 0
    for g in grads:
        views.append(flat[lo : lo + g.numel()].view(g.shape))
        lo += g.numel()
    return views


def hand_over(opt: OffloadAdamW, grads: list[torch.Tensor], together: bool) -> None:
    if together:
        opt.engine.stage_grads(list(range(len(grads))), as_views_of_one_buffer(grads))
        return
    for i, g in enumerate(grads):
        opt.stage_grad(i, g)


def train(mode: str, gpu_fraction: float, tmp_path, together: bool = False) -> tuple[OffloadAdamW, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(t.cuda()) for t in make_params()]
    cfg = OffloadConfig(kernel="torch", subgroup_numel=SG, micro_batches=MICRO, grad_accumulation=mode,
                        gpu_fraction=gpu_fraction, max_grad_norm=MAX_NORM, tiers=[f"posix:{tmp_path}"],
                        host_budget_gb=(2 * 11 * SG + 6 * 11 * SG + 4 * SG + 3 * 12 * SG) / 2**30)  # fmt: skip
    opt = OffloadAdamW(params, lr=LR, offload=cfg)
    assert opt.grad_accumulation == mode
    for step in range(STEPS):
        for grads in micro_grads(step):
            hand_over(opt, grads, together)
        opt.step()
        opt.zero_grad()
    return opt, params


@needs_cuda
@pytest.mark.parametrize("together", [False, True], ids=["one_at_a_time", "together"])
@pytest.mark.parametrize("mode", ["gpu", "host"])
def test_sums_equal_torch_adamw_on_fp32_sums(mode, together, tmp_path):
    opt, _ = train(mode, 0.0, tmp_path, together)
    masters = [torch.nn.Parameter(t.clone()) for t in make_params()]
    ref = torch.optim.AdamW(masters, lr=LR, foreach=False)
    for step in range(STEPS):
        sums = None
        for grads in micro_grads(step):
            sums = [g.float() for g in grads] if sums is None else [s + g.float() for s, g in zip(sums, grads)]
        norm = math.sqrt(float(torch.stack([square_sum(s.reshape(-1)) for s in sums]).sum()))
        clip = min(1.0, MAX_NORM / (norm + 1e-6))
        for mp, s in zip(masters, sums):
            mp.grad = (s * clip if clip != 1.0 else s).cpu()
        ref.step()
    state = opt.state_dict()["state"]
    for i, mp in enumerate(masters):
        assert torch.equal(state[i]["master_param"], mp.data), f"{mode}: param {i} master differs"
        assert torch.equal(state[i]["exp_avg_sq"], ref.state[mp]["exp_avg_sq"]), f"{mode}: param {i} exp_avg_sq differs"
    opt.close()


@needs_cuda
def test_gpu_and_host_sums_agree_with_state_on_the_gpu(tmp_path):
    runs = {}
    for mode in ("gpu", "host"):
        (tmp_path / mode).mkdir()
        opt, params = train(mode, 0.5, tmp_path / mode)
        runs[mode] = ([p.detach().cpu() for p in params], opt.state_dict()["state"])
        opt.close()
    (gp, gs), (hp, hs) = runs["gpu"], runs["host"]
    for i in range(len(gp)):
        assert torch.equal(gp[i], hp[i]), f"param {i}: the model's params differ"
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(gs[i][key], hs[i][key]), f"param {i}: {key} differs"


@needs_cuda
def test_grads_handed_over_together_are_summed_in_fewer_adds(tmp_path):
    opt, _ = train("gpu", 0.0, tmp_path)
    first, second = micro_grads(0)[:2]
    hand_over(opt, first, True)  # the first grads start the sums (copies)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        hand_over(opt, second, True)
    adds = sum(e.count for e in prof.key_averages() if e.key == "aten::add_")
    # the params lie end to end in the grads' buffer and in the sums (subgroups without padding between
    # them): one add for the lot, not one a param
    assert adds == 1, (adds, len(first))
    for i in range(len(first)):
        want = first[i].float().reshape(-1) + second[i].float().reshape(-1)
        assert torch.equal(opt.grads.sums.param_sum(i).cuda(), want), f"param {i}'s sum differs"
    opt.close()
