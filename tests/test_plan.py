"""The planner (fsdp_offload.plan): its placement is the one the optimizer builds (host cache slots,
subgroups per tier) on 1 and 2 gloo ranks; a plan that does not fit names the level that is short and
by how much (host, GPU, a tier's free space); train.py refuses such a run before it builds the model;
the command prints the table and the largest preset that fits."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks
from hydra import compose, initialize_config_module
from test_fsdp import ARGS, SG

from fsdp_offload import OffloadConfig, calibrate, train
from fsdp_offload import machine as machine_module
from fsdp_offload import update_rate
from fsdp_offload.calibrate import TierSpeed
from fsdp_offload.grads import TierFP32Grads
from fsdp_offload.job_errors import JobError
from fsdp_offload.models import MODEL_PRESETS
from fsdp_offload.parallelize import build_offloaded_model
from fsdp_offload.machine import MachineConfig
from fsdp_offload.node_plan import ModelShapes, make_plan
from fsdp_offload.plans import PlanError, RankPlan
from fsdp_offload.plan import compose_plan_config, main, plan_from_config
from fsdp_offload.units import GIB
from fsdp_offload.subgroups import SubgroupLayout

README = Path(__file__).resolve().parents[1] / "README.md"


def offload(tmp: str, **kw) -> OffloadConfig:
    budget = (2 * 40 * SG + 4 * 3 * SG * 4) / 2**30  # staging plus 4 slots
    return OffloadConfig(host_budget_gb=budget, subgroup_numel=SG, prefetch=1, kernel="torch", **kw)


def _same_placement(rank: int, world: int, tmp: str) -> None:
    tiers = [f"posix:{tmp}/a{rank}", f"posix:{tmp}/b{rank}"]
    for t in tiers:
        os.makedirs(t[len("posix:"):], exist_ok=True)
    cfg = offload(tmp, tiers=tiers, placement="fixed", tier_ratios=[2.0, 1.0])
    plan = make_plan("test", ARGS, cfg, MachineConfig(ranks_per_node=world), seq_len=32, micro_batch=2, device_type="cpu")
    mine = plan.ranks[rank]
    _, opt = build_offloaded_model(ARGS, torch.device("cpu"), offload=cfg)
    assert mine.params == sum(opt.layout.numels)
    assert mine.subgroups == len(opt.layout)
    assert mine.cache_slots == opt.store.cache.num_slots < mine.subgroups
    assert mine.staging_bytes == opt.grads.staging.nbytes
    placed = [opt.store.placement.tier_for(sg) for sg in opt.store.host_subgroups]
    assert [t.subgroups for t in mine.tiers] == [placed.count(i) for i in range(len(tiers))]
    assert mine.io_s is None and mine.update_s is None  # no speeds given: nothing predicted
    opt.close()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_plan_is_the_placement_the_optimizer_builds(tmp_path, world):
    run_ranks(world, _same_placement, str(tmp_path))


def test_the_tiers_are_measured_once_a_plan(tmp_path, monkeypatch, capsys):
    """Every rank's placement, and the presets tried for the largest that fits, start from one
    measurement of each tier (none is measured per rank)."""
    measured = []

    def measure(spec, nbytes, transfer_bytes):
        measured.append(str(spec))
        return TierSpeed(3e9, 3e9, 1e-4) if str(spec).endswith("/a") else TierSpeed(1e9, 1e9, 1e-4)

    monkeypatch.setattr(calibrate, "measure_tier", measure)
    for d in "ab":
        (tmp_path / d).mkdir()
    rc = main([f"offload.tiers=[posix:{tmp_path}/a,posix:{tmp_path}/b]", "offload.subgroup_numel=4096",
               "offload.host_budget_gb=0.0003", "machine.ranks_per_node=4", "machine.host_gib=64",
               "machine.cpu_mparams_per_s=500", "train.device=cpu"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"\| [1-9]\d* sg ", out), out  # a tier is used: the placement needed the speeds
    assert sorted(measured) == [f"posix:{tmp_path}/a", f"posix:{tmp_path}/b"]


def test_a_stated_gpu_plans_a_cuda_run():
    """With train.device=auto, a stated machine.gpu_gib > 0 is a GPU run, whatever this machine has."""
    cfg, machine = compose_plan_config(["model=1b", "offload=host", "offload.gpu_fraction=0.2", "machine.gpu_gib=80",
                                        "machine.host_gib=125", "machine.cpu_mparams_per_s=500"])  # fmt: skip
    plan, _ = plan_from_config(cfg, machine)
    assert plan.gpu_bytes == 80 << 30
    assert plan.ranks[0].gpu_subgroups == round(0.2 * plan.ranks[0].subgroups) > 0


def test_gpu_share_is_refused_where_the_optimizer_refuses_it():
    """The optimizer keeps the resident state within 0.9 of the GPU memory free once the model is built
    (store.gpu_resident_subgroups), not within the whole GPU."""
    cfg = OffloadConfig(gpu_fraction=0.7)
    machine = MachineConfig(gpu_gib=79.1, host_gib=1024)
    with pytest.raises(PlanError, match=r"GPU memory, rank 0: offload\.gpu_fraction=0\.7 keeps 46 of 65 subgroups on the GPU: "
                                        r".* is free; use at most 0\.6\d\d"):  # fmt: skip
        make_plan("7b", MODEL_PRESETS["7b"], cfg, machine, 2048, 1, "cuda")
    fits = make_plan("7b", MODEL_PRESETS["7b"], dataclasses.replace(cfg, gpu_fraction=0.6), machine, 2048, 1, "cuda")
    assert fits.ranks[0].gpu_subgroups == 39


def test_grad_path_auto_keeps_the_grads_on_the_gpu_where_that_saves_tier_bytes(tmp_path, monkeypatch):
    """4 ranks of the 1.35B behind 2.5 GiB each, all state off the GPU (gpu_fraction=0): with the grads in
    host memory the cache spills; "auto" keeps them on the GPU, the cache gets their memory and the
    tier moves fewer bytes. Not where the GPU share is "auto" (it takes the GPU's room), where nothing
    spills, where the GPU has no room, or on the CPU."""
    monkeypatch.setattr(machine_module, "free_bytes", lambda path: 1 << 50)
    machine = MachineConfig(ranks_per_node=4, gpu_gib=139, host_gib=500, cpu_mparams_per_s=5000)
    speeds = [TierSpeed(2e9, 2e9, 1e-3)]

    def rank0(device: str = "cuda", m: MachineConfig = machine, **kw) -> RankPlan:
        opts = {"host_budget_gb": 2.5, "gpu_fraction": 0.0, "subgroup_numel": 26000384, "tiers": [f"posix:{tmp_path}"], **kw}
        return make_plan("1b", MODEL_PRESETS["1b"], OffloadConfig(**opts), m, 2048, 1, device, 5e9, speeds).ranks[0]

    auto, host = rank0(), rank0(grad_path="host_bf16")
    assert (auto.grad_path, host.grad_path) == ("gpu_bf16", "host_bf16")
    assert auto.cache_slots > host.cache_slots and auto.staging_bytes < host.staging_bytes
    assert auto.tiers[0].read_bytes_per_step < host.tiers[0].read_bytes_per_step and auto.io_s < host.io_s
    assert auto.memory_plan(OffloadConfig(gpu_fraction=0.0)).grad_path == "gpu_bf16"  # what the optimizer builds
    assert rank0(host_budget_gb=64).grad_path == "host_bf16"  # the cache holds every subgroup
    assert rank0(m=dataclasses.replace(machine, gpu_gib=4.5)).grad_path == "host_bf16"  # no room above gpu_headroom_gb
    assert rank0("cpu", m=dataclasses.replace(machine, gpu_gib=0)).grad_path == "host_bf16"
    # where the grads' room on the GPU would push the micro-batch sums off it, the cache would lose: kept in host memory
    small = dataclasses.replace(machine, gpu_gib=11.6)
    flip = {"host_budget_gb": 4, "micro_batches": 4}
    assert rank0(m=small, **flip, grad_path="gpu_bf16").cache_slots < rank0(m=small, **flip).cache_slots
    assert rank0(m=small, **flip).grad_path == "host_bf16"
    # the GPU's room for state ("auto" share): it goes to state where the host plan fits, though the grads would free
    # slots (as many as the state they push off the GPU: no tier byte saved, and more for the CPU to update)
    one = dataclasses.replace(machine, ranks_per_node=1, gpu_gib=16)
    share = {"gpu_fraction": "auto", "host_budget_gb": 6}
    assert spills_(host := rank0(m=one, **share, grad_path="host_bf16"))
    assert rank0(m=one, **share, grad_path="gpu_bf16").cache_slots > host.cache_slots
    assert rank0(m=one, **share).grad_path == "host_bf16"
    # a budget short of the pipeline's minimum with the grads in host memory: the GPU takes them where it can
    with pytest.raises(PlanError, match="below the pipeline's minimum"):
        rank0(m=one, host_budget_gb=2, grad_path="host_bf16")
    assert rank0(m=one, host_budget_gb=2).grad_path == "gpu_bf16"
    with pytest.raises(PlanError, match="below the pipeline's minimum"):  # no room there either: the host plan's error
        rank0(m=dataclasses.replace(one, gpu_gib=4.5), host_budget_gb=2)


def spills_(r: RankPlan) -> bool:
    return r.cache_slots < r.subgroups - r.gpu_subgroups


def test_tiers_on_one_file_system_share_its_free_space(tmp_path, monkeypatch):
    cfg = offload(str(tmp_path), tiers=[f"posix:{tmp_path}/a", f"posix:{tmp_path}/b"], placement="fixed")
    plan = lambda: make_plan("test", ARGS, cfg, MachineConfig(host_gib=64), 32, 2, "cpu")  # noqa: E731
    monkeypatch.setattr(machine_module, "free_bytes", lambda path: 1 << 50)
    need = [t.bytes for t in plan().ranks[0].tiers]
    assert all(need)
    monkeypatch.setattr(machine_module, "free_bytes", lambda path: max(need))  # room for either tier, not both
    with pytest.raises(PlanError, match=rf"tiers posix:{tmp_path}/a and posix:{tmp_path}/b: the node's ranks write up to "
                                        r".* short by .*free space, add a tier on another file system, or raise "
                                        r"offload\.host_budget_gb \(or 'auto'\)$"):  # fmt: skip
        plan()
    # the budget already as large as the machine allows ("auto" sized to the same bytes), on the CPU:
    # raising it is no fix, and no GPU share is named
    budget_gib = cfg.host_budget.nbytes / 2**30
    auto = dataclasses.replace(cfg, host_budget_gb="auto", host_headroom_gb=1.0)
    with pytest.raises(PlanError, match=r"short by .*free space, add a tier on another file system, or train a smaller "
                                        r"model or on more GPUs$"):  # fmt: skip
        make_plan("test", ARGS, auto, MachineConfig(host_gib=1.0 + budget_gib), 32, 2, "cpu")


def test_a_tier_in_memory_counts_against_host_memory(ram_dir):
    if not machine_module.file_system(str(ram_dir))[1]:
        pytest.skip(f"{ram_dir} is not tmpfs")
    cfg = offload(str(ram_dir), tiers=[f"posix:{ram_dir}"])
    plan = lambda host_gib: make_plan("test", ARGS, cfg, MachineConfig(host_gib=host_gib), 32, 2, "cpu")  # noqa: E731
    r = plan(64).ranks[0]
    assert r.tiers[0].bytes > 0
    room = (r.host_bytes + r.tiers[0].bytes // 2) / 2**30  # the optimizer's host memory, and half the tier's files
    with pytest.raises(PlanError, match=rf"host memory: .* of it the files of posix:{ram_dir} \(in memory\).* short by"):
        plan(room)


def test_fp32_grads_on_a_tier_are_planned(tmp_path):
    """grad_path="tier_fp32": each subgroup's FP32 grads are written to its tier and read back every step,
    in slots of their own, even where the host cache holds all the state."""
    cfg = OffloadConfig(tiers=[f"posix:{tmp_path}"], grad_path="tier_fp32", subgroup_numel=SG, kernel="torch")
    plan = make_plan("test", ARGS, cfg, MachineConfig(host_gib=64), 32, 2, "cpu", cpu_rate=1e9,
                     speeds=[TierSpeed(1e9, 1e9, 0.0)])  # fmt: skip
    r = plan.ranks[0]
    grads = sum(TierFP32Grads.slot_bytes(SubgroupLayout(ModelShapes.of(ARGS).local_numels(1, 0), SG)))
    assert r.cache_slots == r.subgroups  # no state on the tier
    tier = r.tiers[0]
    assert (tier.bytes, tier.read_bytes_per_step, tier.written_bytes_per_step) == (grads, grads, grads)
    assert r.grad_io_s == pytest.approx(2 * grads / 1e9)
    assert r.update_s == pytest.approx(r.cpu_s + r.grad_io_s)


def test_the_readme_s_plan_commands_run(tmp_path, monkeypatch, capsys):
    # Free space is test_tier_short_of_free_space's subject; the CPU speed is stated and the tiers are
    # measured briefly, into a profile of the test's own.
    monkeypatch.setattr(machine_module, "free_bytes", lambda path: 1 << 50)
    text = README.read_text().replace("\\\n", " ")  # a command continued over lines is one
    commands = [line for line in text.splitlines() if line.startswith("python3 -m fsdp_offload.plan ")]
    assert len(commands) >= 3 and any("machine.tier_free_gib" in c for c in commands)
    for command in commands:
        argv = shlex.split(command)[3:] + ["machine.cpu_mparams_per_s=500", "offload.calibration_gb=0.01",
                                           f"offload.bandwidth_profile={tmp_path}/bandwidth.json"]  # fmt: skip
        assert main(argv) == 0, f"{command}: {capsys.readouterr().err}"


def test_ranks_of_one_node_share_each_tier_s_bandwidth(monkeypatch):
    # Same world size and layout per rank; on one node the two ranks stream through one disk, so each
    # rank's I/O takes twice as long as with one rank on each of two nodes. The 7b's state would not fit
    # every test machine's /tmp: free space is test_tier_short_of_free_space's subject, not this one's.
    monkeypatch.setattr(machine_module, "free_bytes", lambda path: 1 << 50)
    cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=16, subgroup_numel=100 * (1 << 20), kernel="torch")
    speeds = [TierSpeed(read_bps=2e9, write_bps=2e9, latency_s=0.0)]
    plan = lambda m: make_plan("7b", MODEL_PRESETS["7b"], cfg, m, 2048, 1, "cpu", cpu_rate=1e9, speeds=speeds)  # noqa: E731
    one_node, two_nodes = plan(MachineConfig(ranks_per_node=2, host_gib=512)), plan(MachineConfig(nodes=2, host_gib=512))
    assert one_node.ranks[0].io_s == pytest.approx(2 * two_nodes.ranks[0].io_s)
    assert two_nodes.ranks[0].io_s > 0


def test_grads_kept_on_the_gpu_leave_the_host_budget_to_the_cache(monkeypatch):
    """grad_path="gpu_bf16": the host keeps two windows of one subgroup instead of every grad, so the same
    budget holds more of the FP32 state, and the GPU holds the grads instead."""
    monkeypatch.setattr(machine_module, "free_bytes", lambda path: 1 << 50)
    machine = MachineConfig(gpu_gib=80, host_gib=512)

    def plan(grad_path: str):
        cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=8, grad_path=grad_path)
        return make_plan("1b", MODEL_PRESETS["1b"], cfg, machine, 2048, 1, "cuda").ranks[0]

    host, gpu = plan("host_bf16"), plan("gpu_bf16")
    windows = 2 * 2 * 100 * (1 << 20)  # two windows of one subgroup's bf16
    assert host.staging_bytes - windows >= 2 * host.params  # every grad, bf16, and the model params' windows (split masters)
    assert gpu.staging_bytes == 2 * windows  # the grads' windows and the params'
    assert (host.cache_slots, gpu.cache_slots) == (5, 7)  # slots of 10 bytes a param (split masters)
    assert gpu.gpu_train_bytes - host.gpu_train_bytes == gpu.gpu_state_bytes == host.staging_bytes - windows


def test_host_too_small_names_the_level_and_the_shortfall():
    cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=4, subgroup_numel=100 * (1 << 20))
    with pytest.raises(PlanError, match=r"host memory, rank 0: offload\.host_budget_gb=4 is below the pipeline's minimum of"):
        make_plan("7b", MODEL_PRESETS["7b"], cfg, MachineConfig(host_gib=512), 2048, 1, "cpu")
    everything_in_host = OffloadConfig(host_budget_gb=None)
    with pytest.raises(PlanError, match=r"host memory: the node's 2 rank\(s\) keep .* GiB is stated \(train.host_memory_gb; the plan command: machine.host_gib\): short by"):
        make_plan("7b", MODEL_PRESETS["7b"], everything_in_host, MachineConfig(ranks_per_node=2, host_gib=64), 2048, 1, "cpu")


def test_training_on_the_cpu_counts_the_model_s_step_against_host_memory():
    cfg = OffloadConfig(host_budget_gb=None)  # the whole state in host memory, beside the model's step
    plan = lambda host_gib: make_plan("1b", MODEL_PRESETS["1b"], cfg, MachineConfig(host_gib=host_gib), 2048, 1, "cpu")  # noqa: E731
    r = plan(64).ranks[0]
    assert r.gpu_train_bytes > r.gpu_params_bytes > 0
    room = (r.host_bytes + r.gpu_train_bytes // 2) / 2**30  # the optimizer's state, and half the model's step
    with pytest.raises(PlanError, match=r"host memory: .* of it the model's training step on the CPU\) but .* short by .*and a tier"):
        plan(room)
    with pytest.raises(PlanError, match=r"short by .*; lower data.micro_batch or data.seq_len"):  # the step alone does not fit
        plan(r.gpu_train_bytes / 2 / 2**30)


def test_gpu_too_small_names_the_shortfall():
    cfg = OffloadConfig(tiers=["posix:/tmp"], host_budget_gb=64)
    with pytest.raises(PlanError, match=r"GPU memory, rank 0: .* of 10\.00 GiB: short by \d+\.\d\d [KMG]iB"):
        make_plan("7b", MODEL_PRESETS["7b"], cfg, MachineConfig(gpu_gib=10, host_gib=512), 2048, 1, "cuda")


def test_tier_short_of_free_space(tmp_path):
    cfg = OffloadConfig(tiers=[f"posix:{tmp_path}"], host_budget_gb=600)
    need = 280e9 * 12  # the 280b's FP32 state, nearly all of it on the tier
    if shutil.disk_usage(tmp_path).free >= need:
        pytest.skip(f"{tmp_path} has room for {need / 1e12:.1f} TB: no shortfall to show")
    with pytest.raises(PlanError, match=rf"tier posix:{tmp_path}: the node's ranks write up to .* free: short by"):
        make_plan("280b", MODEL_PRESETS["280b"], cfg, MachineConfig(host_gib=100_000), 2048, 1, "cpu")


def test_train_refuses_a_plan_that_does_not_fit_before_building(tmp_path, monkeypatch):
    def never(*args, **kw):
        raise AssertionError("the model was built")

    monkeypatch.setattr(train, "build_offloaded_model", never)
    with initialize_config_module("fsdp_offload.recipes", version_base="1.3"):
        cfg = compose("train", overrides=["offload.host_budget_gb=0.0001", f"train.out_dir={tmp_path}", "train.device=cpu"])
    # (a JobError: train.py says one rank's plan error for every rank, PlanError or not)
    with pytest.raises(JobError, match=r"host memory, rank 0: offload\.host_budget_gb=0\.0001 is below"):
        train.run(cfg)


def test_machine_memory_is_taken_in_gib_or_as_a_size():
    """machine.gpu_gib and machine.host_gib read sizes as offload.host_budget_gb does; a word is refused, naming the forms."""
    for value, gib in (("80", 80.0), ("80GB", 80e9 / GIB), ("96GiB", 96.0), ("512 MiB", 0.5)):
        assert compose_plan_config([f"machine.gpu_gib={value}", f"machine.host_gib={value}"])[1].gpu_gib == pytest.approx(gib)
    with pytest.raises(ValueError, match=r"machine\.host_gib='lots' must be GiB or a size \('1000GB', '512GiB'\)"):
        compose_plan_config(["machine.host_gib=lots"])


def test_a_machine_whose_tiers_are_not_here_is_planned_from_what_is_stated(tmp_path, capsys):
    """machine.tier_*: the planned machine's tier speeds and free space, for dirs this machine lacks; its
    free space bounds the fit, its speeds the predicted update, and a list of the wrong length is refused."""
    tier = tmp_path / "nvme" / "offload"  # not here
    base = ["offload=disk", f"offload.tiers=[posix:{tier}]", "offload.subgroup_numel=16384", "offload.host_budget_gb=900KiB", "train.device=cpu",
            "machine.host_gib=64", "machine.cpu_mparams_per_s=500", "machine.tier_read_gbps=[2.0]", "machine.tier_write_gbps=[2.5]"]  # fmt: skip
    assert main([*base, "machine.tier_free_gib=[500GB]"]) == 0
    out = capsys.readouterr().out
    assert f"posix:{tier}: placed sg" in out and "tiers:" not in out  # nothing of them measured here, so no note
    assert main([*base, "machine.tier_free_gib=[1MiB]"]) == 2
    assert f"does not fit: tier posix:{tier}: the node's ranks write up to" in capsys.readouterr().err
    assert main([*base[:-1], "machine.tier_write_gbps=[2.5,3]"]) == 2
    assert "machine.tier_write_gbps has 2 entries for the 1 offload.tiers" in capsys.readouterr().err
    assert main(base) == 2  # the speeds stated, the free space not: this machine's would be read for a dir not here
    err = capsys.readouterr().err
    assert "does not exist on this machine" in err and "state its tiers: machine.tier_free_gib=[...] (one" in err, err
    assert main(base[:-2]) == 2  # not stated: measured here, where the dir is not
    assert "does not exist" in (err := capsys.readouterr().err) and "state its tiers: machine.tier_read_gbps" in err
    assert not (tmp_path / "nvme").exists()


def test_command_prints_the_plan_and_the_largest_preset(tmp_path, capsys):
    rc = main(["offload.calibration_gb=0.01", f"offload.tiers=[posix:{tmp_path}]", "train.device=cpu", "machine.host_gib=64",
               "machine.cpu_mparams_per_s=500"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "tiny: " in out and f"posix:{tmp_path}" in out
    assert re.search(r"predicted update phase: \d+(\.\d+)? (s|ms|us) a step", out), out  # a tiny model's in ms, not "0.00 s"
    assert "predicted update phase: 0.00 s" not in out
    # what the step keeps on its device, and why (the presets' auto: host memory holds it all here)
    assert ("step: activation checkpointing off, units kept gathered from forward to backward (auto: host memory holds the step "
            "keeping the activations and the gathered units, the optimizer's state placed as without them)") in out
    assert "largest preset that fits this recipe and machine:" in out
    assert main(["offload.calibration_gb=0.01", f"offload.tiers=[posix:{tmp_path}]", "train.device=cpu", "machine.host_gib=20",
                 "machine.ranks_per_node=2", "offload.host_budget_gb=auto", "offload.host_headroom_gb=8",
                 "machine.cpu_mparams_per_s=500"]) == 0  # fmt: skip
    assert "host budget a rank: offload.host_budget_gb=auto (6.00 GiB per rank)" in capsys.readouterr().out  # (20 - 8) / 2
    assert list(tmp_path.iterdir()) == []  # the tier's speed was measured there, and nothing left
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert main(["offload.calibration_gb=0.01", f"offload.tiers=[posix:{tmp_path}/a,posix:{tmp_path}/b]", "train.device=cpu",
                 "machine.host_gib=64", "machine.cpu_mparams_per_s=500"]) == 0  # fmt: skip
    assert f"note: offload.tiers posix:{tmp_path}/a and posix:{tmp_path}/b are on one file system" in capsys.readouterr().out
    # a plan that does not fit says why and, in its next line, what does fit the same recipe and machine
    assert main(["offload.host_budget_gb=1KiB", f"offload.tiers=[posix:{tmp_path}]", "train.device=cpu", "machine.host_gib=64",
                 "machine.cpu_mparams_per_s=500"]) == 2  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("does not fit: host memory, rank 0: offload.host_budget_gb=1KiB is below the pipeline's minimum")
    assert err[1] == "largest preset that fits this recipe and machine: none"
    assert main(["offload=disk", "offload.gpu_fractoin=0.5"]) == 2  # a misspelt option: the close one named
    assert capsys.readouterr().err.strip().endswith("; did you mean offload.gpu_fraction?")
    assert main(["data=memmap", "data.pth=x"]) == 2  # a group whose recipe has a mandatory ('???') option
    assert capsys.readouterr().err.strip().endswith("; did you mean data.path?")
    assert main(["modle=15b"]) == 2
    assert capsys.readouterr().err.strip().endswith("; did you mean model?")
    assert main(["machine.gpu=3"]) == 2
    assert "machine.gpu=3: unknown machine option; known: ['cpu_mparams_per_s', 'gpu_gib'" in capsys.readouterr().err
    assert main(["machine.gpu_gb=80"]) == 2  # a misspelt machine option, and a misspelt group, get the close one too
    assert capsys.readouterr().err.strip().endswith("; did you mean machine.gpu_gib?")
    assert main(["machin.gpu_gib=80"]) == 2
    assert capsys.readouterr().err.strip().endswith("; did you mean machine.gpu_gib?")
    assert main([f"offload.tiers=[posix:{tmp_path}/missing]"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([f"offload.tiers=[posix:{tmp_path},posix:{tmp_path}/]"]) == 2  # one dir twice: refused before measuring
    assert f"both store in {tmp_path}: give each tier its own directory" in capsys.readouterr().err


def test_a_plan_that_does_not_fit_is_said_once_for_the_job(tmp_path):
    """Every rank plans the node alike: with 2 ranks the refusal is one line, not one a rank."""
    from test_train import train

    out = train(tmp_path / "run", "offload.host_budget_gb=0.0001", ranks=2, check=False)
    assert out.returncode != 0
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "error: host memory" in line]
    assert len(lines) == 1 and "offload.host_budget_gb=0.0001" in lines[0], lines


def test_the_cpu_update_is_timed_as_the_nodes_ranks_run_it(monkeypatch):
    """Each of a node's ranks is a team of its own: its own thread with its own intra-op threads, all
    teams' kernels running at once (a kernel that waits for every team's at a barrier would otherwise
    never return); the thread counts of the caller and of threads started later are left as they were."""
    import threading

    import fsdp_offload.kernels as kernels_module

    before = torch.get_num_threads()
    ranks, threads = 3, before + 1  # not this process's count: a team that kept it would be seen
    together = threading.Barrier(ranks)
    seen: list[tuple[int, int]] = []

    def kernel(p, m, v, g, out, hyper):
        seen.append((threading.get_ident(), torch.get_num_threads()))
        together.wait(timeout=60)  # returns only when every team's kernel is running

    monkeypatch.setattr(kernels_module, "get_adamw_kernel", lambda name: ("fake", kernel))
    rate = update_rate.node_update_rate("fused", 1 << 10, threads, ranks)
    assert math.isfinite(rate) and rate > 0
    assert len({ident for ident, _ in seen}) == ranks and {n for _, n in seen} == {threads}
    assert len(seen) >= ranks * (1 + update_rate.MIN_ROUNDS)  # a warm-up round, then at least MIN_ROUNDS
    assert torch.get_num_threads() == before
    started_later: list[int] = []
    later = threading.Thread(target=lambda: started_later.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert started_later == [before]  # a thread started after the timing begins with the process's count


def test_the_real_kernels_time_as_two_teams():
    for kernel in ("torch", "auto"):
        for split in (False, True):  # the step on whole masters, and on split ones
            assert 0 < update_rate.node_update_rate(kernel, 1 << 12, 1, 2, split) < math.inf


def test_a_team_whose_kernel_fails_raises_its_error_and_stops_the_others(monkeypatch):
    import threading

    import fsdp_offload.kernels as kernels_module

    def kernel(p, m, v, g, out, hyper):
        if threading.current_thread().name.endswith("_1"):
            raise MemoryError("team 1 ran out")

    monkeypatch.setattr(kernels_module, "get_adamw_kernel", lambda name: ("fake", kernel))
    with pytest.raises(MemoryError, match="team 1 ran out"):
        update_rate.node_update_rate("fused", 1 << 10, 1, 3)


def test_a_missing_tier_dir_ends_the_job_before_it_plans_said_once(tmp_path):
    from test_train import train

    out = train(tmp_path / "run", f"offload.tiers=[posix:{tmp_path}/nope]", ranks=2, check=False)
    assert out.returncode != 0  # (torchrun's own status for a failed worker)
    text = out.stdout + out.stderr
    lines = [line for line in text.splitlines() if "does not exist" in line]
    assert len(lines) == 1 and f"tier dir {tmp_path}/nope does not exist; create it" in lines[0], lines
    assert "plan:" not in text and "TierError" not in text, text[-2000:]  # (torchrun prints its own traceback)
    (tmp_path / "tier").mkdir()
    out = train(tmp_path / "run2", f"offload.tiers=[posix:{tmp_path}/tier]", f"offload.tier_lock_dir={tmp_path}/nolocks",
                ranks=2, check=False)  # fmt: skip
    text = out.stdout + out.stderr
    lines = [line for line in text.splitlines() if "does not exist" in line]
    assert len(lines) == 1 and f"offload.tier_lock_dir='{tmp_path}/nolocks'" in lines[0], lines
    assert "plan:" not in text, text[-2000:]


def _one_rank_finds_a_problem(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from fsdp_offload.job_errors import JobError, raise_on_every_rank

    with pytest.raises(JobError, match=r"^tier dir /x on this rank's node is missing \(on ranks 1\)$"):
        raise_on_every_rank("tier dir /x on this rank's node is missing" if rank == 1 else None, dist.group.WORLD)
    raise_on_every_rank(None, dist.group.WORLD)  # nothing found anywhere: nothing raised


def test_a_problem_one_rank_finds_ends_every_rank_naming_it():
    run_ranks(2, _one_rank_finds_a_problem)


def test_times_keep_their_figures_in_the_unit_that_shows_them():
    from fsdp_offload.units import format_seconds

    assert [format_seconds(t) for t in (0.0, 0.25, 0.1, 0.0022, 5e-5, 12.345)] == ["0.00 s", "0.25 s", "0.10 s", "2.2 ms", "50 us", "12.35 s"]
    assert format_seconds(float("nan")) == "nan s"


def test_a_size_in_a_unit_keeps_its_figures_without_an_exponent():
    from fsdp_offload.units import in_unit

    assert [in_unit(n * 2**20, "MiB") for n in (0.5, 512, 21200.4)] == ["0.5 MiB", "512 MiB", "21200 MiB"]


def test_the_command_says_where_the_cpu_rate_comes_from_and_a_budget_above_the_host(tmp_path, capsys):
    common = [f"offload.tiers=[posix:{tmp_path}]", "train.device=cpu", "machine.host_gib=64", "offload.calibration_gb=0.01"]
    assert main([*common, "machine.cpu_mparams_per_s=500", "offload.host_budget_gb=100"]) == 0
    out = capsys.readouterr().out
    assert "CPU update rate: timed on this machine" not in out  # stated: the rented machine's
    # the tiny model's ranks take only what their state needs: a note that says so, not an alarm
    assert ("note: offload.host_budget_gb=100 over 1 rank(s) is 100.00 GiB, more than the 64.00 GiB of host memory planned "
            "for; it fits because the ranks take only what their state needs") in out
    assert main(common) == 0
    out = capsys.readouterr().out
    assert f"CPU update rate: timed on this machine ({os.cpu_count()} cores)" in out and "machine.cpu_mparams_per_s=" in out
    assert "note: " not in out
