"""Every part of a checkpoint is checked and its commit is durable: a manifest written last names each
part with its step and digest, every entry (model, trainer state, optimizer) carries a CRC32; a bit
flipped anywhere, a part from another step, a part missing or cut short is refused naming the part and
the older checkpoint; the commit refuses to finish without a part; files and dirs are fsynced before
the rename that commits them; one run at a time writes a checkpoint dir."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from fsdp_offload.checkpoint import (
    MANIFEST, RunDirBusy, RunDirLock, FileOps, check_checkpoint, load_checkpoint, save_checkpoint,
)  # fmt: skip
from fsdp_offload.dcp_reader import read_dcp_metadata

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
RUN = {"world_size": 1}


def saved(directory, step: int, ops: FileOps | None = None) -> str:
    """A checkpoint of a Linear and an AdamW after `step` steps, with trainer state as train.py's."""
    torch.manual_seed(step)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(step):
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
    state = {"step": step, "data": {"position": 10 * step}, "rng": torch.get_rng_state()}
    return save_checkpoint(str(directory), step, model, optimizer, RUN, state, keep=5, ops=ops)


def resume(path: str) -> dict:
    """What a resume does: the checks, then the load; returns the trainer state."""
    check_checkpoint(path, RUN)
    model = torch.nn.Linear(8, 8)
    return load_checkpoint(path, model, torch.optim.AdamW(model.parameters()))


def test_the_manifest_names_every_part_with_its_step_and_digest(tmp_path):
    ck = saved(tmp_path, 2)
    manifest = json.loads(open(os.path.join(ck, MANIFEST)).read())
    files = {os.path.relpath(os.path.join(d, f), ck) for d, _, fs in os.walk(ck) for f in fs} - {MANIFEST}
    assert set(manifest["parts"]) == files and manifest["step"] == 2
    assert all(p["step"] == 2 and ("sha256" in p or "bytes" in p) for p in manifest["parts"].values())
    for part in ("model", "optimizer"):  # every entry has a CRC32
        keys = read_dcp_metadata(os.path.join(ck, part, ".metadata")).storage_data
        assert len(manifest["entries"][part]) == len(keys) > 0
    assert resume(ck)["data"] == {"position": 20}


@pytest.mark.bad_input
def test_a_bit_flipped_anywhere_in_the_data_is_refused_naming_the_file(tmp_path):
    """Single-bit flips across every data file (tensors, the trainer state, the optimizer's state and
    hyperparameters, the zip containers around them): each is refused naming the file and the fix."""
    good = saved(tmp_path / "good", 1)
    data_files = sorted(os.path.relpath(os.path.join(d, f), good) for d, _, fs in os.walk(good) for f in fs if f.endswith(".distcp"))
    trials = 0
    for name in data_files:
        size = os.path.getsize(os.path.join(good, name))
        for offset in range(7, size, max(1, size // 16)):
            ck = str(tmp_path / f"t{trials}" / "step_00000001")
            shutil.copytree(good, ck)
            with open(os.path.join(ck, name), "r+b") as f:
                f.seek(offset)
                byte = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([byte ^ (1 << (offset % 8))]))
            with pytest.raises(ValueError, match=rf"cannot be read \({re.escape(name)} at offset \d+ \(.*\): its CRC32 differs "
                               r"from the manifest's .*restore it, or resume with"):  # fmt: skip
                resume(ck)
            trials += 1
    assert trials >= 40


@pytest.mark.bad_input
@pytest.mark.parametrize("part", ["optimizer", "model", "run.json"])
def test_a_part_from_another_step_is_refused_naming_it_and_the_older_checkpoint(tmp_path, part):
    one, two = saved(tmp_path, 1), saved(tmp_path, 2)
    target = os.path.join(two, part)
    if os.path.isdir(target):
        shutil.rmtree(target)
        shutil.copytree(os.path.join(one, part), target)
    else:
        shutil.copy(os.path.join(one, part), target)
    what = "run.json is of step 1, its dir of step 2" if part == "run.json" else f"{part}/.metadata differs from the one the manifest names"
    with pytest.raises(ValueError, match=rf"checkpoint {re.escape(two)} cannot be read \({what}.*resume with checkpoint.resume={re.escape(one)}$"):
        resume(two)


@pytest.mark.bad_input
@pytest.mark.parametrize("damage", ["missing", "short", "symlink", "no manifest", "manifest garbled"])
def test_a_missing_short_or_linked_part_is_refused_naming_it(tmp_path, damage):
    one, two = saved(tmp_path, 1), saved(tmp_path, 2)
    victim = os.path.join(two, "model", "__0_0.distcp")
    if damage == "missing":
        os.remove(victim)
    elif damage == "short":
        os.truncate(victim, os.path.getsize(victim) - 1)
    elif damage == "symlink":
        os.remove(victim)
        os.symlink(os.path.join(one, "model", "__0_0.distcp"), victim)
    elif damage == "no manifest":
        os.remove(os.path.join(two, MANIFEST))
    else:
        with open(os.path.join(two, MANIFEST), "w") as f:
            f.write("{garbage")
    named = MANIFEST if "manifest" in damage else "model/__0_0.distcp"
    with pytest.raises(ValueError, match=rf"cannot be read \({re.escape(named)} .*resume with checkpoint.resume={re.escape(one)}$"):
        resume(two)


class DeletesAPart(FileOps):
    """Removes the model's .metadata just before the commit writes run.json: a part lost mid-commit."""

    def write_file(self, path: str, data: bytes) -> None:
        if path.endswith("run.json"):
            os.remove(os.path.join(os.path.dirname(path), "model", ".metadata"))
        super().write_file(path, data)


@pytest.mark.bad_input
def test_the_commit_refuses_to_finish_without_every_part(tmp_path):
    older = saved(tmp_path, 1)
    with pytest.raises(ValueError, match=r"model/.metadata: missing: the checkpoint is not committed"):
        saved(tmp_path, 2, ops=DeletesAPart())
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002.tmp"]  # never renamed to step_00000002
    assert resume(older)["step"] == 1


class RecordingOps(FileOps):
    """Records the commit's fsyncs, writes and renames in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def fsync_file(self, path: str) -> None:
        self.calls.append(("fsync_file", path))
        super().fsync_file(path)

    def fsync_dir(self, path: str) -> None:
        self.calls.append(("fsync_dir", path))
        super().fsync_dir(path)

    def write_file(self, path: str, data: bytes) -> None:
        self.calls.append(("write_file", path))
        super().write_file(path, data)

    def replace(self, src: str, dst: str) -> None:
        self.calls.append(("replace", src))
        super().replace(src, dst)


def durability_faults(calls: list[tuple[str, str]], final: str) -> list[str]:
    """What is wrong with the order of a commit's calls: each file and dir of the checkpoint fsynced
    before the rename that commits it, the manifest written after every other part, the parent dir
    fsynced after the rename."""
    tmp = final + ".tmp"
    renamed = [i for i, (op, path) in enumerate(calls) if op == "replace" and path == tmp]
    if len(renamed) != 1:
        return [f"{tmp} renamed {len(renamed)} times"]
    at = renamed[0]
    faults = []
    for here, _, files in os.walk(final):
        for path in [here] + [os.path.join(here, f) for f in files]:
            synced = os.path.join(tmp, os.path.relpath(path, final)).rstrip("/.")
            op = "fsync_dir" if os.path.isdir(path) else "fsync_file"
            if (op, os.path.normpath(synced)) not in calls[:at]:
                faults.append(f"{path} not fsynced before the rename")
    writes = [path for op, path in calls if op == "write_file"]
    if not writes or not writes[-1].endswith(MANIFEST):
        faults.append("the manifest is not the last file written")
    if ("fsync_dir", os.path.dirname(final)) not in calls[at + 1 :]:
        faults.append("the parent dir is not fsynced after the rename")
    return faults


def test_files_and_dirs_are_fsynced_before_the_rename_that_commits_them(tmp_path):
    ops = RecordingOps()
    final = saved(tmp_path, 3, ops=ops)
    assert durability_faults(ops.calls, final) == []
    # the check itself catches a broken order: the rename moved before the last fsync, the parent's fsync dropped
    at = next(i for i, (op, _) in enumerate(ops.calls) if op == "replace")
    early = ops.calls[: at - 1] + [ops.calls[at], ops.calls[at - 1]] + ops.calls[at + 1 :]
    assert any("not fsynced before the rename" in f for f in durability_faults(early, final))
    assert durability_faults(ops.calls[: at + 1], final) == ["the parent dir is not fsynced after the rename"]


HOLD = """
import sys, time
from fsdp_offload.checkpoint import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.bad_input
def test_one_writer_per_checkpoint_dir_and_a_dead_holder_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=rf"checkpoint.dir={tmp_path} is being written by another run \(host "
                           rf"\S+, pid {holder.pid}, since .*\): one run writes a dir at a time"):  # fmt: skip
            RunDirLock(str(tmp_path)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunDirLock(str(tmp_path)):  # the dead holder's lock is gone with it
        with pytest.raises(RunDirBusy, match=rf"pid {os.getpid()}"):
            RunDirLock(str(tmp_path)).acquire()
    RunDirLock(str(tmp_path)).acquire().release()


def test_a_checkpoint_of_other_settings_offers_an_older_one_of_this_run_s(tmp_path):
    """A run at another world size (resume=never) saved over a run's dir: the refusal of its newest names
    the older checkpoint that this run's settings match, and how to start from it."""
    first = saved(tmp_path, 1)  # world_size 1
    model = torch.nn.Linear(8, 8)
    state = {"step": 2, "data": {"position": 20}, "rng": torch.get_rng_state()}
    newer = save_checkpoint(str(tmp_path), 2, model, torch.optim.AdamW(model.parameters()), {"world_size": 2}, state, keep=5)
    with pytest.raises(ValueError, match=rf"world_size=2, this run has world_size=1: .*; {first} was written with this "
                                         rf"run's settings: checkpoint.resume={first} starts from it$"):  # fmt: skip
        check_checkpoint(newer, RUN)
    with pytest.raises(ValueError, match=r"this run has world_size=3: resume with the same world_size, or point "
                                         r"checkpoint.dir elsewhere to start afresh$"):  # none matches: none offered
        check_checkpoint(newer, {"world_size": 3})
    with open(os.path.join(first, "model", ".metadata"), "r+b") as f:  # damaged: it would be refused, so it is not offered
        f.write(b"garbage")
    with pytest.raises(ValueError, match=r"this run has world_size=1: resume with the same world_size, or point "
                                         r"checkpoint.dir elsewhere to start afresh$"):  # fmt: skip
        check_checkpoint(newer, RUN)


def test_a_sigterm_or_ctrl_c_inside_dcp_ends_the_run_as_told(tmp_path, monkeypatch):
    """DCP wraps whatever a rank raises, a SIGTERM's SystemExit (train.py's) and Ctrl-C too, as a failed
    checkpoint on every rank: the run ends as it was told to, with no save's or load's traceback."""
    from fsdp_offload.dcp_reader import SafeFileSystemReader
    from fsdp_offload.entry_digests import DigestingFileSystemWriter

    good = saved(tmp_path / "ck", 1)

    def stopped(*args, **kwargs):
        raise SystemExit(143)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(DigestingFileSystemWriter, "write_data", stopped)
    with pytest.raises(SystemExit) as ended:
        saved(tmp_path / "ck", 2)
    assert ended.value.code == 143
    monkeypatch.setattr(SafeFileSystemReader, "read_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resume(good)
