"""The CPU update's rate learned from a run's own steps: kept in the bandwidth profile per host, key, run
and local rank, and what the planner and train.py predict from on this host after that."""

from __future__ import annotations

import json
import logging
import os
import statistics

import pytest
import torch

from fsdp_offload import OffloadAdamW, OffloadConfig, machine as machine_module
from fsdp_offload import update_costs as update_costs_module
from fsdp_offload.bandwidth import TierSpeed
from fsdp_offload.bandwidth_profile import BandwidthProfile, locked_profile
from fsdp_offload.learned_rate import LEARN_STEPS, UpdateRateLearner, learned_rate_for, rate_key_for, update_rate_key
from fsdp_offload.machine import MachineConfig, cpu_rate
from fsdp_offload.plan import main as plan_main
from fsdp_offload.update_costs import UpdateCosts, learned_walk, measured_costs

BF16 = torch.bfloat16


def learn(path: str, rate: float, ranks: int = 1, slot: int = 0, run: str = "run-a", threads: int = 4, numel: int = 4096,
          kernel: str = "torch", walk_s: float | None = None) -> None:  # fmt: skip
    """A run's rank that updated at `rate` params/s from its first step on, `walk_s` a subgroup beside its kernel."""
    learner = UpdateRateLearner(path, ranks, slot, run, numel)
    for _ in range(1 + LEARN_STEPS):
        learner.observe(kernel, threads, BF16, int(rate), 1.0, walk_s)


def cfg_for(path: str, numel: int = 4096, **kw) -> OffloadConfig:
    return OffloadConfig(kernel="torch", subgroup_numel=numel, bandwidth_profile=path, **kw)


def test_the_profile_keeps_one_run_s_rates_beside_the_tiers_speeds(tmp_path, caplog):
    path = str(tmp_path / "p.json")
    profile = BandwidthProfile(path)
    with profile.locked():
        profile.store({"posix:/x": TierSpeed(1e9, 2e9, 0.0)}, "calibrated")
        profile.store_update_rate("k", "run-a", 0, 300e6)
        profile.store_update_rate("k", "run-a", 1, 200e6)
        with caplog.at_level(logging.WARNING):
            assert set(profile.load()) == {"posix:/x"}  # the tiers' entries only, none refused
        run, rates, _ = profile.update_rate_entry("k")
        assert run == "run-a" and rates == {"0": pytest.approx(300e6), "1": pytest.approx(200e6)}
        profile.store_update_rate("k", "run-b", 1, 100e6)  # a new run's first save clears the last run's ranks
        assert profile.update_rate_entry("k")[:2] == ("run-b", {"1": pytest.approx(100e6)})
        assert profile.update_rate_keys() == ["k"]
    profile.close()
    assert caplog.text == ""


def test_the_slowest_rank_of_the_last_whole_run_is_learned(tmp_path):
    path = str(tmp_path / "p.json")
    cfg = cfg_for(path)
    key_threads = 4
    learn(path, 300e6, ranks=2, slot=0, run="a", threads=key_threads)
    assert learned_rate_for(cfg, 2, key_threads) is None  # rank 1 of that run saved nothing: no rate, timed
    learn(path, 200e6, ranks=2, slot=1, run="a", threads=key_threads)
    got = learned_rate_for(cfg, 2, key_threads)
    assert got.source == "learned" and got.params_per_s == pytest.approx(200e6)  # a step's update is its slowest rank's
    assert rate_key_for(cfg, 2, key_threads) in got.detail
    learn(path, 500e6, ranks=2, slot=0, run="b", threads=key_threads)  # a later run, cut short after rank 0 saved
    assert learned_rate_for(cfg, 2, key_threads) is None  # never rank 0 of one run beside rank 1 of another
    # another rank count, thread count or subgroup size has its own key
    assert learned_rate_for(cfg, 1, key_threads) is None and learned_rate_for(cfg, 2, key_threads + 1) is None
    learn(path, 700e6, ranks=1, threads=key_threads, numel=8192)
    assert learned_rate_for(cfg, 1, key_threads) is None
    assert learned_rate_for(cfg_for(path, numel=8192), 1, key_threads).params_per_s == pytest.approx(700e6)


@pytest.mark.bad_input
def test_a_hand_edited_rate_counts_as_none(tmp_path, caplog):
    path = tmp_path / "p.json"
    profile = BandwidthProfile(str(path))
    with profile.locked():
        profile.store({}, "calibrated")
    data = json.loads(path.read_text())
    rates = {"0": "fast", "1": -3, "2": 150, "3": 1e999}
    data["update_rates"] = {profile.host: {"k": {"run": "r", "mparams_per_s": rates, "updated": "t"}}, "x": []}
    path.write_text(json.dumps(data).replace("Infinity", "1e999"))
    with profile.locked(), caplog.at_level(logging.WARNING):
        assert profile.update_rate_entry("k") == (None, {}, None)  # one broken rank's rate breaks the entry: none, said
    assert "field 'mparams_per_s' ['0'] is 'fast'" in caplog.text  # (tests/test_profile_entries.py: the whole warning)
    data["update_rates"] = ["not", "a", "dict"]
    path.write_text(json.dumps(data))
    with profile.locked():
        assert profile.update_rate_entry("k") == (None, {}, None) and profile.update_rate_keys() == []
        profile.store_update_rate("k", "r", 0, 100e6)
        assert profile.update_rate_entry("k")[1] == {"0": pytest.approx(100e6)}
    profile.close()


def test_the_learner_saves_the_median_of_the_steps_after_the_first_once(tmp_path):
    path = str(tmp_path / "p.json")
    learner = UpdateRateLearner(path, 1, 0, "r", 4096)
    for s in [10.0, 1.0, 4.0, 2.0, 0.5]:  # the first (a warm-up) and the fifth are not counted
        learner.observe("torch", 8, BF16, 1000, s)
    profile = BandwidthProfile(path)
    with profile.locked():
        assert profile.update_rate_entry(update_rate_key("torch", 1, 8, BF16, 4096))[1] == {"0": pytest.approx(1000 / 2.0)}
    profile.close()


@pytest.mark.bad_input
def test_a_profile_path_that_cannot_hold_a_file_fails_at_construction(tmp_path):
    with pytest.raises(Exception, match="is a directory"):
        UpdateRateLearner(str(tmp_path), 1, 0, "r", 4096)
    with pytest.raises(Exception, match=r"cannot create /proc/nope\.json\.lock"):  # what could not be made, named
        BandwidthProfile("/proc/nope.json")


def test_a_busy_profile_is_tried_again_and_a_broken_one_only_warns(tmp_path, caplog, monkeypatch):
    from fsdp_offload import learned_rate

    monkeypatch.setattr(learned_rate, "SAVE_WAIT_S", 0.05)
    waits = []
    monkeypatch.setattr(learned_rate.time, "sleep", lambda s: waits.append(s))
    path = str(tmp_path / "p.json")
    learner = UpdateRateLearner(path, 1, 0, "r", 4096)
    holder = BandwidthProfile(path)  # another process measuring a tier holds the profile for minutes
    with holder.locked():
        for _ in range(1 + LEARN_STEPS):
            learner.observe("torch", 4, BF16, 1000, 1.0)  # the first try waits a little for it (a peer's save), then gives up
        assert waits  # (polled until SAVE_WAIT_S)
        waits.clear()
        learner.observe("torch", 4, BF16, 1000, 1.0)  # a later step's try does not wait at all
        assert waits == []
    holder.close()
    key = update_rate_key("torch", 1, 4, BF16, 4096)
    assert not os.path.exists(path)
    learner.observe("torch", 4, BF16, 1000, 0.001)  # the next step finds it free: the kept median goes in
    profile = BandwidthProfile(path)
    with profile.locked():
        assert profile.update_rate_entry(key)[1] == {"0": pytest.approx(1000.0)}
    profile.close()

    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    broken = UpdateRateLearner(str(link), 1, 0, "r", 4096)
    link.symlink_to(target)  # made a symbolic link after start-up, which the profile never follows
    with caplog.at_level(logging.WARNING):
        for _ in range(2 + LEARN_STEPS):
            broken.observe("torch", 4, BF16, 1000, 1.0)
    assert caplog.text.count(f"cannot save the learned CPU update rate to {link}") == 1  # said once; training goes on


def test_a_run_saves_its_rate_and_the_next_plan_here_predicts_from_it(tmp_path, monkeypatch):
    path = str(tmp_path / "p.json")
    cfg = cfg_for(path)
    params = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(5000))]
    opt = OffloadAdamW(params, offload=cfg)
    for _ in range(1 + LEARN_STEPS):
        for p in params:
            p.grad = torch.randn(p.shape).bfloat16()
        opt.step()
    numel = sum(p.numel() for p in params)
    steps = opt.take_metrics()
    opt.close()
    assert len(steps) == 1 + LEARN_STEPS
    expected = statistics.median(numel / m.cpu_kernel_s for m in steps[1:])  # the first step is a warm-up
    walk = statistics.median((m.update_s - m.cpu_kernel_s - m.norm_s) / len(opt.layout) for m in steps[1:])
    monkeypatch.setattr(machine_module, "node_update_rate", lambda *a: pytest.fail("timed a rate that was learned"))
    rate = cpu_rate(cfg, MachineConfig(), cpu_threads=torch.get_num_threads())
    assert rate.source == "learned" and rate.params_per_s == pytest.approx(expected, rel=1e-6)  # (kept in M params/s)
    # all in host memory: the steps' own walk is kept beside it, and the plan takes it for the timed one
    assert rate.subgroup_s == pytest.approx(walk, rel=1e-6, abs=1e-9)
    monkeypatch.setattr(update_costs_module, "time_update_costs", lambda *a, **kw: UpdateCosts(step_s=1e-4, subgroup_s=0.5))
    assert measured_costs(cfg, MachineConfig(), torch.get_num_threads(), rate, streams=False) == UpdateCosts(step_s=1e-4, subgroup_s=rate.subgroup_s)
    # another rank count, or no profile: nothing learned for it, so timed
    monkeypatch.setattr(machine_module, "node_update_rate", lambda *a: 123e6)
    assert cpu_rate(cfg, MachineConfig(ranks_per_node=2), cpu_threads=torch.get_num_threads()).source == "timed"
    assert cpu_rate(OffloadConfig(kernel="torch"), MachineConfig(), cpu_threads=None).source == "timed"


def test_the_walk_a_run_saved_goes_beside_its_rate_only_where_every_rank_saved_it(tmp_path, monkeypatch, caplog):
    path = str(tmp_path / "p.json")
    cfg = cfg_for(path)
    learn(path, 300e6, ranks=2, slot=0, walk_s=0.002)
    learn(path, 200e6, ranks=2, slot=1, walk_s=0.003)
    rate = learned_rate_for(cfg, 2, 4)
    assert (rate.params_per_s, rate.subgroup_s) == pytest.approx((200e6, 0.003))  # each the slowest rank's
    assert learned_walk(rate) == UpdateCosts(subgroup_s=pytest.approx(0.003))
    timed = UpdateCosts(step_s=0.5, subgroup_s=0.5, transfer_s=0.25)
    monkeypatch.setattr(update_costs_module, "time_update_costs", lambda *a, **kw: timed)
    # the norm and the tier's reads and writes are still timed, the walk is the run's own
    assert measured_costs(cfg, MachineConfig(ranks_per_node=2), 4, rate) == UpdateCosts(step_s=0.5, subgroup_s=0.003, transfer_s=0.25)
    learn(path, 200e6, ranks=2, slot=1, walk_s=None)  # the same run's rank 1 saving again without one (it streamed): its old one goes
    rate = learned_rate_for(cfg, 2, 4)
    assert rate.params_per_s == pytest.approx(200e6) and rate.subgroup_s is None and learned_walk(rate) is None
    assert measured_costs(cfg, MachineConfig(ranks_per_node=2), 4, rate, streams=False) is timed
    learn(path, 200e6, ranks=2, slot=1, walk_s=0.004)
    broken = json.loads(open(path).read())
    entry = next(iter(broken["update_rates"].values()))[rate_key_for(cfg, 2, 4)]
    entry["subgroup_ms"]["0"] = -1.0  # a hand edit
    with open(path, "w") as f:
        json.dump(broken, f)
    with caplog.at_level(logging.WARNING):
        rate = learned_rate_for(cfg, 2, 4)
    assert rate.source == "learned" and rate.subgroup_s is None  # the rate stands, the walk is timed
    assert "subgroup_ms" in caplog.text and "times the update's walk instead" in caplog.text
    learn(path, 300e6, ranks=2, slot=0, walk_s=0.001)  # a save makes the broken map afresh: rank 1's must come again
    assert learned_rate_for(cfg, 2, 4).subgroup_s is None
    learn(path, 200e6, ranks=2, slot=1, walk_s=0.004)
    assert learned_rate_for(cfg, 2, 4).subgroup_s == pytest.approx(0.004)


def test_a_step_tells_its_walk_only_where_its_update_had_nothing_else_in_it():
    from types import SimpleNamespace

    from fsdp_offload.learned_rate import step_walk

    def step(**changes):
        return SimpleNamespace(**{"update_s": 0.010, "cpu_kernel_s": 0.004, "norm_s": 0.002, "subgroups_read": 0,
                                  "subgroups_written": 0, "subgroups_on_gpu": 0, **changes})  # fmt: skip

    assert step_walk(step(), 4) == pytest.approx(0.001)
    assert step_walk(step(), 0) is None
    assert step_walk(step(subgroups_read=1), 4) is None and step_walk(step(subgroups_written=2), 4) is None
    assert step_walk(step(subgroups_on_gpu=1), 4) is None


def test_an_update_started_in_backward_saves_no_walk(tmp_path, monkeypatch):
    """Without clipping a bf16 run's update starts in backward and waits there for its grads: its time is
    not the walk's. The rate is saved, the walk is not."""
    from dist_utils import one_rank_group
    from test_fsdp import ARGS, loss_of

    from fsdp_offload.parallelize import build_fsdp_model

    path = str(tmp_path / "p.json")
    with one_rank_group(monkeypatch, "gloo"):
        model = build_fsdp_model(ARGS, torch.device("cpu"))
        opt = OffloadAdamW(model.parameters(), model=model, offload=cfg_for(path, max_grad_norm=None, overlap="backward"))
        assert opt.engine.during_backward
        x = torch.randint(0, ARGS.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
        for _ in range(1 + LEARN_STEPS):
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
        opt.close()
    with locked_profile(path) as profile:
        keys = profile.update_rate_keys()
        assert len(keys) == 1 and set(profile.update_rate_entry(keys[0])[1]) == {"0"} and profile.update_rate_walks(keys[0]) == {}


def test_the_plan_command_says_where_the_rate_came_from(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(update_costs_module, "time_update_costs", lambda *a, **kw: UpdateCosts())  # (test_update_costs': seconds at 2 ranks)
    path = str(tmp_path / "new" / "p.json")
    common = ["train.device=cpu", "offload=host", "machine.host_gib=64", "offload.kernel=torch", f"offload.bandwidth_profile={path}"]
    assert plan_main(common) == 0
    out = capsys.readouterr().out
    assert f"a run here of {LEARN_STEPS + 1} steps or more saves its own to {path}" in out
    assert not os.path.exists(os.path.dirname(path))  # the plan only reads: nothing made for a profile not there
    threads = torch.get_num_threads()
    cfg = cfg_for(path, numel=OffloadConfig().subgroup_numel)  # the recipes' subgroup size
    learn(path, 1e9, ranks=2, threads=threads, numel=cfg.subgroup_numel)  # rank 0 of a 2-rank run; its rank 1 never saved
    assert plan_main([*common, f"train.cpu_threads={threads}", "machine.ranks_per_node=2"]) == 0
    out = capsys.readouterr().out
    assert f"the last run here for {rate_key_for(cfg, 2, threads)} ended before each of its 2 ranks saved its rate" in out
    assert "other runs" not in out  # (that key is this plan's own)
    learn(path, 1e9, ranks=2, slot=1, threads=threads, numel=cfg.subgroup_numel)
    assert plan_main([*common, f"train.cpu_threads={threads}"]) == 0  # planned for 1 rank: the 2-rank rate is not it
    out = capsys.readouterr().out
    assert "it holds rates learned for other runs (torch 2 ranks x" in out and "machine.ranks_per_node" in out
    assert plan_main([*common, f"train.cpu_threads={threads}", "machine.ranks_per_node=2"]) == 0
    out = capsys.readouterr().out
    assert f"CPU update rate: learned from an earlier run's steps on this host ({rate_key_for(cfg, 2, threads)}, saved " in out
    assert "1000 M params/s per rank" in out


def test_train_predicts_its_update_from_the_rate_an_earlier_run_saved_and_saves_its_own(tmp_path):
    from test_train import train

    from fsdp_offload.plan import compose_plan_config
    from fsdp_offload.recipe import read_config
    from fsdp_offload.threads import cpu_threads_per_rank

    profile = tmp_path / "p.json"
    common = ["offload=host", f"offload.bandwidth_profile={profile}", "train.steps=5"]  # (a tier would need its speeds too)
    recipe = read_config(compose_plan_config(common)[0])[3]
    key = rate_key_for(recipe.config, 1, cpu_threads_per_rank(None, 1))  # what train.py looks up for this run
    saved = BandwidthProfile(str(profile))
    with saved.locked():
        saved.store_update_rate(key, "an-earlier-run", 0, 1e9)
    out = train(tmp_path / "b", *common, "train.out_dir=" + str(tmp_path / "b"))
    planned = json.loads((tmp_path / "b" / "placement.json").read_text())["plan"]
    assert planned["cpu_s"] == pytest.approx(planned["params"] / 1e9)  # the rank's params at the learned 1000 M/s
    assert planned["update_s"] >= planned["cpu_s"]
    said = out.stdout + out.stderr
    assert f"a step predicted, from the CPU rate an earlier run saved ({key}, saved " in said
    assert "the update's fixed costs not counted (the plan command times them)" in said  # that run saved none
    assert "learned the CPU update rate" in said and "ms a subgroup beside the kernel" in said
    with saved.locked():
        run, rates, _ = saved.update_rate_entry(key)
        walks = saved.update_rate_walks(key)
    saved.close()
    assert run != "an-earlier-run" and set(rates) == {"0"} and set(walks) == {"0"}  # this run's own, at its fourth step


def test_ranks_without_a_process_group_share_torchrun_s_job_id(monkeypatch):
    """Params that are not DTensors give the optimizer no group to broadcast an id over: a node's ranks under
    torchrun then take the id torchrun gave them with the time it started them, the same on each."""
    from fsdp_offload.node import job_id

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert job_id(None) != job_id(None)  # a process of its own: a new id each run
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    assert job_id(None) == job_id(None) and job_id(None).startswith("abc123-")
