"""The CPU update's rate learned from a run's own steps: kept in the bandwidth profile per host, key and
local rank, and what the planner predicts from on this host after that (instead of timing the kernel)."""

from __future__ import annotations

import json
import logging
import statistics

import pytest
import torch

from fsdp_offload import OffloadAdamW, OffloadConfig, machine as machine_module
from fsdp_offload.bandwidth import TierSpeed
from fsdp_offload.bandwidth_profile import BandwidthProfile
from fsdp_offload.kernels import get_adamw_kernel
from fsdp_offload.machine import MachineConfig, measured_speeds
from fsdp_offload.plan import main as plan_main
from fsdp_offload.update_rate import LEARN_STEPS, UpdateRateLearner, kernel_label, learned_update_rate, update_rate_key


def _key(ranks: int = 1, threads: int | None = None) -> str:
    return update_rate_key(kernel_label(get_adamw_kernel("torch")[1]), ranks, threads or torch.get_num_threads(), torch.bfloat16)


def test_the_profile_keeps_update_rates_beside_the_tiers_speeds(tmp_path, caplog):
    path = str(tmp_path / "p.json")
    profile = BandwidthProfile(path)
    with profile.locked():
        profile.store({"posix:/x": TierSpeed(1e9, 2e9, 0.0)}, "calibrated")
        profile.store_update_rate("k", 0, 300e6)
        profile.store_update_rate("k", 1, 200e6)
        with caplog.at_level(logging.WARNING):
            assert set(profile.load()) == {"posix:/x"}  # the tiers' entries only, none refused
        assert profile.update_rates("k") == {"0": pytest.approx(300e6), "1": pytest.approx(200e6)}
        assert profile.update_rates("other") == {}
    profile.close()
    assert caplog.text == ""
    assert learned_update_rate(path, "k") == pytest.approx(200e6)  # the slowest rank paces a step
    assert learned_update_rate(path, "other") is None


def test_a_hand_edited_rates_section_counts_as_none_and_is_rewritten(tmp_path):
    path = tmp_path / "p.json"
    profile = BandwidthProfile(str(path))
    with profile.locked():
        profile.store({}, "calibrated")
    data = json.loads(path.read_text())
    data["update_rates"] = {profile.host: {"k": {"mparams_per_s": {"0": "fast", "1": -3, "2": 150}}}, "x": []}
    path.write_text(json.dumps(data))
    with profile.locked():
        assert profile.update_rates("k") == {"2": pytest.approx(150e6)}  # the usable one only
    data["update_rates"] = ["not", "a", "dict"]
    path.write_text(json.dumps(data))
    with profile.locked():
        assert profile.update_rates("k") == {}
        profile.store_update_rate("k", 0, 100e6)
        assert profile.update_rates("k") == {"0": pytest.approx(100e6)}
    profile.close()


def test_the_learner_saves_the_median_of_the_steps_after_the_first_once(tmp_path):
    path = str(tmp_path / "p.json")
    learner = UpdateRateLearner(path, ranks=2, local_rank=1)
    seconds = [10.0, 1.0, 4.0, 2.0, 0.5]  # the first (a warm-up) and the fifth are not counted
    for s in seconds:
        learner.observe("torch", 8, torch.bfloat16, 1000, s)
    key = update_rate_key("torch", 2, 8, torch.bfloat16)
    assert LEARN_STEPS == 3 and learned_update_rate(path, key) == pytest.approx(1000 / 2.0)
    profile = BandwidthProfile(path)
    with profile.locked():
        assert set(profile.update_rates(key)) == {"1"}  # this local rank's slot
    profile.close()


def test_a_profile_path_that_cannot_hold_a_file_fails_at_construction(tmp_path):
    with pytest.raises(Exception, match="is a directory"):
        UpdateRateLearner(str(tmp_path), ranks=1, local_rank=0)


def test_a_run_saves_its_rate_and_the_next_plan_here_predicts_from_it(tmp_path, monkeypatch):
    path = str(tmp_path / "p.json")
    cfg = OffloadConfig(kernel="torch", subgroup_numel=4096, bandwidth_profile=path)
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(5000))]
    opt = OffloadAdamW(params, offload=cfg)
    for _ in range(1 + LEARN_STEPS):
        for p in params:
            p.grad = torch.randn(p.shape).bfloat16()
        opt.step()
    numel = sum(p.numel() for p in params)
    steps = opt.take_metrics()
    assert len(steps) == 1 + LEARN_STEPS
    expected = statistics.median(numel / m.cpu_kernel_s for m in steps[1:])  # the first step is a warm-up
    learned = learned_update_rate(path, _key())
    assert learned == pytest.approx(expected, rel=1e-6)  # (the profile keeps M params/s)
    monkeypatch.setattr(machine_module, "node_update_rate", lambda *a: pytest.fail("timed a rate that was learned"))
    rate, _ = measured_speeds(cfg, MachineConfig(), cpu_threads=torch.get_num_threads())
    assert (rate.source, rate.params_per_s) == ("learned", learned)
    # another rank count, or no profile: nothing learned for it, so timed
    monkeypatch.setattr(machine_module, "node_update_rate", lambda *a: 123e6)
    assert measured_speeds(cfg, MachineConfig(ranks_per_node=2), cpu_threads=torch.get_num_threads())[0].source == "timed"
    unprofiled = OffloadConfig(kernel="torch", subgroup_numel=4096)
    assert measured_speeds(unprofiled, MachineConfig(), cpu_threads=None)[0].source == "timed"


def test_the_plan_command_says_the_rate_was_learned(tmp_path, capsys):
    path = str(tmp_path / "p.json")
    common = ["train.device=cpu", "machine.host_gib=64", "offload.kernel=torch", f"offload.bandwidth_profile={path}"]
    assert plan_main(common) == 0
    assert f"a run here saves its own to {path}, and the next plan uses it" in capsys.readouterr().out
    threads = torch.get_num_threads()
    learner = UpdateRateLearner(path, ranks=1, local_rank=0)
    for _ in range(1 + LEARN_STEPS):
        learner.observe("torch", threads, torch.bfloat16, 10**9, 1.0)
    assert plan_main([*common, f"train.cpu_threads={threads}"]) == 0
    out = capsys.readouterr().out
    assert f"CPU update rate: learned from an earlier run's steps on this host ({path})" in out
    assert "1000 M params/s per rank" in out


def test_a_busy_profile_is_tried_again_and_a_broken_one_only_warns(tmp_path, caplog):
    path = str(tmp_path / "p.json")
    learner = UpdateRateLearner(path, ranks=1, local_rank=0)
    holder = BandwidthProfile(path)  # another process measuring a tier holds the profile for minutes
    with holder.locked():
        for _ in range(1 + LEARN_STEPS):
            learner.observe("torch", 4, torch.bfloat16, 1000, 1.0)  # would wait inside a step: not saved yet
    holder.close()
    key = update_rate_key("torch", 1, 4, torch.bfloat16)
    assert learned_update_rate(path, key) is None
    learner.observe("torch", 4, torch.bfloat16, 1000, 0.001)  # the next step finds it free: the kept median goes in
    assert learned_update_rate(path, key) == pytest.approx(1000.0)

    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    broken = UpdateRateLearner(str(link), ranks=1, local_rank=0)
    link.symlink_to(target)  # made a symbolic link after start-up, which the profile never follows
    with caplog.at_level(logging.WARNING):
        for _ in range(2 + LEARN_STEPS):
            broken.observe("torch", 4, torch.bfloat16, 1000, 1.0)
    assert caplog.text.count(f"cannot save the learned CPU update rate to {link}") == 1  # said once; training goes on


def test_train_predicts_its_update_from_the_rate_an_earlier_run_saved(tmp_path):
    from test_train import train

    profile = tmp_path / "p.json"
    common = ["offload=host", f"offload.bandwidth_profile={profile}", "train.steps=5"]  # (a tier would need its speeds too)
    first = train(tmp_path / "a", *common, "train.out_dir=" + str(tmp_path / "a"))
    assert "learned the CPU update rate" in first.stdout + first.stderr
    assert json.loads((tmp_path / "a" / "placement.json").read_text())["plan"]["update_s"] is None  # nothing learned yet
    second = train(tmp_path / "b", *common, "train.out_dir=" + str(tmp_path / "b"))
    planned = json.loads((tmp_path / "b" / "placement.json").read_text())["plan"]
    assert planned["update_s"] is not None and planned["update_s"] > 0
    assert f"a step predicted, from the CPU rate an earlier run saved in {profile}" in second.stdout + second.stderr
