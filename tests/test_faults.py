"""Faults injected into a tier (storage/faults.py) during training: a failed write or read loses
nothing and the next step() finishes the step, bit for bit as torch AdamW; a failed read names the
subgroup, the tier and its file; stalls change no result; a torn write or a damaged file is caught by
its checksum, naming the file; a tier that vanishes fails every step clearly instead of hanging."""

from __future__ import annotations

import errno
import logging
import os
import subprocess

import pytest
import torch
from test_optimizer import SG, assert_same_as_reference, budget_for, fresh_pair, grads_for, groups, make_params

from fsdp_offload import OffloadAdamW, OffloadConfig

from fsdp_offload.storage import CorruptSubgroupError, TierError
from fsdp_offload.storage.faults import Fault, FaultyTier

STEPS = 5


def set_grads(mine, ref, step: int) -> None:
    for p, r, g in zip(mine, ref, grads_for(step)):
        p.grad, r.grad = g, g.float()


def train_through(opt, ref_opt, mine, ref, expect) -> int:
    """STEPS steps; a step that raises (checked by `expect`) is finished by calling step() again.
    Returns how many raised."""
    raised = 0
    for s in range(STEPS):
        set_grads(mine, ref, s)
        try:
            opt.step()
        except Exception as exc:  # noqa: BLE001 - `expect` says which
            expect(exc)
            raised += 1
            opt.step()  # the fault was one-off: this finishes the step
        ref_opt.step()
    return raised


@pytest.mark.parametrize("kind", ["eio", "enospc"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_a_failed_transfer_loses_nothing(tmp_path, kind, op):
    opt, ref_opt, mine, ref = fresh_pair(tmp_path)
    tier = FaultyTier.around(opt.store, 0, [Fault(kind, op=op, after=9, times=1)])

    def expect(exc: BaseException) -> None:
        if op == "write":  # the write's own error, as the OS gave it
            assert isinstance(exc, OSError) and exc.errno == {"eio": errno.EIO, "enospc": errno.ENOSPC}[kind]
        else:  # a read names what it could not read, and where from
            assert isinstance(exc, TierError)
            assert "subgroup " in str(exc) and tier.name in str(exc) and tier.path in str(exc)
            assert isinstance(exc.__cause__, OSError)

    assert train_through(opt, ref_opt, mine, ref, expect) == 1
    assert tier.injected == 1
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


@pytest.mark.parametrize("placement", ["fixed", "learned"])
def test_a_tier_that_fails_writes_is_dropped_and_its_subgroups_go_to_the_other(tmp_path, placement, caplog):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{d}" for d in dirs], subgroup_numel=SG, host_budget_gb=budget_for(3),
                        placement=placement, calibration_gb=1 / 1024)  # fmt: skip
    init = make_params()
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    opt, ref_opt = OffloadAdamW(groups(mine), offload=cfg), torch.optim.AdamW(groups(ref), foreach=False)
    failing = 0 if opt.store.placement.tier_for(0) == 0 else 1  # a tier the placement uses
    tier = FaultyTier.around(opt.store, failing, [Fault("eio", op="write", after=2, times=0)])  # it never writes again
    with caplog.at_level(logging.WARNING, logger="fsdp_offload.pipeline"):
        assert train_through(opt, ref_opt, mine, ref, expect=lambda exc: pytest.fail(f"raised {exc!r}")) == 0
    assert_same_as_reference(opt, ref_opt, mine, ref)
    assert opt.store.pipeline.failed_tiers == {failing}
    dropped = [r for r in caplog.records if "is dropped" in r.getMessage()]
    assert len(dropped) == 1 and tier.path in dropped[0].getMessage()  # said once, naming the file
    assert 1 <= tier.injected <= cfg.prefetch + 1  # only writes chosen before the drop met the failure
    assert all(t != failing for t in opt.store.pipeline.location.values() if t is not None)
    opt.close()


def test_a_failed_write_with_no_other_tier_to_take_it_keeps_the_subgroup_in_host_memory(tmp_path):
    """Two tiers, the second with no share (fixed ratios 1:0): a failed write cannot fail over, so the
    write's error stands, the subgroup stays in host memory, and the next step() finishes the step."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{d}" for d in dirs], subgroup_numel=SG, host_budget_gb=budget_for(3),
                        placement="fixed", tier_ratios=[1.0, 0.0])  # fmt: skip
    init = make_params()
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    opt, ref_opt = OffloadAdamW(groups(mine), offload=cfg), torch.optim.AdamW(groups(ref), foreach=False)
    tier = FaultyTier.around(opt.store, 0, [Fault("enospc", op="write", after=2, times=1)])

    def expect(exc: BaseException) -> None:
        assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC

    assert train_through(opt, ref_opt, mine, ref, expect) == 1
    assert tier.injected == 1 and not opt.store.pipeline.failed_tiers
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


def test_stalls_change_no_result(tmp_path):
    opt, ref_opt, mine, ref = fresh_pair(tmp_path)
    tier = FaultyTier.around(opt.store, 0, [Fault("latency", op=op, after=2, times=0, delay_s=0.01) for op in ("read", "write")])
    assert train_through(opt, ref_opt, mine, ref, expect=lambda exc: pytest.fail(f"raised {exc!r}")) == 0
    assert tier.injected > 10
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


@pytest.mark.parametrize("damage", ["torn_write", "bitflip", "truncate"])
def test_damage_behind_our_back_is_caught_naming_the_file(tmp_path, damage):
    opt, _, mine, _ = fresh_pair(tmp_path)
    faults = [Fault("torn_write", after=0, times=0)] if damage == "torn_write" else []
    tier = FaultyTier.around(opt.store, 0, faults)
    if damage != "torn_write":
        stored = sorted(opt.store.stored_locations())
        tier.damage(stored[len(stored) // 2], damage)
    with pytest.raises(CorruptSubgroupError, match=tier.path):
        for s in range(STEPS):
            for p, g in zip(mine, grads_for(s)):
                p.grad = g
            opt.step()
    opt.close()


def test_a_vanished_tier_fails_every_step_clearly(tmp_path):
    opt, _, mine, _ = fresh_pair(tmp_path)
    FaultyTier.around(opt.store, 0, [Fault("vanish", op="write", after=2)])
    for s in range(2):
        for p, g in zip(mine, grads_for(s)):
            p.grad = g
        with pytest.raises((OSError, TierError)) as info:
            opt.step()
        assert "injected" in str(info.value) or "No such file" in str(info.value)
    opt.close()


@pytest.mark.bad_input
def test_fault_schedules_are_checked():
    with pytest.raises(ValueError, match="fault kind 'eagain'"):
        Fault("eagain")
    with pytest.raises(ValueError, match="torn_write fault applies to op='write'"):
        Fault("torn_write", op="read")
    assert [Fault("eio", after=2, times=2).hits(n) for n in range(5)] == [False, False, True, True, False]
    assert Fault("eio", after=1, times=0).hits(100)


def test_fault_campaign_finds_nothing_lost_silently(tmp_path):
    """scripts/fault_campaign.py, one trial of each fault kind: every trial ends exact or with a named error."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "fault_campaign.py"
    out = subprocess.run([sys.executable, str(script), "--trials", "9", "--steps", "3", "--dir", str(tmp_path), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(next((tmp_path / "out").glob("fault_campaign_cpu_*.json")).read_text())
    assert result["trials"] == 9 and result["bad"] == 0, result["outcomes"]
    # transient faults are ridden out exactly; damage and a vanished tier stop the run with a named error
    for t in result["trials_detail"]:
        hit = t["injected"] > 0 or t["damage"] is not None
        lasting = t["kind"] in ("torn_write", "bitflip", "truncate", "vanish")
        assert t["outcome"] == ("detected" if hit and lasting else "exact"), t
    assert not list(tmp_path.glob("fault-campaign-*")), "a trial left its tier dir behind"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs: a file system that really fills up."""
    where = tmp_path / "small"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (CAP_SYS_ADMIN); the injected ENOSPC tests cover the logic")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill_up(root) -> str:
    """Writes a file into `root` until its file system is full; returns its path."""
    path = os.path.join(root, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            os.write(fd, b"\1" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return path


def test_a_file_system_that_fills_up_for_real(small_tmpfs):
    opt, ref_opt, mine, ref = fresh_pair(small_tmpfs)
    filler = fill_up(small_tmpfs)  # no room left for the next subgroup written out
    raised = []

    def expect(exc: BaseException) -> None:
        assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC, exc
        assert str(small_tmpfs) in str(exc) and "free space" in str(exc)  # where, and what to do
        raised.append(exc)
        os.unlink(filler)  # room is back: the retry finishes the step

    assert train_through(opt, ref_opt, mine, ref, expect) == 1
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


def test_buffered_writes_surface_write_back_errors_at_write_time(tmp_path, monkeypatch):
    """Where O_DIRECT is refused (as file systems without it refuse it; forced here, since this
    machine's take it), a write that pwrite() accepted may still fail at write-back: the write's own
    fdatasync makes that this write's error, naming the file, and the subgroup never counts as stored
    (a later read says so, rather than failing a checksum)."""
    from fsdp_offload.cache import aligned_host_buffer
    from fsdp_offload.storage import make_tier
    from fsdp_offload.storage import posix

    monkeypatch.setattr(posix, "_try_direct", lambda fd: False)  # the file system refuses O_DIRECT
    tier = make_tier(f"posix:{tmp_path}")
    tier.attach(f"test-buffered-{os.getpid()}", [16384])
    try:
        assert not tier.direct
        calls = []

        def failing(fd: int) -> None:
            calls.append(fd)
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", failing)
        buf = aligned_host_buffer(16384)
        with pytest.raises(OSError, match=f"writing subgroup 0 back to {tier.path} failed: Input/output error; free space"):
            tier.write(0, buf).result()
        assert calls
        with pytest.raises(TierError, match="was never written"):
            tier.read(0, buf)
        monkeypatch.undo()
        tier.write(0, buf).result()  # write-back works again: the write counts
        tier.read(0, buf).result()
    finally:
        tier.close()


def _steps_through_ctrl_c(opt, ref_opt, mine, ref) -> int:
    """STEPS steps, each step() called again after a KeyboardInterrupt as a training loop would;
    returns how many were raised."""
    import signal

    raised = 0
    # Python's own Ctrl-C handler, also where pytest was started with SIGINT ignored (a shell's background job)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for s in range(STEPS):
            set_grads(mine, ref, s)
            for _ in range(8):  # a retry that starts the step over would be interrupted again, forever
                try:
                    opt.step()
                    break
                except KeyboardInterrupt:
                    raised += 1  # the loop catches it and calls step() again, which finishes the step
            else:
                raise AssertionError(f"step {s}: step() never finished after 8 tries")
            ref_opt.step()
    finally:
        signal.signal(signal.SIGINT, inherited)
    return raised


def test_ctrl_c_inside_an_update_is_held_until_its_subgroup_is_done(tmp_path):
    """A Ctrl-C that lands while a subgroup is being updated (after one kernel call, say: the kernel has
    written new params over that part of the grads) takes effect once the subgroup is done, so the
    retried step() never updates it twice nor takes params for grads: bit for bit as torch AdamW."""
    import signal

    opt, ref_opt, mine, ref = fresh_pair(tmp_path)
    real, interrupts = opt.engine.split_kernel, [0]  # (bf16 params: the subgroups off the GPU are split)

    def interrupted_kernel(*args, **kwargs):
        real(*args, **kwargs)
        if interrupts[0] < 6:  # the first kernel call of each of the first tries: Ctrl-C lands in mid-update
            interrupts[0] += 1
            os.kill(os.getpid(), signal.SIGINT)

    opt.engine.split_kernel = interrupted_kernel
    assert _steps_through_ctrl_c(opt, ref_opt, mine, ref) == 6
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


def test_ctrl_c_in_the_last_subgroup_s_update_leaves_the_retry_to_close_the_step(tmp_path):
    """A Ctrl-C held until the step's last subgroup is updated: every subgroup is new, and the step is
    not closed yet (params not all copied back, step not counted). The retry closes it without updating
    anything again (the staging buffer holds new params, not grads): bit for bit as torch AdamW."""
    import signal

    opt, ref_opt, mine, ref = fresh_pair(tmp_path)
    real, tries = opt.engine.update_subgroup, []

    def interrupted_update(sg, state, grad_scale):
        real(sg, state, grad_scale)
        tries.append(sg)
        if len(tries) == len(opt.engine.pending):  # this try's last subgroup (pending is set when the try ends)
            os.kill(os.getpid(), signal.SIGINT)

    opt.engine.update_subgroup = interrupted_update
    opt.step = _clearing_before(opt.step, tries)
    assert _steps_through_ctrl_c(opt, ref_opt, mine, ref) == STEPS  # each step's first try, at its last subgroup
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


def _clearing_before(fn, seen: list):
    def cleared(*args, **kwargs):
        seen.clear()
        return fn(*args, **kwargs)

    return cleared
