"""Start-up that streams: `build_offloaded_model` (the model in bf16, the FP32 init drawn one module at a
time into the optimizer's subgroups) gives the same masters and params, bit for bit, as the plain
start-up (`build_fsdp_model` in FP32, then OffloadAdamW takes its params) and as an unsharded model
initialised on one process, on 1 and 2 gloo ranks, with most subgroups on a tier; and it trains the same."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_ranks
from test_fsdp import ARGS, SG, batch, loss_of

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import local_data
from fsdp_offload.models import Transformer
from fsdp_offload.parallelize import (
    StreamedMasters,
    build_fsdp_model,
    build_offloaded_model,
)

SEED = 5


def config(tier: str, **kw) -> OffloadConfig:
    os.makedirs(tier, exist_ok=True)
    budget = (2 * 40 * SG + 4 * 3 * SG * 4) / 2**30  # staging plus 4 slots: most subgroups on the tier
    return OffloadConfig(tiers=[f"posix:{tier}"], host_budget_gb=budget, subgroup_numel=SG, prefetch=1, kernel="torch", **kw)


def reference() -> dict[str, torch.Tensor]:
    """The unsharded model's init on one process: what every start-up must give."""
    model = Transformer(ARGS)
    torch.manual_seed(SEED)
    model.init_weights()
    return model.state_dict()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _same_start(rank: int, world: int, tmp: str) -> None:
    plain = build_fsdp_model(ARGS, torch.device("cpu"), seed=SEED)
    plain_opt = OffloadAdamW(plain.parameters(), model=plain, offload=config(f"{tmp}/plain{rank}"))
    model, opt = build_offloaded_model(ARGS, torch.device("cpu"), seed=SEED, offload=config(f"{tmp}/streamed{rank}"))
    assert opt.store.cache.num_slots < len(opt.layout)  # the fill wrote most subgroups to the tier
    ref = reference()
    masters, plain_masters = opt.full_fp32_state_dict(model, rank0_only=False), plain_opt.full_fp32_state_dict(plain, rank0_only=False)
    assert masters.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.equal(masters[name], value), name  # FP32 init, any world size
        assert torch.equal(plain_masters[name], value), name
    params, plain_params = full_params(model), full_params(plain)
    for name, value in ref.items():
        assert params[name].dtype == torch.bfloat16
        assert torch.equal(params[name], value.to(torch.bfloat16)), name
        assert torch.equal(plain_params[name], params[name]), name
    assert torch.equal(model.rope_cos, plain.rope_cos) and model.rope_cos.dtype == torch.float32
    # and they train the same: 3 steps, losses and masters bit for bit
    for step in range(3):
        losses = []
        for m, o in ((plain, plain_opt), (model, opt)):
            loss = loss_of(m, batch(rank, 0))
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)
    a, b = plain_opt.state_dict()["state"], opt.state_dict()["state"]
    for i in a:
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(local_data(a[i][key]), local_data(b[i][key])), (i, key)
    plain_opt.close()
    opt.close()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_streamed_startup_equals_plain_and_unsharded(tmp_path, world):
    run_ranks(world, _same_start, str(tmp_path))


def _zeros_then_load(rank: int, world: int, tmp: str) -> None:
    """init=False draws nothing (a resumed run): the masters are zeros until a load overwrites them."""
    model, opt = build_offloaded_model(ARGS, torch.device("cpu"), seed=SEED, init=False, offload=config(f"{tmp}/z{rank}"))
    masters = opt.full_fp32_state_dict(model, rank0_only=False)
    assert all(not v.any() for v in masters.values())
    _, src_opt = build_offloaded_model(ARGS, torch.device("cpu"), seed=SEED, offload=config(f"{tmp}/s{rank}"))
    opt.load_state_dict(src_opt.state_dict())
    for name, value in reference().items():
        assert torch.equal(opt.full_fp32_state_dict(model, rank0_only=False)[name], value), name
        assert torch.equal(full_params(model)[name], value.to(torch.bfloat16)), name
    opt.close()
    src_opt.close()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_resume_start_draws_nothing_and_loads(tmp_path):
    run_ranks(2, _zeros_then_load, str(tmp_path))


def test_streamed_masters_refuse_params_out_of_order():
    """The source hands out each param once the init has drawn it; asking for one it drew past is an error."""
    with torch.device("meta"):
        model = Transformer(ARGS)  # plain params (no process group)
    model.to_empty(device="cpu")
    masters = StreamedMasters(model, torch.device("cpu"), SEED)
    params = list(model.parameters())
    masters(params[1])
    with pytest.raises(RuntimeError, match=r"model\.parameters\(\) order"):
        masters(params[0])


def _cpu_run_where_a_gpu_is(rank: int, world: int, tmp: str) -> None:
    # What a GPU machine reports: FSDP2's default mesh would then be a CUDA one, even for a CPU run.
    torch._C._get_accelerator = lambda: torch.device("cuda")
    model, opt = build_offloaded_model(ARGS, torch.device("cpu"), seed=SEED, offload=config(f"{tmp}/r{rank}"))
    for name, param in model.named_parameters():
        assert param.device_mesh.device_type == "cpu" and local_data(param).device.type == "cpu", name
    opt.close()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_cpu_run_shards_on_the_cpu_where_a_gpu_is(tmp_path):
    run_ranks(2, _cpu_run_where_a_gpu_is, str(tmp_path))
