"""Tier files left behind by killed processes: a later start on the same host removes every one whose
process is gone and whose lock no process holds (any rank's, and a killed calibration's), also where
flock is emulated by POSIX locks (NFS); and the node's rank count that sizes a tier's free-space check
is node.node_ranks', which srun and mp.spawn (no LOCAL_WORLD_SIZE) need."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from fsdp_offload import node
from fsdp_offload.storage import chunked, make_tier, private_files
from fsdp_offload.storage.private_files import remove_stale_files, tier_file_tag

MIB = 1 << 20


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def tier_dir(tmp_path) -> str:
    d = tmp_path / f"fsdp-offload-{os.getuid()}"
    d.mkdir(mode=0o700)
    return str(d)


def leftover(directory: str, owner: str, pid: int, host: str | None = None) -> str:
    """A tier file as `owner` (rank<r> or calibrate), process `pid`, of this host or `host`, names it."""
    host = host or tier_file_tag(owner).split("-")[1]
    path = os.path.join(directory, f"{owner}-{host}-pid{pid}-0123abcd.subgroups")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    return path


def test_any_rank_s_and_a_calibration_s_files_of_this_host_are_removed(tmp_path):
    d = tier_dir(tmp_path)
    gone = dead_pid()
    stale = [leftover(d, "rank0", gone), leftover(d, "rank3", gone), leftover(d, "calibrate", gone)]
    alive = leftover(d, "rank1", os.getpid())  # its process runs: in use
    other_host = leftover(d, "rank0", gone, host="elsewhere")  # a shared file system: not ours to judge
    held = leftover(d, "rank2", gone)
    holder = os.open(held, os.O_RDONLY)  # its lock is held (by a process of another pid namespace, say): in use
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        assert sorted(remove_stale_files(d, tier_file_tag("rank0"))) == sorted(stale)
    finally:
        os.close(holder)
    assert sorted(os.listdir(d)) == sorted(os.path.basename(p) for p in (alive, other_host, held))


def test_a_calibration_start_removes_them_too(tmp_path):
    d = tier_dir(tmp_path)
    stale = leftover(d, "rank0", dead_pid())
    tier = make_tier(f"posix:{tmp_path}")
    tier.attach(tier_file_tag("calibrate"), [MIB])
    try:
        assert not os.path.exists(stale)
    finally:
        tier.close()


def test_stale_files_are_removed_where_flock_is_emulated_by_posix_locks(tmp_path, monkeypatch):
    """On NFS, flock() is a POSIX lock, and an exclusive one needs a file opened for writing (else
    EBADF): the check must open the file read-write, or a stale file is never removed there."""
    real_flock = fcntl.flock

    def nfs_flock(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        real_flock(fd, operation)

    monkeypatch.setattr(private_files.fcntl, "flock", nfs_flock)
    d = tier_dir(tmp_path)
    stale = leftover(d, "rank0", dead_pid())
    assert remove_stale_files(d, tier_file_tag("rank0")) == [stale]


def test_the_free_space_check_counts_the_node_s_ranks_by_node_ranks(tmp_path, monkeypatch):
    """4 ranks on this node (counted by node_ranks over the job; no LOCAL_WORLD_SIZE, as under srun):
    room for one rank's file but not four's is short of space."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(node, "_job_node_ranks", 4)
    monkeypatch.setattr(chunked.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, 2 * MIB))
    tier = make_tier(f"posix:{tmp_path}")
    tier.attach(tier_file_tag("rank0"), [MIB])
    try:
        assert tier._short_of_space
    finally:
        tier.close()


def _count_ranks(rank: int, world: int) -> None:
    import torch.distributed as dist

    os.environ.pop("LOCAL_WORLD_SIZE", None)  # mp.spawn, like srun, sets none
    assert node.node_ranks() == 1  # nothing counted yet
    assert node.node_ranks(dist.group.WORLD) == 2
    assert node.node_ranks() == 2  # what a tier or a calibration asks on one rank alone


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_node_ranks_without_a_group_is_the_count_the_job_took(tmp_path):
    from dist_utils import run_ranks

    run_ranks(2, _count_ranks)


def buffered_tier(tmp_path, monkeypatch, after_pwrite, before_failing_sync):
    """A POSIX tier on buffered I/O (its file system refuses O_DIRECT, as some do: forced here), two
    threads, two 16 KiB subgroups; `after_pwrite()` runs after each pwrite, and the first fdatasync
    fails with EIO once `before_failing_sync()` has returned True (the later ones succeed)."""
    from fsdp_offload.storage import posix

    monkeypatch.setattr(posix, "_try_direct", lambda fd: False)
    tier = make_tier(f"posix:{tmp_path}?threads=2")
    tier.attach(tier_file_tag("rank0"), [16384, 16384])
    real_pwrite, real_sync, syncs = posix.pwrite_all, os.fdatasync, []

    def pwrite(fd, view, offset):
        real_pwrite(fd, view, offset)
        after_pwrite()

    def fdatasync(fd):
        syncs.append(fd)
        if len(syncs) == 1:
            assert before_failing_sync()
            raise OSError(errno.EIO, "Input/output error")
        real_sync(fd)

    monkeypatch.setattr(posix, "pwrite_all", pwrite)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return tier


def issued_apart(*writes: Callable[[], Future]) -> list[Future]:
    """The tier's futures of `writes`, each issued from a thread of its own: a write whose chunks all finish
    before it has registered for them runs its fdatasync in the thread that issued it (a busy machine's
    timing), which must not keep the other writes from being issued."""
    with ThreadPoolExecutor(len(writes)) as pool:
        issued = [pool.submit(write) for write in writes]
        return [f.result(timeout=30) for f in issued]


def test_a_write_back_error_fails_every_write_it_could_be_from(tmp_path, monkeypatch):
    """Buffered I/O (no O_DIRECT): the kernel reports a write-back error once, to whichever fdatasync
    meets it first, whatever write its page was from. Two writes both written before the failing sync
    began both fail (their subgroups stay in host memory and are written again), rather than one of
    them counting as stored with a lost page; later writes are not charged with it."""
    from fsdp_offload.cache import aligned_host_buffer

    both_written = threading.Semaphore(0)
    # the first sync meets the error once both writes are in the page cache
    tier = buffered_tier(tmp_path, monkeypatch, both_written.release,
                         lambda: both_written.acquire(timeout=5) and both_written.acquire(timeout=5))  # fmt: skip
    try:
        buf = aligned_host_buffer(16384).fill_(5)
        futures = issued_apart(lambda: tier.write(0, buf), lambda: tier.write(1, buf))
        for key, fut in enumerate(futures):
            with pytest.raises(OSError, match=f"writing subgroup {key} back to {tier.path} failed: Input/output error"):
                fut.result()
        for key in (0, 1):  # written again: they count now
            tier.write(key, buf).result()
            out = aligned_host_buffer(16384)
            tier.read(key, out).result()
            assert bool((out == 5).all())
    finally:
        tier.close()


def test_a_write_that_starts_while_a_sync_runs_is_charged_with_its_error(tmp_path, monkeypatch):
    """Buffered I/O: a write whose pages reach the page cache while an fdatasync is running may be the
    one that sync fails on: when it fails, that write fails too (its subgroup is written again)."""
    from fsdp_offload.cache import aligned_host_buffer

    sync_running, second_written = threading.Event(), threading.Event()
    # the first write's sync: the second write lands while it runs, then it fails
    tier = buffered_tier(tmp_path, monkeypatch, lambda: sync_running.is_set() and second_written.set(),
                         lambda: sync_running.set() or second_written.wait(timeout=5))  # fmt: skip
    try:
        buf = aligned_host_buffer(16384).fill_(5)

        def second_while_the_sync_runs() -> Future:
            assert sync_running.wait(timeout=5)
            return tier.write(1, buf)

        first, second = issued_apart(lambda: tier.write(0, buf), second_while_the_sync_runs)
        for key, fut in ((0, first), (1, second)):
            with pytest.raises(OSError, match=f"writing subgroup {key} back to {tier.path} failed: Input/output error"):
                fut.result()
    finally:
        tier.close()


def _count_alone(rank: int, world: int) -> None:
    node._job_node_ranks = 4  # what an earlier job in this process counted
    assert node.node_ranks() == 1


def test_a_world_of_one_is_one_rank_on_its_node():
    from dist_utils import run_ranks

    run_ranks(1, _count_alone)
