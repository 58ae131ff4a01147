"""The update's fixed costs in the planner's prediction (update_costs.py): what they add at the tiny size,
that they barely move a large model's, how they are fitted from the timed steps and timed as the
optimizer runs them (one rank in process, two side by side), and what the plan's text says of them.
No test asserts a time: only the planner's arithmetic on given costs, and that timing yields numbers."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from fsdp_offload import OffloadConfig, update_rate
from fsdp_offload import machine as machine_module
from fsdp_offload import update_costs as update_costs_module
from fsdp_offload.calibrate import TierSpeed
from fsdp_offload.learned_rate import CpuRate
from fsdp_offload.machine import MachineConfig
from fsdp_offload.models import MODEL_PRESETS
from fsdp_offload.node_plan import make_plan
from fsdp_offload.plans import PlanError
from fsdp_offload.plan import compose_plan_config, format_plan, plan_from_config
from fsdp_offload.storage import TierError
from fsdp_offload.storage.private_files import host_tag
from fsdp_offload.update_costs import (MAX_NUMEL, SUBGROUPS, THREAD_CHUNK, WORK_PREFIX, UpdateCosts, fitted_costs, measured_costs,
                                       time_update_costs, timed_numel)

# Generous: several times what the tiny model's update showed on 2 CPU cores (session 25)
COSTS = UpdateCosts(step_s=2e-3, subgroup_s=1e-3, transfer_s=2e-3, call_s=0.5e-3)


def tiny_plan(tmp_path, costs: UpdateCosts | None):
    """The README's main job as planned (offload=tiny_disk at one rank: 9 subgroups, 5 in host memory)."""
    cfg = OffloadConfig(tiers=[f"posix:{tmp_path}"], host_budget_gb=0.0012, subgroup_numel=16384, prefetch=2, kernel="torch")
    plan = make_plan("tiny", MODEL_PRESETS["tiny"], cfg, MachineConfig(host_gib=64), 256, 8, "cpu", cpu_rate=300e6,
                     speeds=[TierSpeed(0.5e9, 0.5e9, 1e-4)], costs=costs)  # fmt: skip
    return plan, cfg


def test_fixed_costs_are_most_of_a_tiny_model_s_predicted_update(tmp_path):
    """The kernel and the walk are the update thread's, the I/O the tier's: the longer of the two, plus
    the norm once a step and the first read. The tiny model's 3 streamed subgroups are 3 reads and 3
    writes a step, as its run's metrics count them."""
    bare, _ = tiny_plan(tmp_path, None)
    costed, cfg = tiny_plan(tmp_path, COSTS)
    r, b = costed.ranks[0], bare.ranks[0]
    assert (r.subgroups, r.cache_slots) == (9, 6)
    assert r.walk_s == pytest.approx(9 * (COSTS.subgroup_s + COSTS.call_s) + 6 * COSTS.transfer_s)
    assert r.step_s == COSTS.step_s and (b.walk_s, b.step_s) == (0.0, 0.0)
    first_read = b.update_s - max(b.io_s, b.cpu_s)
    assert r.update_s == pytest.approx(COSTS.step_s + max(r.io_s, r.cpu_s + r.walk_s) + first_read)
    assert r.walk_s + r.step_s > 0.5 * r.update_s  # at this size the fixed costs are most of it
    text = format_plan(costed, cfg)
    assert "the CPU kernel, params / rate, and beside it each subgroup's and each tier read's and write's fixed cost" in text
    assert f"fixed costs timed here ({COSTS.describe()})" in text
    assert "no fixed costs (not timed: the CPU rate is stated)" in format_plan(bare, cfg)


@pytest.mark.parametrize("model,ranks,tiers", [("70b", 8, ["posix:/tmp"]), ("7b", 1, [])], ids=["70b-io-bound", "7b-cpu-bound"])
def test_fixed_costs_barely_move_a_large_model_s_predicted_update(monkeypatch, model, ranks, tiers):
    """The same generous costs add well under 1% to a large model's update: the 70B on 8 GPUs, its state
    through NVMe (the walk hidden under the I/O), and the 7B on one GPU, its state in host memory (a
    100Mi subgroup's kernel alone is 0.26 s at 400 M params/s)."""
    monkeypatch.setattr(machine_module, "free_bytes", lambda path: 1 << 50)
    cfg = OffloadConfig(tiers=tiers, host_budget_gb=64 if tiers else None, kernel="torch")
    machine = MachineConfig(ranks_per_node=ranks, gpu_gib=80, host_gib=1000)
    speeds = [TierSpeed(12e9, 10e9, 1e-4)] if tiers else []
    plan = lambda costs: make_plan(model, MODEL_PRESETS[model], cfg, machine, 4096, 1, "cuda", cpu_rate=400e6,  # noqa: E731
                                   speeds=speeds, costs=costs)  # fmt: skip
    bare, costed = plan(None).ranks[0], plan(COSTS).ranks[0]
    assert costed.subgroups > 50 and (costed.cache_slots < costed.subgroups) == bool(tiers)  # streams where there is a tier
    assert costed.walk_s > 0 and costed.update_s > bare.update_s
    assert (costed.update_s - bare.update_s) / bare.update_s < 0.01


def test_each_step_s_costs_are_its_slowest_rank_s_and_the_median_step_s_are_taken():
    """A step's figure is its slowest rank's; a transfer's cost is a streamed step's beyond its pair's in
    host memory, stepped just before it; the median step's is taken."""
    def step(update, kernel, norm=0.0, wait=0.0, transfers=0):
        return {"update_s": update, "kernel_s": kernel, "norm_s": norm, "all_reduce_s": wait, "transfers": transfers}

    rank0 = {"host": [step(10.0, 2.0, 1.0, 0.5), step(12.0, 2.0, 1.0, 0.5), step(11.0, 4.0, 1.0, 3.0)],
             "tier": [step(19.0, 2.0, 1.0, 0.5, 8), step(19.0, 2.0, 1.0, 0.5, 8), step(100.0, 2.0, 1.0, 0.5, 8)]}
    rank1 = {"host": [step(14.0, 2.0, 1.0, 0.5), step(9.0, 2.0, 1.0, 0.5), step(11.0, 2.0, 1.0, 0.5)],
             "tier": [step(18.0, 2.0, 1.0, 0.5, 8), step(21.0, 2.0, 1.0, 0.5, 8), step(20.0, 2.0, 1.0, 0.5, 8)]}  # fmt: skip
    costs = fitted_costs([rank0, rank1], 1000, timed_rate=1000 / 0.1)
    # host steps, slowest rank's update less kernel and norm: 11, 9, 8 -> 9 over the subgroups
    assert costs.subgroup_s == pytest.approx(9.0 / SUBGROUPS)
    # update less norm, each tier step beside its pair in host memory: 18 - 13, 20 - 11, 99 - 10 -> 9 more over 8 transfers
    assert costs.transfer_s == pytest.approx(9.0 / 8)
    assert costs.step_s == pytest.approx(1.5)  # norm and the all-reduce's wait: 1.5, 1.5, 4.0 and 1.5 thrice
    assert costs.call_s == pytest.approx(2.0 / SUBGROUPS - 0.1)  # the kernel's 2 (slowest, median) beyond 0.1 a call
    assert fitted_costs([rank0, rank1], 1000, None).call_s == 0.0  # a learned rate's kernel time is a step's own


def test_costs_are_timed_on_the_optimizer_and_leave_nothing_behind(tmp_path):
    costs = time_update_costs("torch", 4096, 1, 1, str(tmp_path), "exclusive", timed_rate=1e9)
    for value in dataclasses.astuple(costs):
        assert math.isfinite(value) and value >= 0
    assert list(tmp_path.iterdir()) == []


def test_two_ranks_are_timed_side_by_side_in_processes_of_their_own(tmp_path):
    costs = time_update_costs("torch", 4096, 1, 2, str(tmp_path), "exclusive")
    for value in dataclasses.astuple(costs):
        assert math.isfinite(value) and value >= 0
    assert costs.call_s == 0.0  # no timed rate given
    assert list(tmp_path.iterdir()) == []


def test_a_rank_that_fails_is_named_with_its_error(tmp_path):
    with pytest.raises(TierError, match=r"timing the update's fixed costs .* failed: rank \d of 2 ended with 1: .*offload.kernel='nope'"):
        time_update_costs("nope", 4096, 1, 2, str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_costs_are_timed_beside_a_learned_or_timed_rate_and_not_beside_a_stated_one(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(update_costs_module, "time_update_costs", lambda *a, **kw: calls.append(a) or COSTS)
    cfg = OffloadConfig(tiers=[f"posix:{tmp_path}"], kernel="torch", subgroup_numel=4096, tier_access="shared")
    assert measured_costs(cfg, MachineConfig(), 1, CpuRate(1e9, "given")) is None and calls == []
    assert measured_costs(cfg, MachineConfig(ranks_per_node=2), 1, CpuRate(1e9, "timed")) is COSTS
    assert calls[-1] == ("torch", 4096, 1, 2, str(tmp_path), "shared", 1e9)  # through the run's tier, costed past the rate
    measured_costs(cfg, MachineConfig(), 3, CpuRate(1e9, "learned"))
    assert calls[-1] == ("torch", 4096, 3, 1, str(tmp_path), "shared", None)  # a learned kernel time holds its calls
    stated = MachineConfig(tier_read_gbps=[1.0], tier_write_gbps=[1.0])
    measured_costs(cfg, stated, 1, CpuRate(1e9, "timed"))
    assert calls[-1][4] is None  # the planned machine's tier is not this one's dir: the temp dir's


def test_the_kernel_is_timed_round_after_round_over_copies_the_caches_cannot_hold(monkeypatch):
    """A step finds each subgroup's state out of the CPU's caches: a small subgroup timed over one copy,
    in them, read 1.5-2x faster than a step's kernel."""
    import fsdp_offload.kernels as kernels_module

    seen = set()

    def kernel(p, m, v, g, out, hyper):
        seen.add(p.data_ptr())

    monkeypatch.setattr(kernels_module, "get_adamw_kernel", lambda name: ("fake", kernel))
    assert update_rate.node_update_rate("fused", 1 << 10, 1, 1) > 0
    assert 1 < len(seen) <= -(-update_rate.COLD_BYTES // (14 << 10))


def test_beside_a_learned_rate_a_transfer_s_cost_leaves_out_the_kernel_s_slowing_down():
    """A learned rate is a run's own steps' kernel time, its slowing down beside the I/O threads in it: a
    transfer's cost beside it is the walk's alone; beside a timed rate (no I/O) it holds the kernel's too."""
    def step(update, kernel, transfers=0):
        return {"update_s": update, "kernel_s": kernel, "norm_s": 0.0, "all_reduce_s": 0.0, "transfers": transfers}

    rank = {"host": [step(10.0, 2.0)] * 3, "tier": [step(18.0, 6.0, 8)] * 3}  # the kernel 4 slower beside the I/O
    assert fitted_costs([rank], 1000, timed_rate=1e9).transfer_s == pytest.approx(8.0 / 8)
    assert fitted_costs([rank], 1000, timed_rate=None).transfer_s == pytest.approx(4.0 / 8)


def test_a_plan_that_writes_no_tier_times_none(tmp_path):
    """...and leaves nothing in the tier dir, where it also clears what a killed planner of this host left."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    stale = tmp_path / f"{WORK_PREFIX}{host_tag()}-pid{int(gone.stdout)}-x1"  # its process has ended
    live = tmp_path / f"{WORK_PREFIX}{host_tag()}-pid{os.getpid()}-x2"
    elsewhere = tmp_path / f"{WORK_PREFIX}another_host-pid{int(gone.stdout)}-x3"  # a shared file system's: not judged
    for d in (stale, live, elsewhere):
        (d / "tier").mkdir(parents=True)
    costs = time_update_costs("torch", 4096, 1, 1, str(tmp_path), "exclusive", streams=False)
    assert costs.transfer_s == 0.0 and math.isfinite(costs.subgroup_s)
    assert sorted(tmp_path.iterdir()) == sorted([live, elsewhere])
    assert fitted_costs([{"host": [{"update_s": 3.0, "kernel_s": 1.0, "norm_s": 0.5, "all_reduce_s": 0.5, "transfers": 0}]}],
                        1000, None) == UpdateCosts(1.0, 1.5 / SUBGROUPS, 0.0, 0.0)  # fmt: skip


def test_the_plan_times_the_tier_only_where_it_streams_and_after_it_fits(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(update_costs_module, "time_update_costs", lambda *a, **kw: calls.append(kw["streams"]) or COSTS)
    monkeypatch.setattr(machine_module, "node_update_rate", lambda *a: 300e6)
    common = ["train.device=cpu", "model=tiny", "offload.kernel=torch", "machine.host_gib=64", f"offload.tiers=[posix:{tmp_path}]",
              "offload.subgroup_numel=16384", "machine.tier_read_gbps=[1.0]", "machine.tier_write_gbps=[1.0]"]  # fmt: skip
    plan, _ = plan_from_config(*compose_plan_config(common + ["offload.host_budget_gb=1"]))
    assert calls == [False] and plan.update_costs is COSTS  # all in host memory: no tier timed
    plan, _ = plan_from_config(*compose_plan_config(common + ["offload.host_budget_gb=0.0012"]))
    assert calls == [False, True] and plan.ranks[0].walk_s > 0
    with pytest.raises(PlanError):  # says it does not fit before any timing
        plan_from_config(*compose_plan_config(common + ["machine.host_gib=0.0001"]))
    assert calls == [False, True]


def test_a_dir_the_timing_cannot_write_is_a_clear_error_naming_the_fix(tmp_path):
    """Not a writable dir (here a file; read-only or full alike): the option, the dir and the fix, no traceback
    of the temp dir's."""
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(TierError, match=rf"fixed costs .* in {not_a_dir} \(offload.tiers' first dir\) failed: .*"
                                        r"where the dir is at fault.*machine.cpu_mparams_per_s="):  # fmt: skip
        time_update_costs("torch", 4096, 1, 1, str(not_a_dir))


def test_a_timed_subgroup_gives_each_thread_a_chunk_of_the_kernel():
    # a team of 64 over subgroups of fewer chunks than threads read 10x a run's walk (session 27)
    assert timed_numel(100 << 20, 2) == MAX_NUMEL
    assert timed_numel(100 << 20, 64) == 64 * THREAD_CHUNK
    assert timed_numel(300_000, 64) == 300_000 // 1024 * 1024  # never more than the run's own subgroup ...
    assert timed_numel(100, 4) == 1024  # ... but 1024 at least
