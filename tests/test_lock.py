"""Node-level tier access: k processes at a time per tier, by file locks that die with their holder."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.cache import aligned_host_buffer
from fsdp_offload.storage import TierError, open_tiers
from fsdp_offload.storage.lock import LockedTier, NodeTierLock, access_slots

HOLD_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from fsdp_offload.storage.lock import NodeTierLock
    lock = NodeTierLock(sys.argv[1], sys.argv[2], 1)
    assert lock.acquire(timeout=10)
    if sys.argv[3] == "fork":
        child = os.fork()
        if child == 0:
            time.sleep(60)  # a data loader worker, say, that outlives its parent
            os._exit(0)
        print(child, flush=True)
    print("held", flush=True)
    time.sleep(60)
    """
)


def hold_in_subprocess(tier_dir, lock_dir, mode: str) -> tuple[subprocess.Popen, int | None]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(tier_dir), str(lock_dir), mode], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline()) if mode == "fork" else None
    assert proc.stdout.readline().strip() == "held"
    return proc, child


def test_access_values():
    assert access_slots("exclusive") == 1
    assert access_slots("shared") is None
    assert access_slots(3) == 3 and access_slots("2") == 2
    for bad in (0, -1, "many", True, 1.5):
        with pytest.raises(ValueError, match="offload.tier_access"):
            access_slots(bad)


def test_k_processes_at_a_time(tmp_path):
    holders = [NodeTierLock(str(tmp_path), str(tmp_path), 2) for _ in range(3)]  # separate opens conflict like processes
    assert holders[0].acquire(timeout=0) and holders[1].acquire(timeout=0)
    assert not holders[2].acquire(timeout=0.05)
    holders[0].release()
    assert holders[2].acquire(timeout=1)
    for h in holders:
        h.close()


def test_the_last_user_removes_the_lock_files_without_letting_two_in(tmp_path):
    """A waiter that opened the file before the last holder removed it must not hold the removed file
    while a newcomer holds a new one at the same path."""
    first, waiter = NodeTierLock(str(tmp_path), str(tmp_path), 1), NodeTierLock(str(tmp_path), str(tmp_path), 1)
    assert first.acquire(timeout=0)
    got = threading.Event()
    thread = threading.Thread(target=lambda: waiter.acquire() and got.set())
    thread.start()
    first.close()  # releases; removes the file unless the waiter took it first
    assert got.wait(5)
    newcomer = NodeTierLock(str(tmp_path), str(tmp_path), 1)
    assert not newcomer.acquire(timeout=0.1), "two holders of one tier"
    waiter.close()
    assert newcomer.acquire(timeout=1)
    newcomer.close()
    assert not any(os.path.exists(p) for p in newcomer.paths)
    thread.join()


@pytest.mark.parametrize("mode", ["plain", "fork"])
def test_a_killed_holder_releases_the_tier(tmp_path, mode):
    """SIGKILL gives no chance to clean up: the kernel drops the flock. With "fork", the holder has a
    forked child still alive, which must not keep the lock (its inherited lock files are closed)."""
    lock = NodeTierLock(str(tmp_path), str(tmp_path), 1)
    proc, child = hold_in_subprocess(tmp_path, tmp_path, mode)
    try:
        assert not lock.acquire(timeout=0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert lock.acquire(timeout=5), "the tier stayed locked after its holder was killed"
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        proc.kill()
        lock.close()


WORKER = textwrap.dedent(
    """
    import json, sys, torch
    from fsdp_offload import OffloadAdamW, OffloadConfig
    from dist_utils import spy_step_transfers
    tiers, lock_dir, profile, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    sg, m, c = 65536, 10, 4
    params = [torch.nn.Parameter(torch.randn(sg)) for _ in range(m)]
    cfg = OffloadConfig(
        kernel="torch", tiers=tiers, subgroup_numel=sg, host_budget_gb=(2 * m * sg + c * 10 * sg) / 2**30,
        tier_access="exclusive", tier_lock_dir=lock_dir, bandwidth_profile=profile, calibration_gb=0.004,
    )
    opt = OffloadAdamW(params, offload=cfg)
    per_step = spy_step_transfers(opt)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(sg, dtype=torch.bfloat16)
        opt.step()
    opt.close()  # the last hold ends once the gate lets the lock go
    holds = {t.name: list(t.lock.holds) for t in opt.store.tiers}
    waits = {t.name: t.lock.wait_s for t in opt.store.tiers}
    json.dump({"holds": holds, "waits": waits, "transfers": [[t.tier, t.start, t.end] for step in per_step for t in step]}, open(out, "w"))
    """
)


def test_four_processes_in_exclusive_mode_never_overlap_on_a_tier(tmp_path, ram_dir):
    """4 processes step optimizers over the same two (throttled, so that I/O takes a while) tiers. Per
    tier, the lock holds of all of them never overlap, every transfer lies inside one of its own
    process's holds, and all finish (no deadlock)."""
    dirs = [ram_dir / "a", ram_dir / "b"]
    for d in dirs:
        d.mkdir()
    tiers = [f"throttle:posix:{dirs[0]}?read=60MB/s&write=60MB/s", f"throttle:posix:{dirs[1]}?read=30MB/s&write=30MB/s"]
    outs = [tmp_path / f"out{i}.json" for i in range(4)]
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(tiers), str(tmp_path), str(tmp_path / "profile.json"), str(o)],
                         env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})  # for dist_utils
        for o in outs
    ]
    for p in procs:
        assert p.wait(timeout=150) == 0, "a worker failed or hung"
    results = [json.loads(o.read_text()) for o in outs]
    for tier in tiers:
        holds = sorted((a, b, i) for i, r in enumerate(results) for a, b in r["holds"][tier])
        assert {i for *_, i in holds} == set(range(4)), f"every process used {tier}"
        for (a1, b1, i1), (a2, b2, i2) in zip(holds, holds[1:]):
            assert a2 >= b1, f"{tier}: process {i2} took the tier at {a2} while process {i1} held it until {b1}"
        for i, r in enumerate(results):
            mine = [(a, b) for a, b in r["holds"][tier]]
            for name, start, end in r["transfers"]:
                if name == tier:
                    assert any(a <= start and end <= b for a, b in mine), (
                        f"process {i}: a transfer on {tier} [{start}, {end}] outside its holds "
                        f"{[h for h in mine if h[1] > start - 0.5 and h[0] < end + 0.5]}"
                    )
    assert sum(w for r in results for w in r["waits"].values()) > 0  # they did contend


def test_locked_tier_keeps_the_tier_contract(tmp_path):
    """Through the lock wrapper a tier still stores and returns subgroups, reports errors, and lets
    the lock go when idle."""
    (tier,) = open_tiers([f"posix:{tmp_path}"], "exclusive", str(tmp_path))
    assert isinstance(tier, LockedTier)
    tier.attach("t", [4096, 8192])
    data = aligned_host_buffer(8192)
    data.copy_(torch.arange(8192, dtype=torch.uint8))
    tier.write(1, data).result()
    back = aligned_host_buffer(8192)
    got = tier.read(1, back).result()
    assert torch.equal(back, data) and got.tier == f"posix:{tmp_path}" and got.nbytes == 8192
    with pytest.raises(TierError, match="never written"):
        tier.read(0, aligned_host_buffer(4096)).result()  # the wrapped tier's errors come through the future
    with pytest.raises(ValueError, match="slot is 4096 bytes"):
        tier.write(0, torch.zeros(10, dtype=torch.uint8))
    deadline = time.time() + 2
    while tier.lock.held and time.time() < deadline:
        time.sleep(0.01)
    assert not tier.lock.held and len(tier.lock.holds) >= 1
    path = tier.path
    tier.close()
    assert not os.path.exists(path) and not any(os.path.exists(p) for p in tier.lock.paths)


@pytest.mark.bad_input
def test_lock_dir_must_be_usable(tmp_path):
    with pytest.raises(TierError, match="offload.tier_lock_dir=.*missing.*node-local"):
        OffloadAdamW(
            [torch.nn.Parameter(torch.randn(4096))],
            offload=OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=4096, tier_lock_dir=str(tmp_path / "missing")),
        )
    with pytest.raises(ValueError, match="offload.tier_access='sometimes'"):
        OffloadAdamW(
            [torch.nn.Parameter(torch.randn(4096))],
            offload=OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=4096, tier_access="sometimes"),
        )


def test_a_lock_held_too_long_fails_naming_its_holder(tmp_path, caplog):
    proc, _ = hold_in_subprocess(tmp_path, tmp_path, "plain")
    try:
        waiter = NodeTierLock(str(tmp_path), str(tmp_path), 1, timeout_s=0.5)
        with pytest.raises(TierError, match=rf"waited 0 s for the node lock of .* held by pid {proc.pid} \(.*python"):
            waiter.wait()
        assert any(f"pid {proc.pid}" in r.getMessage() for r in caplog.records)  # said once, before failing
        waiter.close()
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ValueError, match="tier_lock_timeout_s=0 must be a positive number"):
        OffloadConfig(tier_lock_timeout_s=0)


def test_a_close_that_fails_on_one_slot_still_closes_the_others(tmp_path, monkeypatch):
    """An error on one slot's file at close (its dir made unusable meanwhile, say) is raised, and the other
    slots' files are closed all the same: an open one would hold the tier for a process that has let go."""
    (tmp_path / "locks").mkdir()
    lock = NodeTierLock(str(tmp_path / "tier"), str(tmp_path / "locks"), 3)
    fds = list(lock._fd.values())
    real_take = lock._take

    def failing(path: str, mode: int) -> bool:
        if path == lock.paths[0]:
            raise TierError("tier lock: cannot open it again")
        return real_take(path, mode)

    monkeypatch.setattr(lock, "_take", failing)
    with pytest.raises(TierError, match="cannot open it again"):
        lock.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed, every one
    lock.close()  # a second close (or a forked child's) leaves the closed files be


def test_a_slot_file_that_cannot_be_opened_again_does_not_keep_the_gate(tmp_path, monkeypatch):
    """Taking a slot whose file a last user removed opens it anew; where that fails, the error is raised
    and the gate taken before it is let go: held, it would keep every job off the tier."""
    (tmp_path / "locks").mkdir()
    tier = str(tmp_path / "tier")
    exclusive, other = NodeTierLock(tier, str(tmp_path / "locks"), 1), NodeTierLock(tier, str(tmp_path / "locks"), 4)
    try:
        os.unlink(exclusive.paths[0])
        monkeypatch.setattr(exclusive, "_open", lambda path: (_ for _ in ()).throw(TierError("no room in the lock dir")))
        with pytest.raises(TierError, match="no room in the lock dir"):
            exclusive.acquire(timeout=0)
        assert other.acquire(timeout=0)  # the gate was let go
        other.release()
    finally:
        monkeypatch.undo()
        other.close()
        exclusive.close()


def test_an_exclusive_job_and_a_job_of_several_slots_exclude_each_other(tmp_path):
    """Two jobs on one tier dir with different offload.tier_access: an exclusive one holds the tier alone,
    and ones of 4 slots share it among themselves only when no exclusive one holds it (the slots alone let
    an exclusive job and a 4-slot one each hold one at once)."""
    locks = tmp_path / "locks"
    locks.mkdir()
    tier = str(tmp_path / "tier")
    exclusive, four, other_four = NodeTierLock(tier, str(locks), 1), NodeTierLock(tier, str(locks), 4), NodeTierLock(tier, str(locks), 4)
    try:
        assert exclusive.acquire(timeout=0)
        assert not four.acquire(timeout=0)  # slot 1 is free, but the tier is held whole
        exclusive.release()
        assert four.acquire(timeout=0) and other_four.acquire(timeout=0)  # two of the 4-slot jobs' slots at once
        assert not exclusive.acquire(timeout=0)
        four.release()
        assert not exclusive.acquire(timeout=0)  # one 4-slot holder is enough to keep it out
        other_four.release()
        assert exclusive.acquire(timeout=0)
        exclusive.release()
        # an exclusive waiter holds the intent file: no new hold of several slots starts, so those under way end
        assert four.acquire(timeout=0)
        assert not exclusive.acquire(timeout=0)  # (it let the intent go as it gave up)
        assert other_four.acquire(timeout=0)
        other_four.release()
        assert exclusive._take(exclusive.intent_path, fcntl.LOCK_EX)  # as acquire() holds it while it waits
        assert not other_four.acquire(timeout=0)
        four.release()
        assert exclusive.acquire(timeout=0)  # (its own intent, taken again: one process, one open file)
        exclusive.release()
        exclusive._let_go(exclusive.intent_path)
        assert other_four.acquire(timeout=0)
        other_four.release()
    finally:
        for lock in (exclusive, four, other_four):
            lock.close()
    assert list(locks.iterdir()) == []  # the last close removes every file, the gate's too, and the dir


def test_an_exclusive_waiter_behind_another_exclusive_holder_does_not_hold_off_the_others(tmp_path, monkeypatch):
    """The intent file is held by an exclusive waiter only while others share the gate: behind another
    exclusive holder it would keep every job of several slots out for as long as exclusive ranks queue."""
    import fsdp_offload.storage.lock as lock_module

    (tmp_path / "locks").mkdir()
    tier, locks = str(tmp_path / "tier"), str(tmp_path / "locks")
    holder, waiter, four = NodeTierLock(tier, locks, 1), NodeTierLock(tier, locks, 1), NodeTierLock(tier, locks, 4)
    seen = []

    def one_wait(seconds: float) -> None:  # the waiter's first pass has failed: look, then let it in
        seen.append(four._take(four.intent_path, fcntl.LOCK_SH))
        four._let_go(four.intent_path)
        holder.release()

    try:
        assert holder.acquire(timeout=0)
        monkeypatch.setattr(lock_module.time, "sleep", one_wait)
        assert waiter.acquire(timeout=None)
        monkeypatch.undo()
        assert seen == [True]  # the intent was free while the gate was held whole
        waiter.release()
        assert four.acquire(timeout=0)  # and the waiter let it go once in
        four.release()
    finally:
        monkeypatch.undo()
        for lock in (holder, waiter, four):
            lock.close()
