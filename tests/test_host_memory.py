"""The node's host memory stated (train.host_memory_gb) where the machine adds memory as it is used and
reads less at start than it will hold: the plan, the auto budget and the plan command size from it; one
above what the memory cgroup lets the job take is refused, naming both."""

from __future__ import annotations

import hydra
import pytest
import torch
from test_job_faults import errors, our_traceback
from test_train import train

from fsdp_offload import OffloadConfig, memory
from fsdp_offload.job_errors import JobError
from fsdp_offload.units import GIB


def run_in_process(tmp_path, *overrides: str) -> list[dict]:
    from fsdp_offload.train import run

    with hydra.initialize_config_module("fsdp_offload.recipes", version_base="1.3"):
        return run(hydra.compose("train", overrides=["train.progress=false", "train.steps=1", f"train.out_dir={tmp_path}/out",
                                                     *overrides]))  # fmt: skip


def test_the_auto_budget_sizes_from_the_stated_memory(monkeypatch):
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 3 * GIB)  # what such a machine reads at start
    cfg = OffloadConfig(host_budget_gb="auto", host_headroom_gb=1)
    nbytes, name = memory.resolve_host_budget(cfg, None, torch.device("cpu"), 9 * GIB)
    assert nbytes == 8 * GIB and "9.00 GiB stated (train.host_memory_gb) less host_headroom_gb=1" in name
    nbytes, name = memory.resolve_host_budget(cfg, None, torch.device("cpu"))
    assert nbytes == 2 * GIB and "3.00 GiB available" in name


def test_a_stated_memory_above_the_cgroup_is_refused_naming_both(monkeypatch):
    monkeypatch.setattr(memory, "cgroup_available_bytes", lambda: 4 * GIB)
    said = memory.stated_host_problem(8 * GIB)
    assert said.startswith("train.host_memory_gb=8.00 GiB is more than the 4.00 GiB that this job's memory cgroup")
    assert "state at most that, or null" in said
    assert memory.stated_host_problem(4 * GIB) is None and memory.stated_host_problem(None) is None
    monkeypatch.setattr(memory, "cgroup_available_bytes", lambda: None)  # no cgroup limit: the statement stands
    assert memory.stated_host_problem(10**15) is None


@pytest.mark.bad_input
@pytest.mark.parametrize("offload", ["tiny_disk", "none"])
def test_train_refuses_a_stated_memory_above_the_cgroup_before_building(tmp_path, monkeypatch, offload):
    """The offload recipes and plain FSDP2 on the CPU alike (both size from it) refuse it before the model is built."""
    import fsdp_offload.train as train_module

    monkeypatch.setattr(memory, "cgroup_available_bytes", lambda: 2 * GIB)
    monkeypatch.setattr(train_module, "build_offloaded_model", lambda *a, **k: pytest.fail("built"))
    monkeypatch.setattr(train_module, "build_fsdp_model", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(JobError, match=r"train.host_memory_gb=3.00 GiB is more than the 2.00 GiB that this job's memory cgroup"):
        run_in_process(tmp_path, f"offload={offload}", "train.device=cpu", "train.host_memory_gb=3")


def test_plain_fsdp_on_the_cpu_sizes_its_step_from_the_stated_memory(tmp_path):
    out = train(tmp_path / "run", "offload=none", "train.host_memory_gb=1KiB", "train.steps=1")
    assert "above 1.00 KiB of room" in out.stdout + out.stderr, (out.stdout + out.stderr)[-2000:]


@pytest.mark.bad_input
def test_train_plans_against_the_stated_memory_and_says_so_once(tmp_path):
    """The 125M's state (1.5 GB) on 2 ranks of a node stated at 1 GiB: refused before anything is built, once
    for the job, naming the stated size, where this machine's own memory would have held it."""
    out = train(tmp_path / "run", "model=125m", "offload.host_budget_gb=1000", "train.host_memory_gb=1", "train.steps=1",
                ranks=2, check=False)  # fmt: skip
    said = errors(out)
    assert out.returncode != 0 and len(said) == 1, out.stderr[-2000:]
    assert "host memory: the node's 2 rank(s) keep" in said[0] and "; lower offload.host_budget_gb" in said[0], said
    assert "but 1 GiB is stated (train.host_memory_gb; the plan command: machine.host_gib)" in said[0] and not our_traceback(out)
    assert "where memory is added as it is used" not in said[0]  # (stated already)


@pytest.mark.bad_input
def test_a_bad_stated_memory_is_refused_before_the_run(tmp_path):
    out = train(tmp_path / "run", "train.host_memory_gb=lots", check=False)
    said = errors(out)
    assert out.returncode != 0 and len(said) == 1 and "train.host_memory_gb='lots' must be GiB (500) or a size" in said[0]
    from fsdp_offload.recipe import TrainConfig

    for bad in (0, -1, True, float("inf"), 1e-12, "0GB", 1e300, "1e300", 10**400):  # (1e-12 GiB: under a byte; 1e300: past a float)
        with pytest.raises(ValueError, match="train.host_memory_gb=.* must be GiB"):
            TrainConfig(host_memory_gb=bad)
    assert TrainConfig(host_memory_gb="500GB").host_memory_bytes == 500 * 10**9
    for bad in (1e300, 10**400):  # the budget's size, read by the same parser
        with pytest.raises(ValueError, match="offload.host_budget_gb="):
            OffloadConfig(host_budget_gb=bad).host_budget


@pytest.mark.bad_input
def test_the_plan_command_s_machine_options_given_to_train_name_train_s_own(tmp_path):
    out = train(tmp_path / "run", "machine.host_gib=10", check=False)
    said = errors(out)
    assert out.returncode == 2 and len(said) == 1, out.stderr[-2000:]
    assert "machine.host_gib=10: machine.* options state the machine the plan command plans for" in said[0]
    assert "train.host_memory_gb" in said[0], said


def test_the_plan_command_reads_the_stated_memory(tmp_path, capsys):
    from fsdp_offload.plan import main

    common = [f"offload.tiers=[posix:{tmp_path}]", "train.device=cpu", "machine.cpu_mparams_per_s=500", "offload.calibration_gb=0.01"]
    assert main([*common, "train.host_memory_gb=64", "offload.host_budget_gb=100"]) == 0
    assert "more than the 64.00 GiB of host memory planned for" in capsys.readouterr().out
    # the planned machine's own statement comes first
    assert main([*common, "machine.host_gib=32", "train.host_memory_gb=64", "offload.host_budget_gb=100"]) == 0
    assert "more than the 32.00 GiB of host memory planned for" in capsys.readouterr().out