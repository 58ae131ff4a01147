"""Faults injected into a tier (storage/faults.py) during training: a failed write or read loses
nothing and the next step() finishes the step, bit for bit as torch AdamW; a failed read names the
subgroup, the tier and its file; stalls change no result; a torn write or a damaged file is caught by
its checksum, naming the file; a tier that vanishes fails every step clearly instead of hanging."""

from __future__ import annotations

import errno

import pytest
from test_optimizer import assert_same_as_reference, fresh_pair, grads_for

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


def test_fault_schedules_are_checked():
    with pytest.raises(ValueError, match="fault kind 'eagain'"):
        Fault("eagain")
    with pytest.raises(ValueError, match="torn_write fault applies to op='write'"):
        Fault("torn_write", op="read")
    assert [Fault("eio", after=2, times=2).hits(n) for n in range(5)] == [False, False, True, True, False]
    assert Fault("eio", after=1, times=0).hits(100)
