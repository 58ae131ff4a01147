"""`model.activation_checkpointing: auto` (fsdp_offload.checkpointing): off where the device holds the
step's activations with the same optimizer state on it, else on; resolved before a model is built, and
a checkpoint resumes whichever way it resolves."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from fsdp_offload import OffloadConfig
from fsdp_offload import machine as machine_module
from fsdp_offload.checkpoint import check_checkpoint, save_checkpoint
from fsdp_offload.checkpointing import any_rank, fsdp_checkpointing, fsdp_step_bytes, plan_checkpointing, resolved, step_overflow
from fsdp_offload.job_errors import JobError
from fsdp_offload.machine import MachineConfig
from fsdp_offload.models import MODEL_PRESETS, LlamaArgs, Transformer
from fsdp_offload.node_plan import PlanError, make_plan
from fsdp_offload.units import GIB, readable_size


def resolve(model: str, machine: MachineConfig, device: str, **offload) -> tuple[bool, list[int]]:
    """How `auto` resolves for a preset at seq 2048, micro-batch 1: the choice, and each rank's GPU subgroups."""
    args = dataclasses.replace(MODEL_PRESETS[model], activation_checkpointing="auto")
    cfg = OffloadConfig(tiers=["posix:/tmp"], **offload)
    plan, resolved = plan_checkpointing(args, lambda a: make_plan(model, a, cfg, machine, 2048, 1, device), cfg.gpu_headroom_gb)
    assert plan.activation_checkpointing == resolved.activation_checkpointing  # the plan is the resolved model's
    return resolved.activation_checkpointing, [r.gpu_subgroups for r in plan.ranks]


@pytest.fixture(autouse=True)
def roomy_tiers(monkeypatch):
    monkeypatch.setattr(machine_module, "free_bytes", lambda path: 1 << 50)


def test_off_where_the_gpu_holds_the_activations():
    assert resolve("1b", MachineConfig(gpu_gib=80, host_gib=512), "cuda", host_budget_gb=64) == (False, [0])
    # the same at 4 ranks: each holds a quarter of the state and its own activations
    assert resolve("1b", MachineConfig(gpu_gib=80, host_gib=512, ranks_per_node=4), "cuda", host_budget_gb=16)[0] is False


def test_on_where_the_activations_would_pass_the_gpu_less_its_headroom():
    # 1.35B at seq 2048: about 3.9 GiB a step with checkpointing, 7.9 without; 10 GiB less 4 of headroom holds only the first
    assert resolve("1b", MachineConfig(gpu_gib=10, host_gib=512), "cuda", host_budget_gb=64) == (True, [0])


def test_on_where_the_activations_would_push_optimizer_state_off_the_gpu():
    on, subgroups = resolve("7b", MachineConfig(gpu_gib=80, host_gib=512), "cuda", host_budget_gb=128, gpu_fraction="auto")
    assert on is True and subgroups[0] > 0
    args = dataclasses.replace(MODEL_PRESETS["7b"], activation_checkpointing=False)
    cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=128, gpu_fraction="auto")
    off = make_plan("7b", args, cfg, MachineConfig(gpu_gib=80, host_gib=512), 2048, 1, "cuda")
    assert off.ranks[0].gpu_subgroups < subgroups[0]  # what checkpointing keeps on the GPU
    # with no state on the GPU to lose, the same GPU holds the 7B's activations
    assert resolve("7b", MachineConfig(gpu_gib=80, host_gib=512), "cuda", host_budget_gb=128)[0] is False


def test_on_the_cpu_the_activations_are_host_memory():
    assert resolve("1b", MachineConfig(host_gib=18), "cpu", host_budget_gb=8)[0] is False
    # 14 GiB holds the state and a checkpointed step (3.9 GiB), not the step without it (7.9 GiB)
    assert resolve("1b", MachineConfig(host_gib=14), "cpu", host_budget_gb=8)[0] is True
    with pytest.raises(PlanError, match="short by"):  # neither fits: the plan with checkpointing says why
        resolve("1b", MachineConfig(host_gib=10), "cpu", host_budget_gb=8)


def test_a_set_value_is_kept():
    for value in (True, False):
        args = dataclasses.replace(MODEL_PRESETS["1b"], activation_checkpointing=value)
        cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=64)
        plan, resolved = plan_checkpointing(args, lambda a: make_plan("1b", a, cfg, MachineConfig(gpu_gib=10, host_gib=512),
                                                                      2048, 1, "cuda"), 4.0)  # fmt: skip
        assert resolved.activation_checkpointing is value and plan.activation_checkpointing is value


def test_on_where_the_activations_would_move_the_grads_off_the_gpu():
    """4 ranks of the 1.35B behind 2.5 GiB each, no state on the GPU: with checkpointing the grads wait on the
    GPU (grad_path=auto) and the cache gets 8 slots; without it they would move to host memory (6 slots, more
    bytes through the tier). The same GPU subgroups (none) is not enough: the state's whole placement counts."""
    machine = MachineConfig(ranks_per_node=4, gpu_gib=10.5, host_gib=500)  # the step without it (6.1 GiB) fits the room
    assert resolve("1b", machine, "cuda", host_budget_gb=2.5, subgroup_numel=26000384) == (True, [0, 0, 0, 0])
    assert resolve("1b", dataclasses.replace(machine, gpu_gib=12), "cuda", host_budget_gb=2.5, subgroup_numel=26000384)[0] is False


def test_the_job_takes_one_answer():
    """`agree` (train.py: an all-reduce over the ranks) turns it on where any rank needs it."""
    args = dataclasses.replace(MODEL_PRESETS["1b"], activation_checkpointing="auto")
    cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=64)
    make = lambda a: make_plan("1b", a, cfg, MachineConfig(gpu_gib=80, host_gib=512), 2048, 1, "cuda")  # noqa: E731
    asked = []
    plan, resolved = plan_checkpointing(args, make, 4.0, agree=lambda on: asked.append(on) or True)
    assert asked == [False] and resolved.activation_checkpointing is True and plan.activation_checkpointing is True


def _any_rank(rank: int, world: int) -> None:
    assert any_rank(rank == 1, dist.group.WORLD, torch.device("cpu")) is True
    assert any_rank(False, dist.group.WORLD, torch.device("cpu")) is False


def test_any_rank_over_gloo():
    run_ranks(2, _any_rank)


def test_plain_fsdp2_resolves_from_its_16_bytes_a_param_and_the_step():
    args = dataclasses.replace(MODEL_PRESETS["1b"], activation_checkpointing="auto")
    step = lambda a: fsdp_step_bytes(a, 1, 2048, 1)  # noqa: E731
    without = step(dataclasses.replace(args, activation_checkpointing=False))
    assert without > step(dataclasses.replace(args, activation_checkpointing=True)) > 16 * 1.3e9
    assert fsdp_checkpointing(args, step, without)[0].activation_checkpointing is False
    resolved, why = fsdp_checkpointing(args, step, without - 1)
    assert resolved.activation_checkpointing is True and why.startswith(f"auto: about {readable_size(without)} a rank without it")
    resolved, why = fsdp_checkpointing(args, step, without, agree=lambda on: True)
    assert resolved.activation_checkpointing is True and why == "auto: another rank needs it"


def test_auto_is_never_built_nor_planned_as_is_and_a_bad_value_is_named():
    auto = LlamaArgs(dim=64, n_layers=1, n_heads=4, vocab_size=64, activation_checkpointing="auto")
    with pytest.raises(ValueError, match="resolved before the model is built"):
        Transformer(auto)
    with pytest.raises(ValueError, match="planned by fsdp_offload.checkpointing.plan_checkpointing"):
        make_plan("test", auto, OffloadConfig(), MachineConfig(host_gib=64), 32, 1, "cpu")
    for bad in ("yes", 1, 0):  # 1 == True in Python: not a choice here
        with pytest.raises(ValueError, match=f"model.activation_checkpointing={bad!r}: choose true, false or auto"):
            LlamaArgs(activation_checkpointing=bad)


def test_a_checkpoint_resumes_whichever_way_checkpointing_resolved(tmp_path):
    """A run note keeps activation_checkpointing (as set: true, false or auto); it changes the compute, not
    the state, so a run resumes it with any value. A field that does change the state is named alone."""
    model = torch.nn.Linear(4, 4)
    older = {"world_size": 1, "model": {"dim": 64, "activation_checkpointing": True}}
    path = save_checkpoint(str(tmp_path), 1, model, torch.optim.AdamW(model.parameters()), older, {"step": 1})
    assert check_checkpoint(path, {"world_size": 1, "model": {"dim": 64}}) == 1
    assert check_checkpoint(path, {"world_size": 1, "model": {"dim": 64, "activation_checkpointing": "auto"}}) == 1
    with pytest.raises(JobError, match=r"written with model.dim=64, this run has model.dim=128: resume with the same model.dim"):
        check_checkpoint(path, {"world_size": 1, "model": {"dim": 128}})
    # a field on one side only is a difference too, named with what the other side has: nothing
    with pytest.raises(JobError, match=r"written with model.n_layers=nothing, this run has model.n_layers=2"):
        check_checkpoint(path, {"world_size": 1, "model": {"dim": 64, "n_layers": 2}})
    with pytest.raises(JobError, match=r"written with model.dim=64, this run has model.dim=nothing"):
        check_checkpoint(path, {"world_size": 1, "model": {}})


def test_the_estimate_without_checkpointing_is_the_measured_one():
    """4.1 GiB more a step without checkpointing for the 1.35B at seq 2048 (24 blocks), measured on H100s
    at 1 and 4 ranks (bench_scale_nvidia-h200-x4_20261127-021724.json: 7.9 against 3.8 GiB, 6.0 against 1.9)."""
    def train_gib(checkpointing: bool) -> float:
        args = dataclasses.replace(MODEL_PRESETS["1b"], activation_checkpointing=checkpointing)
        cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=64)
        return make_plan("1b", args, cfg, MachineConfig(gpu_gib=80, host_gib=512), 2048, 1, "cuda").ranks[0].gpu_train_bytes / GIB
    assert train_gib(False) - train_gib(True) == pytest.approx(4.1, abs=0.2)


def test_the_plan_says_why_and_warns_of_a_step_above_the_gpu():
    def why(model: str, machine: MachineConfig, device: str, **offload) -> str:
        args = dataclasses.replace(MODEL_PRESETS[model], activation_checkpointing="auto")
        cfg = OffloadConfig(tiers=["posix:/tmp"], **offload)
        return plan_checkpointing(args, lambda a: make_plan(model, a, cfg, machine, 2048, 1, device), 4.0)[0].checkpointing_why

    assert why("1b", MachineConfig(gpu_gib=80, host_gib=512), "cuda", host_budget_gb=64).startswith(
        "auto: the GPU holds the step without it (about 7.94 GiB a rank of 80.00 GiB), the state placed alike")
    assert why("1b", MachineConfig(gpu_gib=10, host_gib=512), "cuda", host_budget_gb=64) == (
        "auto: without it a rank's step would take about 7.94 GiB, above the GPU's 10.00 GiB less offload.gpu_headroom_gb=4")
    assert why("1b", MachineConfig(ranks_per_node=4, gpu_gib=10.5, host_gib=500), "cuda", host_budget_gb=2.5,
               subgroup_numel=26000384) == "auto: without it rank 0's host cache slots would go from 8 to 6"  # fmt: skip
    assert why("1b", MachineConfig(host_gib=14), "cpu", host_budget_gb=8).startswith("auto: without it the plan does not fit: host memory")
    assert why("1b", MachineConfig(host_gib=18), "cpu", host_budget_gb=8) == "auto: host memory holds the step without it, the state placed alike"

    # an estimate above the GPU is reported, never refused: a warning that names the fixes
    big = dataclasses.replace(MODEL_PRESETS["7b"], activation_checkpointing=False)
    plan = make_plan("7b", big, OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=128), MachineConfig(gpu_gib=24, host_gib=512),
                     4096, 8, "cuda")  # fmt: skip
    assert re.fullmatch(r"rank 0's training step is estimated at [\d.]+ GiB of GPU memory, above the GPU's 24.00 GiB: lower "
                        r"data.micro_batch or data.seq_len, or offload.gpu_fraction, or set model.activation_checkpointing=auto",
                        step_overflow(plan))  # fmt: skip
    assert step_overflow(make_plan("1b", resolved(MODEL_PRESETS["1b"], False), OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=64),
                                   MachineConfig(gpu_gib=80, host_gib=512), 2048, 1, "cuda")) is None  # fmt: skip
