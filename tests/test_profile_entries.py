"""A hand-edited bad entry in the bandwidth profile (a tier's speeds, a learned CPU update rate): one
warning that names the file, the entry, the field, what is wrong and the fix, said once a node and once a
process, and the run goes on as if the entry were absent (the tier measured, the rate timed)."""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch

from fsdp_offload import OffloadConfig, calibrate, machine as machine_module
from fsdp_offload.bandwidth import TierSpeed
from fsdp_offload.bandwidth_profile import RATE_FIELDS, TIER_FIELDS, BandwidthProfile, entry_problem, locked_profile
from fsdp_offload.learned_rate import learned_rate_for, rate_key_for, unlearned_note
from fsdp_offload.machine import MachineConfig, cpu_rate
from fsdp_offload.storage import TierSpec

from dist_utils import run_ranks

LOGGER = "fsdp_offload.bandwidth_profile"
FIX = "Delete that entry or fix its value in the file"
MEASURED = TierSpeed(7e9, 5e9, 1e-4)

# (the value written, the problem the warning names); None: the field left out
BAD_SPEEDS = [(-1.0, "is -1.0: it must be a number of GB/s > 0"), (0.0, "is 0.0: it must be a number of GB/s > 0"),
              (math.nan, "is nan: it must be a number of GB/s > 0"), ("fast", "is 'fast': it must be a number of GB/s > 0"),
              (True, "is True: it must be a number of GB/s > 0"), (None, "is missing")]  # fmt: skip
BAD_RATES = [(-3, "['0'] is -3: it must be a number of M params/s > 0"), (0, "['0'] is 0: it must be a number of M params/s > 0"),
             (math.nan, "['0'] is nan: it must be a number of M params/s > 0"),
             ("fast", "['0'] is 'fast': it must be a number of M params/s > 0")]  # fmt: skip


def write_raw(path, data: dict) -> None:
    """The file as a hand edit leaves it (json writes NaN as NaN, which Python's reader takes back)."""
    path.write_text(json.dumps(data))


def tier(tmp_path, name: str = "a") -> TierSpec:
    (tmp_path / name).mkdir(exist_ok=True)
    return TierSpec.parse(f"posix:{tmp_path / name}")


def profile_with_tier(tmp_path, spec: TierSpec, field: str, value: object) -> tuple:
    path = tmp_path / "p.json"
    profile = BandwidthProfile(str(path))
    with profile.locked():
        profile.store({spec.key: TierSpeed(1e9, 2e9, 0.001)}, "calibrated")
    data = json.loads(path.read_text())
    entry = data["hosts"][profile.host][spec.key]
    if value is None:
        del entry[field]
    else:
        entry[field] = value
    write_raw(path, data)
    return path, profile


@pytest.mark.bad_input
@pytest.mark.parametrize("value,problem", BAD_SPEEDS, ids=[repr(v) for v, _ in BAD_SPEEDS])
def test_a_bad_tier_speed_is_said_once_and_the_tier_measured(tmp_path, caplog, monkeypatch, value, problem):
    spec, good = tier(tmp_path, "a"), tier(tmp_path, "b")
    path, profile = profile_with_tier(tmp_path, spec, "write_gbps", value)
    with profile.locked():
        profile.store({good.key: TierSpeed(3e9, 3e9, 0.0)}, "calibrated")
    measured = []
    monkeypatch.setattr(calibrate, "measure_tier", lambda s, *a: measured.append(s.key) or MEASURED)
    monkeypatch.setattr(calibrate, "PROFILE_MIN_TRANSFER_BYTES", 0)  # (what a real run's transfers are: saved)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        speeds = calibrate.seed_speeds([spec, good], profile, 1 << 20, 1 << 20)
        with profile.locked():
            profile.load()  # read again by this process: not said again
    assert speeds == [MEASURED, TierSpeed(3e9, 3e9, 0.0)] and measured == [spec.key]  # the bad one measured, the good one kept
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning == (f"bandwidth profile {path}: the entry ['hosts']['{profile.host}']['{spec.key}'] is not usable: field "
                       f"'write_gbps' {problem}; this run ignores it and measures that tier again. {FIX}")  # fmt: skip
    with profile.locked():
        assert profile.load()[spec.key] == MEASURED  # the measurement saved over the bad entry
    profile.close()


@pytest.mark.bad_input
def test_a_tier_entry_that_is_not_an_object_is_said(tmp_path, caplog):
    spec = tier(tmp_path)
    path, profile = profile_with_tier(tmp_path, spec, "read_gbps", 1.0)
    data = json.loads(path.read_text())
    data["hosts"][profile.host][spec.key] = 12.5
    write_raw(path, data)
    with caplog.at_level(logging.WARNING, logger=LOGGER), profile.locked():
        assert profile.load() == {}
    assert "is not usable: it is 12.5, not an object with the fields read_gbps, write_gbps, latency_ms" in caplog.text
    profile.close()


@pytest.mark.bad_input
def test_a_bad_entry_of_a_tier_the_run_does_not_use_is_not_said(tmp_path, caplog, monkeypatch):
    """The warning says the run measures that tier again: for a tier of another run's, it would not (and
    would be said at every start of every run that never reads the entry)."""
    other, mine = tier(tmp_path, "other"), tier(tmp_path, "mine")
    path, profile = profile_with_tier(tmp_path, other, "write_gbps", -1.0)
    with profile.locked():
        profile.store({mine.key: TierSpeed(3e9, 3e9, 0.0)}, "calibrated")
    monkeypatch.setattr(calibrate, "measure_tier", lambda s, *a: pytest.fail(f"{s} measured"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert calibrate.seed_speeds([mine], profile, 1 << 20, 1 << 20) == [TierSpeed(3e9, 3e9, 0.0)]
    assert caplog.records == []
    profile.close()


def rate_profile(tmp_path, cfg: OffloadConfig, ranks: int, threads: int, edit) -> tuple:
    """A profile holding a whole learned rate for the plan's key, then `edit`ed (its entry, in place)."""
    path = tmp_path / "p.json"
    key = rate_key_for(cfg, ranks, threads)
    with locked_profile(str(path)) as profile:
        for rank in range(ranks):
            profile.store_update_rate(key, "run-a", rank, 200e6)
        host = profile.host
    data = json.loads(path.read_text())
    edit(data["update_rates"][host][key])
    write_raw(path, data)
    return path, key, host


@pytest.mark.bad_input
@pytest.mark.parametrize("value,problem", BAD_RATES, ids=[repr(v) for v, _ in BAD_RATES])
def test_a_bad_learned_rate_is_said_once_and_the_rate_timed(tmp_path, caplog, monkeypatch, value, problem):
    cfg = OffloadConfig(kernel="torch", subgroup_numel=4096, bandwidth_profile=str(tmp_path / "p.json"))
    threads = torch.get_num_threads()
    path, key, host = rate_profile(tmp_path, cfg, 2, threads, lambda e: e["mparams_per_s"].update({"0": value}))
    monkeypatch.setattr(machine_module, "node_update_rate", lambda *a: 123e6)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert learned_rate_for(cfg, 2, threads) is None  # rank 1's good rate alone is no run's rate: timed
        rate = cpu_rate(cfg, MachineConfig(ranks_per_node=2), cpu_threads=threads)  # (reads it twice more)
    assert rate.source == "timed" and rate.params_per_s == 123e6
    assert "ended before" not in rate.detail  # a broken entry is no run's: not called one cut short
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning == (f"bandwidth profile {path}: the entry ['update_rates']['{host}']['{key}'] is not usable: field "
                       f"'mparams_per_s' {problem}; this run ignores it and times the CPU update instead (a run's own "
                       f"steps here save a new rate). {FIX}")  # fmt: skip


@pytest.mark.bad_input
@pytest.mark.parametrize("field", sorted(RATE_FIELDS))
def test_a_learned_rate_missing_a_field_is_said_and_timed(tmp_path, caplog, field):
    cfg = OffloadConfig(kernel="torch", subgroup_numel=4096, bandwidth_profile=str(tmp_path / "p.json"))
    path, key, host = rate_profile(tmp_path, cfg, 1, 4, lambda e: e.pop(field))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert learned_rate_for(cfg, 1, 4) is None
    assert f"['update_rates']['{host}']['{key}'] is not usable: field '{field}' is missing;" in caplog.text
    assert str(path) in caplog.text and FIX in caplog.text


@pytest.mark.bad_input
def test_a_rates_section_that_is_not_an_object_is_said_and_a_new_rate_replaces_it(tmp_path, caplog):
    path = tmp_path / "p.json"
    with locked_profile(str(path)) as profile:
        profile.store({}, "calibrated")
        host = profile.host
    data = json.loads(path.read_text())
    data["update_rates"] = {host: ["not", "a", "dict"]}
    write_raw(path, data)
    with caplog.at_level(logging.WARNING, logger=LOGGER), locked_profile(str(path)) as profile:
        assert profile.update_rate_entry("k") == (None, {}, None) and profile.update_rate_keys() == []
        assert f"the entry ['update_rates']['{host}'] is not usable: it is ['not', 'a', 'dict'], not an object;" in caplog.text
        data["update_rates"] = {host: {"k": {"run": "r", "mparams_per_s": {"0": -1}, "updated": "then"}}}
        write_raw(path, data)
        profile.store_update_rate("k", "r", 1, 100e6)  # the same run saving beside a broken entry: it starts afresh
        assert profile.update_rate_entry("k")[:2] == ("r", {"1": pytest.approx(100e6)})


def test_entry_problem_is_none_for_what_the_profile_writes():
    assert entry_problem({"read_gbps": 1, "write_gbps": 2.5, "latency_ms": 0, "source": "x"}, TIER_FIELDS) is None
    assert entry_problem({"run": "a", "mparams_per_s": {"0": 1.0, "12": 3}, "updated": "t"}, RATE_FIELDS) is None
    assert entry_problem({"run": "a", "mparams_per_s": {"x": 1.0}, "updated": "t"}, RATE_FIELDS) == (
        "field 'mparams_per_s' has the key 'x': its keys must be local ranks (0, 1, ...)")  # fmt: skip
    assert entry_problem({"read_gbps": 1, "write_gbps": 1, "latency_ms": -0.5}, TIER_FIELDS) == (
        "field 'latency_ms' is -0.5: it must be a number of milliseconds >= 0")  # fmt: skip


def _read_on_each_rank(rank: int, world: int, cfg: OffloadConfig, out: str) -> None:
    """Each rank reads the learned rate, as train.py's do; writes what it warned."""
    os.environ.pop("LOCAL_RANK", None)  # (a launcher that sets none: the job's rank 0 says it)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(LOGGER).addHandler(handler)
    logging.getLogger(LOGGER).setLevel(logging.WARNING)
    assert learned_rate_for(cfg, 1, 4) is None
    unlearned_note(cfg, 1, 4)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(said, f)


@pytest.mark.bad_input
def test_a_bad_entry_is_said_by_one_rank_of_the_node(tmp_path):
    cfg = OffloadConfig(kernel="torch", subgroup_numel=4096, bandwidth_profile=str(tmp_path / "p.json"))
    rate_profile(tmp_path, cfg, 1, 4, lambda e: e["mparams_per_s"].update({"0": -1}))
    run_ranks(2, _read_on_each_rank, cfg, str(tmp_path / "said"))
    said = [json.loads((tmp_path / f"said.{r}").read_text()) for r in range(2)]
    assert len(said[0]) == 1 and "is not usable: field 'mparams_per_s' ['0'] is -1" in said[0][0]
    assert said[1] == []


def _read_on_a_node_of_its_own(rank: int, world: int, cfg: OffloadConfig, out: str) -> None:
    """As _read_on_each_rank, each rank on a host of its own (a launcher such as srun, no $LOCAL_RANK),
    the job's ranks counted by host name first, as train.py counts them."""
    import socket

    import torch.distributed as dist

    from fsdp_offload import node

    socket.gethostname = lambda: f"node{rank}"  # (the ranks' profile host stays this machine's: one entry for both)
    assert node.node_position(dist.group.WORLD) == (1, 0)
    _read_on_each_rank(rank, world, cfg, out)


@pytest.mark.bad_input
def test_a_bad_entry_is_said_on_every_node_where_no_local_rank_is_set(tmp_path):
    """Each node reads its own host's entries: the job's rank 0 alone would leave the other nodes'
    broken entries ignored without a word."""
    cfg = OffloadConfig(kernel="torch", subgroup_numel=4096, bandwidth_profile=str(tmp_path / "p.json"))
    rate_profile(tmp_path, cfg, 1, 4, lambda e: e["mparams_per_s"].update({"0": -1}))
    run_ranks(2, _read_on_a_node_of_its_own, cfg, str(tmp_path / "said"))
    for rank in range(2):
        said = json.loads((tmp_path / f"said.{rank}").read_text())
        assert len(said) == 1 and "is not usable: field 'mparams_per_s' ['0'] is -1" in said[0], (rank, said)
