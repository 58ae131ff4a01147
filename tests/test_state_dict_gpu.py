"""torch's distributed state-dict API on a CUDA FSDP2 model (one NCCL rank): the optimizer's state
stays in host memory (DTensors whose local parts are CPU tensors, as FSDP2's CPU offload builds them),
the full state dict gathers through the GPU one tensor at a time, and a round trip is bit-exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_on_one_gpu
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_optimizer_state_dict, get_state_dict, set_optimizer_state_dict, set_state_dict,
)  # fmt: skip

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import local_data
from fsdp_offload.models import MODEL_PRESETS
from fsdp_offload.parallelize import build_fsdp_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA mesh needs a GPU")]


def make():
    model = build_fsdp_model(MODEL_PRESETS["tiny"], torch.device("cuda"))
    return model, OffloadAdamW(model.parameters(), lr=1e-3, model=model, offload=OffloadConfig(subgroup_numel=1 << 14, kernel="torch"))


def train(model, opt, steps: int) -> None:
    for _ in range(steps):
        tokens = torch.randint(0, 256, (2, 33), device="cuda")
        F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()


def assert_same_params(model, model_b) -> None:
    for p, q in zip(model.parameters(), model_b.parameters()):
        assert torch.equal(p.to_local(), q.to_local())


def round_trip() -> None:
    model, opt = make()
    train(model, opt, 3)
    before = torch.cuda.memory_allocated()
    osd = get_optimizer_state_dict(model, opt)
    for state in osd["state"].values():
        assert local_data(state["exp_avg"]).device.type == "cpu"  # host memory, not the GPU
    assert torch.cuda.memory_allocated() - before < 1 << 20
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    model_b, opt_b = make()
    set_optimizer_state_dict(model_b, opt_b, full, options=StateDictOptions(full_state_dict=True))
    a, b = opt.state_dict()["state"], opt_b.state_dict()["state"]
    for i in a:
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(local_data(a[i][key]), local_data(b[i][key])), (i, key)
    assert_same_params(model, model_b)
    opt.close()
    opt_b.close()


def test_state_dict_api_keeps_state_in_host_memory_on_a_cuda_mesh():
    run_on_one_gpu(round_trip)


def resume_both_ways() -> None:
    """torch's set_state_dict loads the optimizer (whose load writes the model's params on a side
    stream) and at once the model's bf16 state dict: the restored FP32 masters must stay, bit for bit,
    and so in the plain order (opt.load_state_dict, then model.load_state_dict)."""
    model, opt = make()
    train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    want = [local_data(opt.state[p]["master_param"]).clone() for p in model.parameters()]
    for plain in (False, True):
        model_b, opt_b = make()
        if plain:
            opt_b.load_state_dict(opt.state_dict())
            model_b.load_state_dict(msd)
        else:
            set_state_dict(model_b, opt_b, model_state_dict=msd, optim_state_dict=osd)
        got = [local_data(opt_b.state[p]["master_param"]) for p in model_b.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"plain={plain}: the restored masters did not stay"
        assert_same_params(model, model_b)
        opt_b.close()
    opt.close()


def test_a_resume_keeps_the_restored_fp32_masters_on_a_cuda_mesh():
    run_on_one_gpu(resume_both_ways)
