"""What a step keeps on its device (fsdp_offload.step_memory): `model.activation_checkpointing` and
`model.reshard_after_forward`, either `auto`: the activations and the gathered units kept where the device
holds them with the same optimizer state on it; resolved before a model is built, and a checkpoint resumes
whichever way they resolve."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from fsdp_offload import OffloadConfig
from fsdp_offload import machine as machine_module
from fsdp_offload.checkpoint import check_checkpoint, save_checkpoint
from fsdp_offload.job_errors import JobError
from fsdp_offload.machine import MachineConfig
from fsdp_offload.models import MODEL_PRESETS, LlamaArgs, Transformer
from fsdp_offload.node_plan import make_plan
from fsdp_offload.plans import PlanError
from fsdp_offload.step_memory import fsdp_step_bytes, fsdp_step_memory, plan_step_memory, resolved, same_on_every_rank, step_overflow
from fsdp_offload.units import GIB, readable_size

AUTO = {"activation_checkpointing": "auto", "reshard_after_forward": "auto"}


def resolve(model: str, machine: MachineConfig, device: str, **offload) -> tuple[bool, bool, list[int]]:
    """How the `auto`s resolve for a preset at seq 2048, micro-batch 1: checkpointing, resharding, and
    each rank's GPU subgroups."""
    args = dataclasses.replace(MODEL_PRESETS[model], **AUTO)
    cfg = OffloadConfig(tiers=["posix:/tmp"], **offload)
    plan, chosen = plan_step_memory(args, lambda a: make_plan(model, a, cfg, machine, 2048, 1, device), cfg.gpu_headroom_gb)
    # the plan is the resolved model's
    assert (plan.activation_checkpointing, plan.reshard_after_forward) == (chosen.activation_checkpointing, chosen.reshard_after_forward)
    return chosen.activation_checkpointing, chosen.reshard_after_forward, [r.gpu_subgroups for r in plan.ranks]


@pytest.fixture(autouse=True)
def roomy_tiers(monkeypatch):
    monkeypatch.setattr(machine_module, "free_bytes", lambda path: 1 << 50)


def test_both_kept_where_the_gpu_holds_them():
    assert resolve("1b", MachineConfig(gpu_gib=80, host_gib=512), "cuda", host_budget_gb=64) == (False, False, [0])
    # the same at 4 ranks: each holds a quarter of the state, its own activations and the whole gathered model
    assert resolve("1b", MachineConfig(gpu_gib=80, host_gib=512, ranks_per_node=4), "cuda", host_budget_gb=16)[:2] == (False, False)


def test_what_the_gpu_less_its_headroom_holds_is_kept_the_activations_first():
    # the 1.35B at seq 2048, 1 rank: about 3.9 GiB a step frugal, 6.1 keeping the gathered units, 7.9 keeping
    # the activations, 10.2 both; the GPU less 4 GiB of headroom holds:
    assert resolve("1b", MachineConfig(gpu_gib=10, host_gib=512), "cuda", host_budget_gb=64) == (True, True, [0])  # 6: none
    assert resolve("1b", MachineConfig(gpu_gib=10.5, host_gib=512), "cuda", host_budget_gb=64) == (True, False, [0])  # 6.5
    assert resolve("1b", MachineConfig(gpu_gib=12, host_gib=512), "cuda", host_budget_gb=64) == (False, True, [0])  # 8
    assert resolve("1b", MachineConfig(gpu_gib=14.5, host_gib=512), "cuda", host_budget_gb=64) == (False, False, [0])  # 10.5


def test_neither_kept_where_it_would_push_optimizer_state_off_the_gpu():
    on, reshard, subgroups = resolve("7b", MachineConfig(gpu_gib=80, host_gib=512), "cuda", host_budget_gb=128, gpu_fraction="auto")
    assert on is True and reshard is True and subgroups[0] > 0
    cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=128, gpu_fraction="auto")
    for checkpointing, reshard in ((False, True), (True, False)):  # either one kept takes GPU room from the state
        kept = make_plan("7b", resolved(MODEL_PRESETS["7b"], checkpointing, reshard), cfg, MachineConfig(gpu_gib=80, host_gib=512),
                         2048, 1, "cuda")  # fmt: skip
        assert kept.ranks[0].gpu_subgroups < subgroups[0]
    # with no state on the GPU to lose, the same GPU holds the 7B's activations and its gathered units
    assert resolve("7b", MachineConfig(gpu_gib=80, host_gib=512), "cuda", host_budget_gb=128) == (False, False, [0])


def test_on_the_cpu_the_step_is_host_memory():
    assert resolve("1b", MachineConfig(host_gib=18), "cpu", host_budget_gb=8)[:2] == (False, False)
    # 16 GiB holds the state and the step keeping its activations (7.9 GiB), not both (10.2 GiB)
    assert resolve("1b", MachineConfig(host_gib=16), "cpu", host_budget_gb=8)[:2] == (False, True)
    # 14 GiB: the gathered units (6.1 GiB) only
    assert resolve("1b", MachineConfig(host_gib=14), "cpu", host_budget_gb=8)[:2] == (True, False)
    with pytest.raises(PlanError, match="short by"):  # nothing fits: the frugal step's plan says why
        resolve("1b", MachineConfig(host_gib=10), "cpu", host_budget_gb=8)


def test_a_set_value_is_kept_and_the_other_auto_resolved_beside_it():
    cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=64)
    make = lambda a: make_plan("1b", a, cfg, MachineConfig(gpu_gib=10.5, host_gib=512), 2048, 1, "cuda")  # noqa: E731
    for checkpointing in (True, False):
        for reshard in (True, False):
            args = resolved(MODEL_PRESETS["1b"], checkpointing, reshard)
            plan, chosen = plan_step_memory(args, make, 4.0)
            assert (chosen.activation_checkpointing, chosen.reshard_after_forward) == (checkpointing, reshard)
            assert plan.step_memory_why == (f"set: model.activation_checkpointing={str(checkpointing).lower()}, "
                                            f"model.reshard_after_forward={str(reshard).lower()}")  # fmt: skip
    # 6.5 GiB of room: keeping the activations (7.9 GiB) does not fit, so checkpointing stays on; resharding set
    # to auto beside it keeps the gathered units (6.1 GiB)
    plan, chosen = plan_step_memory(dataclasses.replace(MODEL_PRESETS["1b"], activation_checkpointing="auto",
                                                        reshard_after_forward=False), make, 4.0)  # fmt: skip
    assert (chosen.activation_checkpointing, chosen.reshard_after_forward) == (True, False)
    plan, chosen = plan_step_memory(dataclasses.replace(MODEL_PRESETS["1b"], activation_checkpointing=True,
                                                        reshard_after_forward="auto"), make, 4.0)  # fmt: skip
    assert (chosen.activation_checkpointing, chosen.reshard_after_forward) == (True, False)
    # checkpointing stated off: the step is 7.9 GiB either way, above the room; resharding stays the frugal one
    plan, chosen = plan_step_memory(dataclasses.replace(MODEL_PRESETS["1b"], activation_checkpointing=False,
                                                        reshard_after_forward="auto"), make, 4.0)  # fmt: skip
    assert (chosen.activation_checkpointing, chosen.reshard_after_forward) == (False, True)


def test_the_activations_not_kept_where_they_would_move_the_grads_off_the_gpu():
    """4 ranks of the 1.35B behind 2.5 GiB each, no state on the GPU: checkpointed and resharded, the grads wait
    on the GPU (grad_path=auto) and the cache gets 8 slots; keeping the activations would move them to host
    memory (6 slots, more bytes through the tier). The same GPU subgroups (none) is not enough: the state's whole
    placement counts. The gathered units (2.3 GiB more) leave it as it is."""
    machine = MachineConfig(ranks_per_node=4, gpu_gib=10.5, host_gib=500)  # the step keeping activations (6.1 GiB) fits the room
    assert resolve("1b", machine, "cuda", host_budget_gb=2.5, subgroup_numel=26000384) == (True, False, [0, 0, 0, 0])
    assert resolve("1b", dataclasses.replace(machine, gpu_gib=12), "cuda", host_budget_gb=2.5, subgroup_numel=26000384)[:2] == (False, True)


def test_the_job_takes_one_answer():
    """`agree` (train.py: same_on_every_rank) says whether every rank made this rank's choice: else every rank
    takes the frugal step."""
    args = dataclasses.replace(MODEL_PRESETS["1b"], **AUTO)
    cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=64)
    make = lambda a: make_plan("1b", a, cfg, MachineConfig(gpu_gib=80, host_gib=512), 2048, 1, "cuda")  # noqa: E731
    asked = []
    plan, chosen = plan_step_memory(args, make, 4.0, agree=lambda choice: asked.append(choice) or False)
    assert asked == [0] and (chosen.activation_checkpointing, chosen.reshard_after_forward) == (True, True)
    assert (plan.activation_checkpointing, plan.reshard_after_forward) == (True, True)
    assert plan.step_memory_why == "auto: the ranks differ: none of it is kept"
    plan, chosen = plan_step_memory(args, make, 4.0, agree=lambda choice: True)
    assert (chosen.activation_checkpointing, chosen.reshard_after_forward) == (False, False) == (plan.activation_checkpointing,
                                                                                                  plan.reshard_after_forward)  # fmt: skip


def _same_on_every_rank(rank: int, world: int) -> None:
    assert same_on_every_rank(rank, dist.group.WORLD, torch.device("cpu")) is False
    assert same_on_every_rank(2, dist.group.WORLD, torch.device("cpu")) is True
    assert same_on_every_rank(0, dist.group.WORLD, torch.device("cpu")) is True


def test_same_on_every_rank_over_gloo():
    run_ranks(2, _same_on_every_rank)


def test_plain_fsdp2_resolves_from_its_16_bytes_a_param_and_the_step():
    args = dataclasses.replace(MODEL_PRESETS["1b"], **AUTO)
    step = lambda a: fsdp_step_bytes(a, 1, 2048, 1)  # noqa: E731
    both, activations, units, frugal = (step(resolved(args, c, r)) for c, r in ((False, False), (False, True), (True, False), (True, True)))
    assert both > activations > units > frugal > 16 * 1.3e9
    assert fsdp_step_memory(args, step, both)[0] == resolved(args, False, False)
    chosen, why = fsdp_step_memory(args, step, activations)
    assert chosen == resolved(args, False, True) and why == (f"auto: about {readable_size(activations)} a rank keeping the "
                                                             f"activations, {readable_size(activations)} of room")  # fmt: skip
    assert fsdp_step_memory(args, step, units)[0] == resolved(args, True, False)
    chosen, why = fsdp_step_memory(args, step, units - 1)
    assert chosen == resolved(args, True, True) and why == (f"auto: keeping the gathered units would take about {readable_size(units)} "
                                                            f"a rank, above {readable_size(units - 1)} of room; so none of it is kept")  # fmt: skip
    chosen, why = fsdp_step_memory(args, step, both, agree=lambda choice: False)
    assert chosen == resolved(args, True, True) and why == "auto: the ranks differ: none of it is kept"
    # one stated: the other resolved beside it, the reason naming which was set
    chosen, why = fsdp_step_memory(dataclasses.replace(args, activation_checkpointing=True), step, both)
    assert chosen == resolved(args, True, False) and why.startswith("set: model.activation_checkpointing=true; auto: about ")


def test_auto_is_never_built_nor_planned_as_is_and_a_bad_value_is_named():
    for name in AUTO:
        auto = LlamaArgs(dim=64, n_layers=1, n_heads=4, vocab_size=64, **{name: "auto"})
        with pytest.raises(ValueError, match=f"model.{name}='auto' is resolved before the model is built"):
            Transformer(auto)
        with pytest.raises(ValueError, match=f"model.{name}='auto' is planned by fsdp_offload.step_memory.plan_step_memory"):
            make_plan("test", auto, OffloadConfig(), MachineConfig(host_gib=64), 32, 1, "cpu")
    for bad in ("yes", 1, 0):  # 1 == True in Python: not a choice here
        with pytest.raises(ValueError, match=f"model.activation_checkpointing={bad!r}: choose true, false or auto"):
            LlamaArgs(activation_checkpointing=bad)
        with pytest.raises(ValueError, match=re.escape(f"model.reshard_after_forward={bad!r}: choose true (gather each unit again in "
                                                       "backward), false (keep it gathered from forward to backward) or auto")):
            LlamaArgs(reshard_after_forward=bad)
    for name in AUTO:  # `model.<name>=null` on the command line: named as given
        with pytest.raises(ValueError, match=f"^model.{name}=null: choose true"):
            LlamaArgs(**{name: None})
    with pytest.raises(ValueError, match=r"^model.activation_checkpointing='yes': choose .*; model.reshard_after_forward=null: choose"):
        LlamaArgs(activation_checkpointing="yes", reshard_after_forward=None)  # both bad: both named, in one error


def test_a_checkpoint_resumes_whichever_way_the_step_resolved(tmp_path):
    """A run note keeps activation_checkpointing and reshard_after_forward (as set: true, false or auto); they
    change the compute, not the state, so a run resumes them with any value. A field that does change the
    state is named alone."""
    model = torch.nn.Linear(4, 4)
    older = {"world_size": 1, "model": {"dim": 64, "activation_checkpointing": True, "reshard_after_forward": False}}
    path = save_checkpoint(str(tmp_path), 1, model, torch.optim.AdamW(model.parameters()), older, {"step": 1})
    assert check_checkpoint(path, {"world_size": 1, "model": {"dim": 64}}) == 1
    assert check_checkpoint(path, {"world_size": 1, "model": {"dim": 64, **AUTO}}) == 1
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


def test_the_estimate_of_the_gathered_units_is_the_measured_one():
    """2.4 GiB more a step with the 1.35B's units kept gathered from forward to backward, measured on H200s at
    1 and 4 ranks (bench_scale_nvidia-h200-x4_20261127-063152.json: 10.3 against 7.9 GiB, 8.4 against 6.0)."""
    def train_gib(ranks: int, reshard: bool) -> float:
        cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=16)
        machine = MachineConfig(gpu_gib=80, host_gib=512, ranks_per_node=ranks)
        return make_plan("1b", resolved(MODEL_PRESETS["1b"], False, reshard), cfg, machine, 2048, 1, "cuda").ranks[0].gpu_train_bytes / GIB
    for ranks in (1, 4):
        assert train_gib(ranks, False) - train_gib(ranks, True) == pytest.approx(2.4, abs=0.2)
    assert train_gib(4, True) == pytest.approx(6.0, abs=0.2) and train_gib(4, False) == pytest.approx(8.4, abs=0.2)


def test_the_plan_says_why_and_warns_of_a_step_above_the_gpu():
    def why(model: str, machine: MachineConfig, device: str, **offload) -> str:
        args = dataclasses.replace(MODEL_PRESETS[model], **AUTO)
        cfg = OffloadConfig(tiers=["posix:/tmp"], **offload)
        return plan_step_memory(args, lambda a: make_plan(model, a, cfg, machine, 2048, 1, device), 4.0)[0].step_memory_why

    above = "a rank's step would take about {}, above the GPU's {} less offload.gpu_headroom_gb=4"
    assert why("1b", MachineConfig(gpu_gib=80, host_gib=512), "cuda", host_budget_gb=64) == (
        "auto: the GPU holds the step keeping the activations and the gathered units (about 10.20 GiB a rank of 80.00 GiB), "
        "the optimizer's state placed as without them")
    assert why("1b", MachineConfig(gpu_gib=12, host_gib=512), "cuda", host_budget_gb=64) == (
        "auto: keeping the activations and the gathered units, " + above.format("10.20 GiB", "12.00 GiB") + "; the GPU holds the "
        "step keeping the activations (about 7.94 GiB a rank of 12.00 GiB), the optimizer's state placed as without them")
    assert why("1b", MachineConfig(gpu_gib=10, host_gib=512), "cuda", host_budget_gb=64) == "auto: " + "; ".join(
        f"keeping {what}, " + above.format(size, "10.00 GiB")
        for what, size in (("the activations and the gathered units", "10.20 GiB"), ("the activations", "7.94 GiB"),
                           ("the gathered units", "6.12 GiB"))) + "; so none of it is kept"  # fmt: skip
    assert why("1b", MachineConfig(ranks_per_node=4, gpu_gib=10.5, host_gib=500), "cuda", host_budget_gb=2.5,
               subgroup_numel=26000384) == (
        "auto: keeping the activations and the gathered units, " + above.format("8.32 GiB", "10.50 GiB") + "; keeping the "
        "activations, rank 0's host cache slots would go from 9 to 7; the GPU holds the step keeping the gathered units (about "
        "4.87 GiB a rank of 10.50 GiB), the optimizer's state placed as without them")  # fmt: skip
    assert re.fullmatch(r"auto: keeping the activations and the gathered units, the plan does not fit: host memory: .*; keeping the "
                        r"activations, the plan does not fit: host memory: .*; host memory holds the step keeping the gathered "
                        r"units, the optimizer's state placed as without them", why("1b", MachineConfig(host_gib=14), "cpu", host_budget_gb=8))  # fmt: skip
    assert "to auto" not in why("1b", MachineConfig(host_gib=14), "cpu", host_budget_gb=8)  # (they are: the plan's advice is left out)
    assert why("1b", MachineConfig(host_gib=18), "cpu", host_budget_gb=8) == (
        "auto: host memory holds the step keeping the activations and the gathered units, the optimizer's state placed as without them")

    # an estimate above the GPU is reported, never refused: a warning that names the fixes
    big = resolved(MODEL_PRESETS["7b"], False, True)
    plan = make_plan("7b", big, OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=128), MachineConfig(gpu_gib=24, host_gib=512),
                     4096, 8, "cuda")  # fmt: skip
    assert re.fullmatch(r"rank 0's training step is estimated at [\d.]+ GiB of GPU memory, above the GPU's 24.00 GiB: lower "
                        r"data.micro_batch or data.seq_len, or offload.gpu_fraction, or set model.activation_checkpointing to auto",
                        step_overflow(plan))  # fmt: skip
    plan = make_plan("7b", resolved(MODEL_PRESETS["7b"], False, False), OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=128),
                     MachineConfig(gpu_gib=24, host_gib=512), 4096, 8, "cuda")  # fmt: skip
    assert step_overflow(plan).endswith("or set model.activation_checkpointing and model.reshard_after_forward to auto")
    assert step_overflow(make_plan("1b", resolved(MODEL_PRESETS["1b"], False, False), OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=64),
                                   MachineConfig(gpu_gib=80, host_gib=512), 2048, 1, "cuda")) is None  # fmt: skip


def gathered(unit: torch.nn.Module) -> bool:
    """Whether FSDP2 holds `unit`'s params gathered (its param groups, as fsdp_offload reads them on torch 2.11-2.13)."""
    from fsdp_offload.fsdp import _param_groups

    return all(group.is_unsharded for group in _param_groups(unit))


def sharded_model(tier: str, reshard: bool) -> tuple:
    """test_fsdp's small model on 2 gloo ranks, resharding after forward or not, and its OffloadAdamW over `tier`."""
    from test_fsdp import ARGS, SG

    from fsdp_offload.parallelize import build_offloaded_model

    os.makedirs(tier)
    cfg = OffloadConfig(tiers=[f"posix:{tier}"], subgroup_numel=SG, kernel="torch")
    return build_offloaded_model(dataclasses.replace(ARGS, reshard_after_forward=reshard), torch.device("cpu"), seed=3, offload=cfg)


def _gathered_units_train_the_same(rank: int, world: int, tmp: str) -> None:
    from test_fsdp import batch, loss_of

    from fsdp_offload.fsdp import local_data

    runs = []
    for reshard in (True, False):
        model, opt = sharded_model(f"{tmp}/{reshard}{rank}", reshard)
        losses = []
        for step in range(3):
            loss = loss_of(model, batch(rank, step))
            # after forward, before backward: each block's params stay gathered only where asked
            assert all(gathered(block) is not reshard for block in model.layers)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = opt.state_dict()["state"]
        runs.append((losses, {(i, k): local_data(v[k]).clone() for i, v in state.items() for k in ("master_param", "exp_avg")}))
        opt.close()
    (resharded, state), (kept, kept_state) = runs
    assert resharded == kept  # bit for bit
    assert all(torch.equal(state[k], kept_state[k]) for k in state)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_units_kept_gathered_train_the_same_as_resharded(tmp_path):
    run_ranks(2, _gathered_units_train_the_same, str(tmp_path))


def _eval_between_steps_reads_the_new_params(rank: int, world: int, tmp: str) -> None:
    """A forward under no_grad (an eval) leaves the units kept gathered; the step that follows writes the
    shards. The next forward must gather again: a run with an eval before each step trains as one without."""
    from test_fsdp import batch, loss_of

    runs = []
    for evals in (False, True):
        model, opt = sharded_model(f"{tmp}/{evals}{rank}", reshard=False)
        losses = []
        for step in range(3):
            loss = loss_of(model, batch(rank, step))
            loss.backward()
            if evals:
                with torch.no_grad():
                    loss_of(model, batch(rank, 7))
                assert all(gathered(block) for block in model.layers)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if evals:  # and a load of the optimizer's state after an eval: the next forward sees the loaded params
            with torch.no_grad():
                loss_of(model, batch(rank, 7))
            opt.load_state_dict(opt.state_dict())
            assert not any(gathered(block) for block in model.layers)
        losses.append(loss_of(model, batch(rank, 3)).item())
        runs.append(losses)
        opt.close()
    assert runs[0] == runs[1]  # bit for bit


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_eval_forward_between_steps_leaves_no_stale_gathered_params(tmp_path):
    run_ranks(2, _eval_between_steps_reads_the_new_params, str(tmp_path))
