"""Calibration and the bandwidth profile: measuring through a tier, the CLI, and bad input (unwritable
or full file systems, zero bandwidths, corrupt or foreign profiles) failing clearly before training,
or being measured again, never crashing a step."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections import namedtuple

import pytest
import torch

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload import calibrate
from fsdp_offload.bandwidth_profile import BandwidthProfile, tier_profile_key
from fsdp_offload.calibrate import TierSpeed, main, measure_tier
from fsdp_offload.storage.base import ALIGN
from fsdp_offload.storage.private_files import tier_file_tag
from fsdp_offload.rawio import measure_raw_io, mixed_io_timeline
from fsdp_offload.bandwidth import BandwidthModel
from fsdp_offload.placement import AdaptivePlacement
from fsdp_offload.storage import Limits, TierError, TierSpec, make_tier
from fsdp_offload.storage import posix as posix_mod
from fsdp_offload.storage.throttle import ThrottledTier

from test_optimizer import SG, budget_for, make_params

KIB = 1 << 10
MB = 1e6
shutil_usage = lambda free: namedtuple("usage", "total used free")(free, 0, free)  # noqa: E731


def two_tiers(tmp_path) -> list[str]:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir(exist_ok=True)
    return [f"posix:{d}" for d in dirs]


def build(tmp_path, tiers: list[str], profile: str | None, **kw) -> OffloadAdamW:
    cfg = OffloadConfig(
        kernel="torch", tiers=tiers, subgroup_numel=SG, host_budget_gb=budget_for(4), bandwidth_profile=profile,
        **{"calibration_gb": 0.002, **kw},
    )  # fmt: skip
    return OffloadAdamW([torch.nn.Parameter(t) for t in make_params()], offload=cfg)


def read_only_dir(tmp_path) -> str:
    """A dir this process cannot create files in; as root, whom modes do not stop, sysfs."""
    if os.getuid() == 0:
        return "/sys"
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    return str(d)


def test_throttle_specs():
    t = make_tier("throttle:posix:/tmp?read=1.5GB/s&write=800MiB/s&latency=2ms&threads=2")
    assert isinstance(t, ThrottledTier)
    assert t.limits == Limits(1.5e9, 800 * 2**20, 0.002)
    assert t.inner.spec == "posix:/tmp?threads=2" and t.inner.threads == 2
    with pytest.raises(ValueError, match="read='fast' is not a rate; write it like read=1.5GB/s"):
        make_tier("throttle:posix:/tmp?read=fast")
    with pytest.raises(ValueError, match="write='0GB/s' is not positive"):
        make_tier("throttle:posix:/tmp?write=0GB/s")
    with pytest.raises(ValueError, match="limits nothing"):
        make_tier("throttle:posix:/tmp")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['speed'\]"):
        make_tier("throttle:posix:/tmp?read=1GB/s&speed=3")
    assert tier_profile_key("throttle:posix:/tmp/../tmp?write=1GB/s&read=2GB/s") == "throttle:posix:/tmp?read=2GB/s&write=1GB/s"


def test_a_tier_path_with_a_tilde_is_in_the_home_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "nvme").mkdir()
    spec = TierSpec.parse("throttle:posix:~/nvme?read=1GB/s")
    assert spec.dir == str(tmp_path / "nvme") and str(spec) == "throttle:posix:~/nvme?read=1GB/s"  # said as written
    tier = make_tier("posix:~/nvme")
    tier.attach(tier_file_tag("rank0"), [ALIGN])
    assert os.path.dirname(tier.path) == str(tmp_path / "nvme" / f"fsdp-offload-{os.getuid()}") and os.path.isfile(tier.path)
    tier.close()


def test_measure_tier_sees_the_throttle(ram_dir):
    speed = measure_tier(f"throttle:posix:{ram_dir}?read=40MB/s&write=20MB/s&latency=3ms", nbytes=2 << 20, transfer_bytes=256 * KIB)
    # The throttle lets no byte through faster than its rates, and a busy machine only slows it more:
    # bounds from above (a RAM dir unthrottled moves GB/s), never a wall-clock race from below
    assert speed.write_bps < speed.read_bps <= 40 * MB * 1.2 and speed.write_bps <= 20 * MB * 1.2
    assert speed.latency_s >= 0.003 * 0.9
    assert not os.path.exists(os.path.join(ram_dir, f"fsdp-offload-{os.getuid()}"))  # its file and its dir are gone


def test_the_last_user_of_the_private_dir_takes_it_away(tmp_path):
    """A planner's measurement leaves nothing in the user's tier dir; beside a running tier it leaves the
    dir, which the running tier's close then takes away; a tier made before the dir went away makes it
    again when it opens (tests/test_private_dir.py: the races)."""
    private = tmp_path / f"fsdp-offload-{os.getuid()}"
    measure_tier(f"posix:{tmp_path}", nbytes=256 * KIB, transfer_bytes=64 * KIB)
    assert list(tmp_path.iterdir()) == []
    running = make_tier(f"posix:{tmp_path}")
    running.attach(tier_file_tag("run"), [ALIGN])
    measure_tier(f"posix:{tmp_path}", nbytes=256 * KIB, transfer_bytes=64 * KIB)
    assert [p.name for p in private.iterdir()] == [os.path.basename(running.path)]  # its file keeps the dir
    waiting = make_tier(f"posix:{tmp_path}")
    running.close()
    assert list(tmp_path.iterdir()) == []  # the last user's close took it away, after `waiting` was made
    waiting.attach(tier_file_tag("late"), [ALIGN])
    assert os.path.dirname(waiting.path) == str(private) and os.path.exists(waiting.path)
    waiting.close()
    assert list(tmp_path.iterdir()) == []


def test_a_mixed_pass_only_ever_scales_bandwidths_down(monkeypatch):
    """Reads and writes under way together (a disk) slow both; a mixed pass that ran faster than the
    separate ones (full duplex, or noise) leaves the measured bandwidths as they are, never above."""
    passes = {"write": 2.0, "read": 1.0, "bytes": 1e9, "count": 2, "latency": 0.0}
    monkeypatch.setattr(calibrate, "tier_passes", lambda *a, **kw: {**passes, "mixed": 0.5})
    speed = measure_tier("posix:/tmp")
    assert (speed.read_bps, speed.write_bps) == (1e9, 0.5e9)
    monkeypatch.setattr(calibrate, "tier_passes", lambda *a, **kw: {**passes, "mixed": 3.0})  # 2x the serial time: halved
    speed = measure_tier("posix:/tmp")
    assert (speed.read_bps, speed.write_bps) == pytest.approx((0.5e9, 0.25e9))


def test_cli_measures_prints_and_saves(tmp_path, ram_dir, capsys):
    tiers = [f"throttle:posix:{d}?read=60MB/s&write=30MB/s" for d in (ram_dir / "a", ram_dir / "b")]
    for d in (ram_dir / "a", ram_dir / "b"):
        d.mkdir()
    profile = tmp_path / "p.json"
    assert main([*tiers, "--gb", "0.002", "--transfer-mb", "0.25", "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "read GB/s" in out and all(t in out for t in tiers) and f"saved to {profile}" in out
    saved = BandwidthProfile(str(profile))
    with saved.locked():
        got = saved.load()
    assert set(got) == {tier_profile_key(t) for t in tiers}
    assert all(0 < s.write_bps <= 30 * MB * 1.25 for s in got.values())  # the throttle's, at most (a busy machine: less)
    with capsys.disabled():
        print("\n" + out.rstrip())


def test_cli_on_a_read_only_dir_is_a_clear_error(tmp_path, capsys):
    target = read_only_dir(tmp_path)
    assert main([f"posix:{target}", "--gb", "0.001", "--no-save"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: posix:{target}: ") and target in err


def test_two_tiers_on_one_file_system_are_said_to_share_it(tmp_path, caplog):
    """Each is measured alone, so their bandwidths seem to add: the optimizer says they do not."""
    with caplog.at_level(logging.WARNING, logger="fsdp_offload.levels"):
        build(tmp_path, two_tiers(tmp_path), None).close()
    assert f"offload.tiers posix:{tmp_path}/a and posix:{tmp_path}/b are on one file system: they share its bandwidth" in caplog.text


def test_unwritable_tier_fails_before_training(tmp_path):
    target = read_only_dir(tmp_path)
    with pytest.raises(TierError, match=f"posix:{target}: .*{target}"):
        build(tmp_path, [two_tiers(tmp_path)[0], f"posix:{target}"], str(tmp_path / "p.json"))


def test_a_tier_on_a_read_only_file_system_is_told_so(tmp_path, monkeypatch):
    """A mode fix would not help there: the message says what would."""
    from fsdp_offload.storage.private_files import tier_root_problem

    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((*statvfs(p)[:8], os.ST_RDONLY, statvfs(p)[9])))
    assert tier_root_problem(str(tmp_path), f"posix:{tmp_path}") == (
        f"posix:{tmp_path}: tier dir {tmp_path} is on a read-only file system; pick a path on a writable one")


def test_a_pass_makes_at_most_max_transfers_and_fills_at_most_half_the_free_space(tmp_path, monkeypatch):
    """A small model's transfers: 1 GiB of them would be thousands, and a small tier would be filled."""
    assert calibrate.tier_passes(f"posix:{tmp_path}", nbytes=1 << 30, transfer_bytes=4 * KIB)["count"] == calibrate.MAX_SMALL_TRANSFERS
    monkeypatch.setattr(calibrate.shutil, "disk_usage", lambda path: shutil_usage(free=40 * KIB))
    assert calibrate.tier_passes(f"posix:{tmp_path}", nbytes=1 << 30, transfer_bytes=4 * KIB)["count"] == 4  # 20 KiB: 5, even


def test_full_file_system_is_a_clear_error(tmp_path, monkeypatch):
    def full(fd, view, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(posix_mod, "pwrite_all", full)
    with pytest.raises(TierError, match=r"calibrating posix:.*: 2 x 65536 bytes failed: No space left on device \(the file system is full") as err:
        measure_tier(f"posix:{tmp_path}", nbytes=128 * KIB, transfer_bytes=64 * KIB)
    assert "subgroup" not in str(err.value) and "step()" not in str(err.value)  # the tier's own words are about a step's writes
    with pytest.raises(TierError, match="the file system is full"):
        build(tmp_path, two_tiers(tmp_path), str(tmp_path / "p.json"))


def test_zero_bandwidths_are_refused_or_measured_again(tmp_path, caplog):
    tiers = two_tiers(tmp_path)
    path = str(tmp_path / "p.json")
    profile = BandwidthProfile(path)
    with profile.locked():
        profile.store({tier_profile_key(tiers[0]): TierSpeed(1e9, 1e9, 0.0), tier_profile_key(tiers[1]): TierSpeed(1e9, 1e9, 0.0)}, "calibrated")
    data = json.loads(open(path).read())
    data["hosts"][profile.host][tier_profile_key(tiers[1])]["write_gbps"] = 0.0  # say, hand-edited
    open(path, "w").write(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="fsdp_offload.bandwidth_profile"):
        opt = build(tmp_path, tiers, path)
    assert "is not usable" in caplog.text and tier_profile_key(tiers[1]) in caplog.text
    assert opt.store.placement.model.speeds()[1].write_bps > 0  # measured again
    opt.close()
    with pytest.raises(ValueError, match="positive, finite"):
        BandwidthModel([TierSpeed(1e9, 0.0, 0.0)])
    with pytest.raises(ValueError, match="calibration_gb=0"):
        build(tmp_path, tiers, None, calibration_gb=0)


def test_a_small_model_s_speeds_are_used_and_never_saved(tmp_path, caplog):
    """Transfers under 8 MiB time each request's costs, not the tier: measured or learned with them, the
    speeds serve this run and never reach the profile a real run would start from."""
    path = tmp_path / "p.json"
    with caplog.at_level(logging.INFO):
        opt = build(tmp_path, two_tiers(tmp_path), str(path))
        opt.close()
    assert BandwidthProfile(str(path)).load() == {}
    assert "the bandwidth profile keeps none of these" in caplog.text and "the speeds this run learns are used, not saved" in caplog.text


def test_corrupt_profile_is_moved_aside_and_measured_again(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(calibrate, "PROFILE_MIN_TRANSFER_BYTES", 0)  # this test's small transfers are saved, as a real run's
    tiers = two_tiers(tmp_path)
    path = tmp_path / "p.json"
    path.write_text('{"format": "fsdp-offload-bandwidth-profile/1", "hosts": {')  # cut off mid-write
    with caplog.at_level(logging.WARNING, logger="fsdp_offload.bandwidth_profile"):
        opt = build(tmp_path, tiers, str(path))
    assert f"bandwidth profile {path} is unreadable" in caplog.text
    assert len([f for f in os.listdir(tmp_path) if f.startswith("p.json.corrupt-")]) == 1
    opt.close()
    fresh = json.loads(path.read_text())
    assert set(fresh["hosts"][BandwidthProfile(str(path)).host]) == {tier_profile_key(t) for t in tiers}


def test_profile_of_another_machine_is_kept_and_this_one_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "PROFILE_MIN_TRANSFER_BYTES", 0)  # this test's small transfers are saved, as a real run's
    tiers = two_tiers(tmp_path)
    path = str(tmp_path / "p.json")
    other = BandwidthProfile(path, host="some-other-node")
    with other.locked():
        other.store({tier_profile_key(t): TierSpeed(123e9, 123e9, 0.0) for t in tiers}, "calibrated")
    opt = build(tmp_path, tiers, path)
    assert all(s.read_bps < 100e9 for s in opt.store.placement.model.speeds())  # not the other node's numbers
    opt.close()
    hosts = json.loads(open(path).read())["hosts"]
    assert set(hosts) == {"some-other-node", BandwidthProfile(path).host}
    assert hosts["some-other-node"][tier_profile_key(tiers[0])]["read_gbps"] == 123


def test_a_profile_that_cannot_be_saved_mid_training_only_warns(tmp_path, ram_dir, caplog, monkeypatch):
    monkeypatch.setattr(calibrate, "PROFILE_MIN_TRANSFER_BYTES", 0)  # this test's subgroups are small
    # and their timings noisy (latency, a busy machine): the drift's replan is what this test needs, not its gating
    monkeypatch.setattr(AdaptivePlacement, "NOISE_MARGIN", 0.0)
    tiers = [f"throttle:{t}?read=40MB/s&write=40MB/s" for t in two_tiers(ram_dir)]
    path = tmp_path / "p.json"
    profile = BandwidthProfile(str(path))
    with profile.locked():
        profile.store({tier_profile_key(t): TierSpeed(40 * MB, 40 * MB, 0.0) for t in tiers}, "calibrated")
    opt = build(tmp_path, tiers, str(path))
    os.unlink(path)
    os.mkdir(path)  # the profile can no longer be replaced
    tier = opt.store.tiers[1]
    while not isinstance(tier, ThrottledTier):
        tier = tier.inner
    tier.set_limits(Limits(10 * MB, 10 * MB, 0.0))  # a drift: the placement replans and saves
    with caplog.at_level(logging.WARNING, logger="fsdp_offload.bandwidth_profile"):
        for step in range(2):
            for p in opt._params:
                p.grad = torch.randn(p.shape).bfloat16()
            opt.step()
    assert opt.store.placement.replans >= 1
    assert f"cannot save learned bandwidths to {path}" in caplog.text
    opt.close()


def test_raw_io_with_one_thread_and_its_clear_errors(tmp_path):
    """measure_raw_io's mixed pass reads and writes at once, even with threads=1; a directory it cannot
    write in is a TierError naming it, and nothing of the test is left behind."""
    raw = measure_raw_io(str(tmp_path), 1 << 20, request_bytes=256 * KIB, threads=1, samples=1)
    assert raw.mixed_gbps > 0 and raw.threads == 1
    assert not list(tmp_path.iterdir())
    with pytest.raises(TierError, match="raw I/O test"):
        measure_raw_io(read_only_dir(tmp_path), 1 << 20, request_bytes=256 * KIB, threads=2, samples=1)


def test_mixed_io_timeline_windows_cover_the_run(tmp_path):
    """Every window's rate is over its own length, the last one ending with the last request; a file
    system without O_DIRECT is refused rather than timing the page cache."""
    try:
        t = mixed_io_timeline(str(tmp_path), seconds=0.5, window_s=0.2, file_bytes=2 << 20, request_bytes=256 * KIB, threads=2)
    except TierError as exc:  # tmpfs and the like
        assert "O_DIRECT" in str(exc)
        return
    windows = t["windows"]
    assert [w["t_s"] for w in windows[:2]] == [0.2, 0.4] and windows[2]["t_s"] >= 0.5
    assert all(w["mixed_gbps"] == pytest.approx(w["read_gbps"] + w["write_gbps"]) for w in windows)
    assert sum(w["read_gbps"] for w in windows) > 0 and sum(w["write_gbps"] for w in windows) > 0
    with pytest.raises(ValueError, match="window_s"):
        mixed_io_timeline(str(tmp_path), seconds=1, window_s=0)


def test_without_a_profile_the_node_s_ranks_measure_in_turns(monkeypatch):
    """Two ranks seeding without a bandwidth profile measure one after the other, never at once (each
    would see a share of the device)."""
    spans = []

    def slow_measure(spec, nbytes, transfer_bytes):
        start = time.monotonic()
        time.sleep(0.2)
        spans.append((start, time.monotonic()))
        return calibrate.TierSpeed(1e9, 1e9, 0.0)

    monkeypatch.setattr(calibrate, "measure_tier", slow_measure)
    ranks = [threading.Thread(target=calibrate.seed_speeds, args=(["posix:/tmp"], None, 1 << 20, 1 << 20)) for _ in range(2)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    (a0, a1), (b0, b1) = sorted(spans)
    assert a1 <= b0


def test_the_command_checks_every_tier_dir_before_it_measures_any(tmp_path, capsys, monkeypatch):
    """A missing last dir ends it before the first tier's minutes are spent, naming the dir; nothing saved."""
    monkeypatch.setattr(calibrate, "measure_tier", lambda *a, **k: pytest.fail("measured"))
    profile = tmp_path / "profile.json"
    assert main([f"posix:{tmp_path}", f"posix:{tmp_path}/missing", "--profile", str(profile), "--gb", "0.01"]) == 1
    captured = capsys.readouterr()
    assert f"tier dir {tmp_path}/missing does not exist" in captured.err and "read GB/s" not in captured.out
    assert not profile.exists()
