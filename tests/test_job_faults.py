"""Faults of the job's dirs and options, said in one line once a job (not once a rank): a checkpoint
dir held by another run, a full checkpoint dir or run dir (a real 1 MiB tmpfs where the machine lets
us mount one), options that cannot be meant; the OSError of a dir the options chose names the path,
the option and the fix."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest
from test_faults import fill_up, small_tmpfs  # noqa: F401 - the fixture
from test_train import train

from fsdp_offload.job_errors import os_error_line


def errors(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.startswith("error:")]


def our_traceback(out: subprocess.CompletedProcess) -> bool:
    """Whether a traceback through the product was printed (torchrun prints its own when a rank exits 2)."""
    return any("fsdp_offload/" in line and ", line " in line for line in out.stderr.splitlines())


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "override, message",
    [
        ("data.seq_len=100000", "data.seq_len=100000 is above model.max_seq_len=256: the model is not built for such sequences"),
        ("train.min_lr_ratio=5", "train.min_lr_ratio=5: the cosine decays to lr * min_lr_ratio, which must be in [0, 1]"),
        ("train.collective_timeout_s=0", "train.collective_timeout_s=0 must be a number of seconds > 0"),
        ("train.watchdog_s=-1", "train.watchdog_s=-1 must be a number of seconds >= 0"),
        ("train.compile=maybe", "train.compile='maybe': choose true (torch.compile each block) or false"),
    ],
)
def test_what_cannot_be_meant_is_refused(override, message):
    from fsdp_offload.job_errors import JobError
    from fsdp_offload.recipe import read_config
    from test_recipes import composed

    with pytest.raises(JobError) as refused:  # read the same way on every rank: said once for the job
        read_config(composed(override))
    assert message in str(refused.value)


@pytest.mark.bad_input
def test_what_cannot_be_meant_is_refused_once_a_job(tmp_path):
    out = train(tmp_path / "run", "train.min_lr_ratio=5", ranks=2, check=False)
    message = "train.min_lr_ratio=5: the cosine decays to lr * min_lr_ratio, which must be in [0, 1]"
    assert out.returncode != 0 and len(errors(out)) == 1 and message in errors(out)[0], out.stderr[-2000:]
    assert not our_traceback(out)


def test_a_host_budget_above_the_machine_is_said(tmp_path):
    """A budget above the machine: refused, once, where the state would fill it (the 7B's, planned without
    being built); the tiny model's state takes 2 MiB of it, and it runs, warned of nothing."""
    out = train(tmp_path / "big", "model=7b", "offload.host_budget_gb=1000000", "train.steps=1", check=False)
    said = out.stdout + out.stderr
    assert out.returncode == 2 and said.count("error: host memory: the node's 1 rank(s) keep") == 1, said[-2000:]
    assert "is available: short by" in said, said[-2000:]
    out = train(tmp_path / "run", "offload.host_budget_gb=1000000", "train.steps=1")
    assert "more than the" not in out.stdout + out.stderr


HOLD = """
import sys, time
from fsdp_offload.checkpoint import RunDirLock
RunDirLock(sys.argv[1], sys.argv[2]).acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.bad_input
def test_a_second_run_on_one_checkpoint_dir_is_refused_at_start_naming_the_first(tmp_path):
    ck = tmp_path / "ck"
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(ck), "checkpoint.dir"], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        out = train(tmp_path / "run", f"checkpoint.dir={ck}", ranks=2, check=False)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert out.returncode != 0 and len(errors(out)) == 1, out.stderr[-3000:]
    assert f"checkpoint.dir={ck} is being written by another run (host " in errors(out)[0] and f"pid {first.pid}," in errors(out)[0]
    assert not [d for d in os.listdir(ck) if d.startswith("step_")]  # refused before anything was written
    # the holder is dead: its lock goes with it, and the next run writes the dir
    train(tmp_path / "run2", f"checkpoint.dir={ck}", "train.steps=2")
    assert os.path.isdir(ck / "step_00000002")


@pytest.mark.bad_input
def test_a_second_run_on_one_out_dir_is_refused_before_it_moves_the_first_runs_rows(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "metrics.jsonl").write_text('{"step": 0}\n')  # the live run's rows
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(out_dir), "train.out_dir"], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        out = train(tmp_path / "run", f"train.out_dir={out_dir}", f"checkpoint.dir={tmp_path / 'ck'}", ranks=2, check=False)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert out.returncode != 0 and len(errors(out)) == 1, out.stderr[-3000:]
    assert f"train.out_dir={out_dir} is being written by another run (host " in errors(out)[0], errors(out)[0]
    assert sorted(os.listdir(out_dir)) == [".lock", "metrics.jsonl"]  # its rows left where they were
    assert not (tmp_path / "ck").exists() or not [d for d in os.listdir(tmp_path / "ck") if d.startswith("step_")]


@pytest.mark.bad_input
def test_a_full_checkpoint_dir_is_one_line_once_a_job(tmp_path, small_tmpfs):  # noqa: F811
    out = train(tmp_path / "run", f"checkpoint.dir={small_tmpfs}", "train.steps=2", ranks=2, check=False)
    assert out.returncode != 0 and len(errors(out)) == 1 and not our_traceback(out), out.stderr[-3000:]
    line = errors(out)[0]
    assert f"checkpoint.dir={small_tmpfs}: cannot write {small_tmpfs}/" in line and "No space left on device" in line, line
    assert "free space on that file system, or point checkpoint.dir at one with room" in line
    assert not [d for d in os.listdir(small_tmpfs) if d.startswith("step_")]  # the half-written one is gone, freeing its room


@pytest.mark.bad_input
def test_a_full_run_dir_is_one_line_naming_train_out_dir(tmp_path, small_tmpfs):  # noqa: F811
    filler = fill_up(small_tmpfs)
    out = train(tmp_path / "run", f"train.out_dir={small_tmpfs}", "train.steps=2", check=False)
    os.remove(filler)
    assert out.returncode != 0 and len(errors(out)) == 1 and not our_traceback(out), out.stderr[-3000:]
    line = errors(out)[0]
    assert f"train.out_dir={small_tmpfs}" in line and "No space left on device" in line and "free space" in line, line


@pytest.mark.parametrize(
    "code, fix",
    [
        (errno.ENOSPC, "free space on that file system, or point checkpoint.dir at one with room"),
        (errno.EROFS, "the file system is read-only: point checkpoint.dir at a writable one"),
        (errno.EACCES, f"uid {os.getuid()} may not write there: fix the dir's mode or owner, or point checkpoint.dir elsewhere"),
        (errno.ELOOP, "a symlink is in the way, and files are never written through links: remove it or point checkpoint.dir elsewhere"),
        (errno.ENOLCK, "its file system takes no flock (Lustre without -o flock, NFS without lockd), which keeps a second run out "
                       "of the dir: mount it with flock, or point checkpoint.dir at a dir on a file system that has it"),
    ],
)
def test_an_os_error_names_the_path_the_option_and_the_fix(tmp_path, code, fix):
    path = tmp_path / "ck" / "step_00000002.tmp" / "run.json"
    line = os_error_line(OSError(code, os.strerror(code), str(path)), {"train.out_dir": "/elsewhere", "checkpoint.dir": str(tmp_path / "ck")})
    assert line == f"checkpoint.dir={tmp_path / 'ck'}: cannot write {path} ({os.strerror(code)}): {fix}"


@pytest.mark.bad_input
def test_a_run_dir_whose_file_system_takes_no_flock_is_refused_naming_the_fix(tmp_path, monkeypatch):
    """Lustre mounted without flock answers ENOSYS: the run cannot keep a second one out, and says so."""
    import fcntl

    from fsdp_offload.checkpoint.dir_lock import hold_run_dirs
    from fsdp_offload.job_errors import JobError

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    ck = tmp_path / "ck"
    with pytest.raises(JobError, match=rf"^checkpoint.dir={ck}: cannot write {ck}/.lock \(.*\): its file system takes no flock"):
        hold_run_dirs({"checkpoint.dir": str(ck), "train.out_dir": None})


@pytest.mark.bad_input
@pytest.mark.parametrize("position", [-1, 2.5, "7", True])
def test_a_data_position_that_cannot_be_is_refused(position):
    from fsdp_offload.data import DataConfig, TokenBatches
    from fsdp_offload.job_errors import JobError

    batches = TokenBatches(DataConfig(), vocab_size=256)
    state = {**batches.state_dict(), "position": position}
    with pytest.raises(JobError, match=rf"checkpoint's data position {position!r} is not a whole number >= 0"):
        batches.load_state_dict(state)


def _one_rank_never_answers(rank: int, world: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from fsdp_offload.job_errors import a_collective_timed_out, a_peer_stopped

    quick = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=1))
    if rank == 0:
        with pytest.raises(RuntimeError) as waited:
            dist.all_reduce(torch.ones(1), group=quick)  # rank 1 never joins it
        assert a_collective_timed_out(waited.value) and not a_peer_stopped(waited.value), str(waited.value)
    dist.barrier()  # (the job's own group is whole: rank 1 waits here for rank 0's timeout)
    assert not a_collective_timed_out(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))  # a rank that ended
    unreachable = dist.DistNetworkError("The client socket has timed out after 30000ms while trying to connect to (h, 1)")
    assert not a_collective_timed_out(unreachable)  # a store not reached: the network's fault, in its own words


def test_a_collective_that_waits_past_its_timeout_is_told_from_a_rank_that_ended():
    """train.py says a collective timeout in one line naming train.collective_timeout_s, and a peer's end as
    that peer's: gloo's own timeout error is told apart from its closed connection."""
    from dist_utils import run_ranks

    run_ranks(2, _one_rank_never_answers)


def test_a_sigterm_ends_the_run_and_takes_its_tier_files_with_it(tmp_path):
    """torchrun's, `timeout`'s or a scheduler's SIGTERM ends train.py as an error would: its tier files
    (RAM, where the tier is /dev/shm) are removed now, not by the next start on that tier dir."""
    import time

    from test_train import TRAIN

    tier = tmp_path / "tier"
    tier.mkdir()
    cmd = [sys.executable, TRAIN, f"hydra.run.dir={tmp_path / 'run'}", "train.progress=false", "train.steps=100000", "offload=disk",
           f"offload.tiers=[posix:{tier}]", "offload.host_budget_gb=0.0006", "offload.subgroup_numel=4096"]  # fmt: skip
    log = open(tmp_path / "train.log", "w")  # (a pipe no one reads would fill, and block the run's logging)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        rows = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (rows.exists() and rows.read_text().count("\n") >= 1):  # a step done: its tier files are in use
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "train.log").read_text()[-3000:]
            time.sleep(0.2)
        files = [f for f in os.listdir(tier / f"fsdp-offload-{os.getuid()}") if f.endswith(".subgroups")]
        assert files, "the run streams its state through the tier"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    private = tier / f"fsdp-offload-{os.getuid()}"
    assert not private.exists() or not [f for f in os.listdir(private) if f.endswith(".subgroups")]


def test_a_sigterm_is_taken_once_so_a_second_leaves_the_cleanup_whole():
    """scancel signals every process of a step, and torchrun then passes its own SIGTERM on: the first ends
    the run, a second is ignored while the tier files are removed (the launcher's SIGKILL ends a stuck one)."""
    from fsdp_offload.train import end_on_sigterm

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, end_on_sigterm)
        with pytest.raises(SystemExit) as ended:
            end_on_sigterm(signal.SIGTERM, None)
        assert ended.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


_WAITS_FOR_RANK0 = """
import os, signal, sys
from fsdp_offload.job_errors import wait_for_rank0_to_say_it
signal.signal(signal.SIGTERM, lambda *_: None)  # the test's SIGTERMs before the wait began: let be
os.write(1, b"waiting\\n")
ended = wait_for_rank0_to_say_it()
os.kill(os.getpid(), signal.SIGTERM)  # a second one, during the exit's cleanup: ignored
print("ended by the launcher" if ended else "waited it out", flush=True)
sys.exit(2)
"""


_SIGTERM_BEFORE_THE_WAIT = """
import os, signal
from fsdp_offload.job_errors import note_sigterm, wait_for_rank0_to_say_it
signal.signal(signal.SIGTERM, note_sigterm)  # as train.py holds it from the error on
os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, before the wait began
print("ended by the launcher" if wait_for_rank0_to_say_it() else "waited it out", flush=True)
"""


def test_the_launchers_sigterm_before_the_wait_began_ends_it_at_once():
    """A SIGTERM that comes between the error and the wait for rank 0 (train.py notes it) is not lost: the
    wait ends at once, as with one that comes during it."""
    out = subprocess.run([sys.executable, "-c", _SIGTERM_BEFORE_THE_WAIT], capture_output=True, text=True, check=True)
    assert out.stdout == "ended by the launcher\n", out


def test_a_rank_that_lets_rank0_say_the_error_ends_with_the_launchers_sigterm():
    """A rank other than 0 waits for rank 0 to print the job's error until torchrun, which rank 0's exit
    has stop the others, sends it SIGTERM: it exits then as it would have after the wait, and ignores a
    second SIGTERM. (SIGTERM is sent until the child ends: one sent before its wait began is let be.)"""
    child = subprocess.Popen([sys.executable, "-c", _WAITS_FOR_RANK0], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "waiting\n"
    while child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
    out = child.stdout.read()
    assert child.returncode == 2 and out == "ended by the launcher\n", (child.returncode, out)
