"""The timed CPU rate says where the rest of the node took CPUs while it was timed (update_rate.OtherLoad):
other processes or the hypervisor slow the timing's kernel, and the plan's predicted update then reads long."""

from __future__ import annotations

import os

import pytest

import fsdp_offload.machine as machine_module
import fsdp_offload.update_rate as update_rate
from fsdp_offload.config import OffloadConfig
from fsdp_offload.machine import MachineConfig, cpu_rate
from fsdp_offload.update_rate import MIN_LOAD_WALL_S, OtherLoad, node_cpu_ticks, timed_beside_load


def test_the_load_is_the_nodes_busy_time_less_steal_and_this_process_own_in_cores():
    # 2 s at 100 ticks a second: 9 s busy of which 1 s steal, 6 s this process's own
    load = OtherLoad.between((1000, 10), (1900, 110), own_s=6.0, wall_s=2.0, ticks_per_s=100)
    assert load == OtherLoad(others_cores=1.0, steal_cores=0.5)
    assert load.warning().startswith("while the CPU rate was timed, other processes took 1.0 cores: the rate may read below")
    assert "steal" not in load.warning() and "offload.bandwidth_profile" in load.warning()
    assert OtherLoad(0.4, 2.0).warning().startswith("while the CPU rate was timed, the hypervisor gave 2.0 cores to other guests")
    assert OtherLoad(0.9, 0.9).warning() == ""  # under a core each: not said
    # this process's own time counted above the node's ticks (their rounding) is no negative load
    assert OtherLoad.between((0, 0), (100, 0), own_s=1.05, wall_s=1.0, ticks_per_s=100).others_cores == 0.0


def test_proc_stat_is_read_from_its_first_line_and_none_where_there_is_none(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 30 9000 40 2 3 7 0 0\ncpu0 50 2 15 4500 20 1 1 3 0 0\n")
    assert node_cpu_ticks(str(stat)) == (100 + 5 + 30 + 2 + 3 + 7, 7)  # idle and iowait are not busy
    assert node_cpu_ticks(str(tmp_path / "none")) is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the node's CPU ticks are read from Linux's /proc/stat")
def test_a_measure_gives_its_value_and_a_load_where_the_ticks_can_tell(monkeypatch):
    def spin() -> float:
        import time

        end = time.perf_counter() + MIN_LOAD_WALL_S * 1.5
        while time.perf_counter() < end:
            pass
        return 8.0

    value, load = timed_beside_load(spin)
    assert value == 8.0 and load is not None and load.others_cores >= 0 and load.steal_cores >= 0
    monkeypatch.setattr(update_rate, "node_cpu_ticks", lambda: None)  # no /proc/stat to read: the value alone
    assert timed_beside_load(spin) == (8.0, None)


def test_a_plan_timed_on_a_busy_node_says_so(monkeypatch):
    monkeypatch.setattr(machine_module, "timed_beside_load", lambda measure: (123e6, OtherLoad(3.0, 0.0)))
    rate = cpu_rate(OffloadConfig(kernel="torch", subgroup_numel=4096), MachineConfig(ranks_per_node=2), cpu_threads=1)
    assert rate.source == "timed" and rate.params_per_s == 123e6
    assert rate.detail.startswith("while the CPU rate was timed, other processes took 3.0 cores: ")
    monkeypatch.setattr(machine_module, "timed_beside_load", lambda measure: (123e6, OtherLoad(0.2, 0.0)))
    rate = cpu_rate(OffloadConfig(kernel="torch", subgroup_numel=4096), MachineConfig(ranks_per_node=2), cpu_threads=1)
    assert rate.detail == ""  # a quiet node, no profile: nothing to add


def test_a_rate_timed_on_a_busy_node_is_timed_again_and_the_quietest_kept(monkeypatch):
    def readings(*loads: OtherLoad):
        taken = iter(zip((100e6, 200e6, 300e6), loads))
        calls = []

        def timed(measure):
            calls.append(1)
            return next(taken)

        return timed, calls

    cfg = OffloadConfig(kernel="torch", subgroup_numel=4096)
    timed, calls = readings(OtherLoad(3.0, 0.0), OtherLoad(0.0, 0.2), OtherLoad(5.0, 0.0))
    monkeypatch.setattr(machine_module, "timed_beside_load", timed)
    rate = cpu_rate(cfg, MachineConfig(ranks_per_node=2), cpu_threads=1)
    assert len(calls) == 2 and rate.params_per_s == 200e6 and rate.detail == ""  # quiet at the second: kept
    timed, calls = readings(OtherLoad(3.0, 0.0), OtherLoad(0.0, 1.5), OtherLoad(2.0, 0.0))
    monkeypatch.setattr(machine_module, "timed_beside_load", timed)
    rate = cpu_rate(cfg, MachineConfig(ranks_per_node=2), cpu_threads=1)
    assert len(calls) == machine_module.QUIET_TRIES == 3
    assert rate.params_per_s == 200e6 and "1.5 cores to other guests" in rate.detail  # busy throughout: the least load
