"""Checkpoints can be trusted: one never runs code on load (a pickle with a side effect, here creating
a file, planted in either .metadata, in any entry of any data file, or in run.json, is refused with an
error naming the file, and the side effect does not happen: DCP's own reader would unpickle .metadata
with plain pickle and its load planner object entries with weights_only=False; ours load DCP's
metadata classes, tensors and plain values only); saving never deletes the checkpoint just written, saves a step again, and fails on
every rank when rank 0 cannot commit; resuming takes the newest complete checkpoint."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import operator
import os
import pickle
import re
import shutil
import zlib
from datetime import timedelta
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_utils import free_port

from fsdp_offload.checkpoint import (
    CheckpointConfig, FileOps, check_checkpoint, latest_checkpoint, load_checkpoint, resume_point, save_checkpoint,
)  # fmt: skip
from fsdp_offload.dcp_reader import MetadataUnpickler, read_dcp_metadata, reading_failed
from fsdp_offload.entry_digests import entry_key
from fsdp_offload.job_errors import JobError
from fsdp_offload.storage import TierError


class SideEffect:
    """Unpickling it creates `path`: what a crafted checkpoint could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.bad_input
@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
def test_a_pickle_with_a_side_effect_is_refused_without_running(tmp_path):
    """A checkpoint whose trainer state holds a pickle that runs code, with a manifest that matches
    it (whoever crafted it wrote one: digests find damage, not malice): refused, and nothing runs."""
    model = torch.nn.Linear(4, 4)
    marker = tmp_path / "ran"
    ck = save_checkpoint(str(tmp_path), 1, model, torch.optim.AdamW(model.parameters()), {"world_size": 1},
                         {"step": 1, "evil": SideEffect(str(marker))})  # fmt: skip
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"\(model/ entry rank0, the trainer state, holds more than tensors and plain values"):
        load_checkpoint(ck, model, torch.optim.AdamW(model.parameters()))
    assert not marker.exists(), "the checkpoint's pickle ran"
    assert os.listdir(os.path.join(ck, "model"))  # the checkpoint is left as it was


class ReturnsTheRealMetadata:
    """Unpickling it creates `path`, then returns the real metadata: a resume would go on as if nothing
    had happened (what the outside-in campaign found DCP's reader doing, rc 0)."""

    def __init__(self, path: str, metadata) -> None:
        self.path, self.metadata = path, metadata

    def __reduce__(self):
        return (operator.itemgetter(1), ((SideEffect(self.path), self.metadata),))


def trained_checkpoint(directory) -> str:
    """A checkpoint of a Linear and an AdamW that took a step: tensors, optimizer state and trainer
    state in both parts."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return save_checkpoint(str(directory), 1, model, optimizer, {"world_size": 1}, {"step": 1, "rng": torch.get_rng_state()})


def resume(path: str) -> None:
    """What a resume reads, in its order: the run note and both .metadata, then every entry."""
    check_checkpoint(path, {"world_size": 1})
    model = torch.nn.Linear(4, 4)
    load_checkpoint(path, model, torch.optim.AdamW(model.parameters()))


@pytest.mark.bad_input
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("part", ["model", "optimizer"])
@pytest.mark.parametrize("returns_metadata", [False, True])
def test_a_pickle_planted_in_metadata_never_runs(tmp_path, part, returns_metadata):
    ck = trained_checkpoint(tmp_path / "ck")
    marker = tmp_path / "ran"
    metadata_file = os.path.join(ck, part, ".metadata")
    with open(metadata_file, "rb") as f:
        real = pickle.load(f)
    payload = pickle.dumps(ReturnsTheRealMetadata(str(marker), real) if returns_metadata else SideEffect(str(marker)))
    assert pickle.loads(payload) is not None and marker.exists()  # a plain unpickler runs it ...
    marker.unlink()
    with open(metadata_file, "wb") as f:
        f.write(payload)
    reseal(ck, part, ".metadata", 0, payload)  # as its author would
    with pytest.raises(ValueError, match=rf"{re.escape(ck)} cannot be read \({part}/.metadata not loaded as DCP metadata "
                       r"\(UnpicklingError: it names .*, which DCP metadata never holds"):  # fmt: skip
        check_checkpoint(ck, {"world_size": 1})
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=rf"{part}/.metadata not loaded as DCP metadata"):
        load_checkpoint(ck, model, torch.optim.AdamW(model.parameters()))
    assert not marker.exists(), "the checkpoint's .metadata ran"  # ... ours does not


def _entries(ck: str) -> list[tuple[str, str, int, int]]:
    """(part, data file, offset, length) of every entry of the checkpoint."""
    found = []
    for part in ("model", "optimizer"):
        for info in read_dcp_metadata(os.path.join(ck, part, ".metadata")).storage_data.values():
            found.append((part, info.relative_path, info.offset, info.length))
    return found


@pytest.mark.bad_input
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_pickle_planted_in_any_entry_of_any_file_a_resume_reads_never_runs(tmp_path):
    """Each entry of each data file (tensors, the trainer state, the optimizer's state and hyperparameters)
    and run.json in turn holds a payload; each is refused naming its file, and none runs."""
    good = trained_checkpoint(tmp_path / "good")
    marker = tmp_path / "ran"
    payload = pickle.dumps(SideEffect(str(marker)), protocol=2)
    entries = _entries(good)
    assert len(entries) >= 10 and {p for p, *_ in entries} == {"model", "optimizer"}
    for n, (part, name, offset, length) in enumerate(entries + [("", "run.json", 0, None)]):
        for resealed in (False, True):  # True: the manifest made to match the payload, as its author would
            ck = str(tmp_path / f"trial{n}{resealed}" / "step_00000001")
            shutil.copytree(good, ck)
            target = os.path.join(ck, part, name)
            planted = payload if length is None else payload.ljust(length, b"\0")
            with open(target, "r+b") as f:
                assert length is None or length >= len(payload)
                f.seek(offset)
                f.write(planted)
                if length is None:
                    f.truncate()
            if resealed:
                reseal(ck, part, name, offset, planted)
            with pytest.raises(ValueError) as refused:
                resume(ck)
            assert f"{part}/{name}".lstrip("/") in str(refused.value), str(refused.value)
            assert not marker.exists(), f"a payload in {part}/{name} at {offset} ran"


def reseal(ck: str, part: str, name: str, offset: int, planted: bytes) -> None:
    """Rewrites the manifest so that it agrees with what was planted: a file's sha256, an entry's CRC32."""
    manifest_path = os.path.join(ck, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    rel = f"{part}/{name}".lstrip("/")
    if "sha256" in manifest["parts"][rel]:
        with open(os.path.join(ck, rel), "rb") as f:
            manifest["parts"][rel]["sha256"] = hashlib.sha256(f.read()).hexdigest()
    else:
        for index, info in read_dcp_metadata(os.path.join(ck, part, ".metadata")).storage_data.items():
            if info.relative_path == name and info.offset == offset:
                manifest["entries"][part][entry_key(index)] = zlib.crc32(planted)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)


def test_the_metadata_unpickler_admits_what_dcp_writes_and_nothing_else(tmp_path):
    ck = trained_checkpoint(tmp_path)
    for part in ("model", "optimizer"):
        with open(os.path.join(ck, part, ".metadata"), "rb") as f:
            data = f.read()
        assert MetadataUnpickler(io.BytesIO(data)).load() == pickle.loads(data)
    for forbidden in (os.system, operator.itemgetter(1), torch.load, SideEffect("x")):
        with pytest.raises(pickle.UnpicklingError, match="which DCP metadata never holds"):
            MetadataUnpickler(io.BytesIO(pickle.dumps(forbidden))).load()


def save(directory, step: int, weight: float, keep: int = 2, ops: FileOps | None = None) -> str:
    """A checkpoint of a 4x4 Linear whose weights are all `weight`, as train.py saves one."""
    model = torch.nn.Linear(4, 4)
    torch.nn.init.constant_(model.weight, weight)
    optimizer = torch.optim.AdamW(model.parameters())
    return save_checkpoint(str(directory), step, model, optimizer, {"world_size": 1}, {"step": step}, keep=keep, ops=ops)


def saved_weight(path: str) -> float:
    model = torch.nn.Linear(4, 4)
    load_checkpoint(path, model, torch.optim.AdamW(model.parameters()))
    return float(model.weight[0, 0])


@pytest.mark.bad_input
@pytest.mark.parametrize("keep", [0, -1])
def test_keep_below_one_is_refused(keep):
    with pytest.raises(ValueError, match=rf"checkpoint.keep={keep}: at least the checkpoint just written .* checkpoint.keep=1"):
        CheckpointConfig(dir="/tmp/runs", keep=keep)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("keep", [1, 2, 0])  # 0: what save_checkpoint is given directly; the config refuses it
def test_pruning_keeps_the_checkpoint_just_written(tmp_path, keep):
    for step in (1, 2, 3):
        path = save(tmp_path, step, weight=step, keep=keep)
    assert sorted(os.listdir(tmp_path)) == [f"step_{s:08d}" for s in (3, 2, 1)[: max(1, keep)]][::-1]
    assert latest_checkpoint(str(tmp_path)) == path and saved_weight(path) == 3
    # a step saved again while newer ones exist (a run resumed from an earlier checkpoint) is kept too
    save(tmp_path, 1, weight=7, keep=keep)
    assert os.path.isdir(tmp_path / "step_00000001") and saved_weight(str(tmp_path / "step_00000001")) == 7


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_step_saved_again_replaces_the_old_copy(tmp_path):
    save(tmp_path, 4, weight=1.0)
    path = save(tmp_path, 4, weight=2.0)
    assert sorted(os.listdir(tmp_path)) == ["step_00000004"]  # no .tmp nor .old left behind
    assert saved_weight(path) == 2.0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_latest_checkpoint_is_never_one_being_written_or_removed(tmp_path):
    good = save(tmp_path, 2, weight=1.0)
    (tmp_path / "step_00000010.tmp").mkdir()
    (tmp_path / "step_00000011.old").mkdir()
    assert latest_checkpoint(str(tmp_path)) == good
    assert resume_point(CheckpointConfig(dir=str(tmp_path)))[0] == good
    save(tmp_path, 3, weight=1.0)  # the next save (its run holds the dir): every step's leftover goes
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000003"]


class FullDisk(FileOps):
    """Writes fail as on a full file system."""

    def write_file(self, path: str, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", path)


def _commit_fails_on_rank0(rank: int, world: int, directory: str) -> None:
    # rank 0 cannot write the run note (a full disk, say): it says so in one line naming the file, the
    # option and the fix; the other ranks fail too, pointing at rank 0's line
    wanted = (rf"committing checkpoint .*step_00000003: checkpoint.dir={directory}: cannot write .*run.json \(No space left "
              r"on device\): free space on that file system, or point checkpoint.dir at one with room" if rank == 0 else
              r"committing checkpoint .*step_00000003 failed on rank 0 \(JobError: .*\): rank 0 says how to fix it")  # fmt: skip
    with pytest.raises(JobError, match=wanted):
        save(directory, 3, weight=1.0, ops=FullDisk() if rank == 0 else None)


def _entry(rank: int, world: int, port: int, directory: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a short timeout: a rank left waiting for rank 0 fails the test rather than hanging it
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        _commit_fails_on_rank0(rank, world, directory)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_failure_on_rank0_reaches_the_other_ranks(tmp_path):
    mp.start_processes(_entry, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    assert latest_checkpoint(str(tmp_path)) is None


@pytest.mark.bad_input
@pytest.mark.parametrize("content", ["{garbage", "[]", None])
def test_an_unreadable_run_file_is_refused_naming_the_checkpoint_before(tmp_path, monkeypatch, content):
    for step in (2, 4):
        ck = tmp_path / f"step_{step:08d}"
        for part in ("model", "optimizer"):
            (ck / part).mkdir(parents=True)
            (ck / part / ".metadata").write_bytes(b"")
        if content is not None:  # None: run.json missing (copied in part)
            (ck / "run.json").write_text(content)
    older, newer = (re.escape(str(tmp_path / f"step_{step:08d}")) for step in (2, 4))
    with pytest.raises(ValueError, match=rf"checkpoint {newer} cannot be read \(run.json: .*resume with checkpoint.resume={older}$"):
        check_checkpoint(str(tmp_path / "step_00000004"), {})
    monkeypatch.chdir(tmp_path)  # the same, given as a relative path from inside the checkpoints' dir
    with pytest.raises(ValueError, match=r"checkpoint step_00000004 cannot be read .*resume with checkpoint.resume=step_00000002$"):
        check_checkpoint("step_00000004/", {})


def test_only_reading_the_checkpoint_is_called_damaged(tmp_path):
    """A failure while loading is put down to the checkpoint only when reading its files failed; a tier
    that fails as subgroups go to it, or a bug, keeps its own error."""
    ck = str(tmp_path / "step_00000004")
    assert reading_failed(EOFError(), ck) and reading_failed(OSError(5, "Input/output error", f"{ck}/model/__0_0.distcp"), ck)
    assert reading_failed(RuntimeError("PytorchStreamReader failed reading zip archive"), ck)
    assert not reading_failed(TierError("write failed: No space left on device"), ck)
    assert not reading_failed(OSError(28, "No space left on device", "/nvme/tier/file"), ck)
    assert not reading_failed(OSError(5, "Input/output error", f"{ck}0/model/__0_0.distcp"), ck)  # a sibling, not inside
    assert not reading_failed(KeyError("optimizer.rank0.subgroup_000000"), ck)


@pytest.mark.bad_input
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_damaged_part_is_named_as_damaged_before_any_config_is_compared(tmp_path):
    """A run.json edited to another model, a missing .metadata, a manifest of wrong types or naming a file
    outside the checkpoint: each is named as a damaged checkpoint, with the older one to resume instead, not as
    a config to change."""
    older = re.escape(save(tmp_path, 2, 1.0))

    def refused(edit, problem: str) -> None:
        ck = save(tmp_path, 4, 1.0)
        edit(ck)
        with pytest.raises(JobError, match=rf"step_00000004 cannot be read \({problem}.*resume with checkpoint.resume={older}$"):
            check_checkpoint(ck, {"world_size": 1})
        shutil.rmtree(ck)

    def run_json_of_another_world(ck: str) -> None:
        note = json.loads(open(os.path.join(ck, "run.json")).read())
        with open(os.path.join(ck, "run.json"), "w") as f:
            json.dump({**note, "world_size": 2}, f)

    def manifest_with(**changes) -> Callable[[str], None]:
        def edit(ck: str) -> None:
            manifest = json.loads(open(os.path.join(ck, "manifest.json")).read())
            for key, change in changes.items():
                manifest[key] = change(manifest[key])
            with open(os.path.join(ck, "manifest.json"), "w") as f:
                json.dump(manifest, f)

        return edit

    refused(run_json_of_another_world, "run.json differs from the one the manifest names")
    refused(lambda ck: os.remove(os.path.join(ck, "optimizer", ".metadata")), "no optimizer/.metadata: written by an older")
    crc_text = lambda entries: {**entries, "model": {k: "x" for k in entries["model"]}}  # noqa: E731
    refused(manifest_with(entries=crc_text), r"manifest.json cannot be read \(ValueError: invalid literal")
    refused(manifest_with(entries=lambda entries: {**entries, "model": list(entries["model"])}), r"manifest.json cannot be read \(TypeError")
    outside = lambda parts: {**parts, "../../outside": {"step": 4, "bytes": 1}}  # noqa: E731
    refused(manifest_with(parts=outside), r"manifest.json cannot be read \(ValueError: part '../../outside' lies outside")


@pytest.mark.bad_input
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_checkpoint_whose_trainer_state_is_of_another_step_than_its_run_file_is_refused(tmp_path, monkeypatch):
    """Written whole, manifest and all (as a crafted one would be): resumed, it would train steps it claims done."""
    import hydra

    import fsdp_offload.checkpoint.run as checkpoint_run
    from fsdp_offload.train import run

    def train(steps: int) -> None:
        with hydra.initialize_config_module("fsdp_offload.recipes", version_base="1.3"):
            run(hydra.compose("train", overrides=[f"train.steps={steps}", "train.progress=false", f"train.out_dir={tmp_path}/out",
                                                  f"checkpoint.dir={tmp_path}/ck"]))  # fmt: skip

    pack = checkpoint_run._pack
    monkeypatch.setattr(checkpoint_run, "_pack", lambda state: pack({**state, "step": 1}))
    train(2)
    monkeypatch.setattr(checkpoint_run, "_pack", pack)
    with pytest.raises(JobError, match=r"step_00000002: its trainer state is of step 1, its run.json of step 2"):
        train(4)


@pytest.mark.bad_input
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_resume_on_other_data_names_the_checkpoint(tmp_path):
    import hydra

    from fsdp_offload.train import run

    def train(*overrides: str) -> None:
        with hydra.initialize_config_module("fsdp_offload.recipes", version_base="1.3"):
            run(hydra.compose("train", overrides=["train.progress=false", f"train.out_dir={tmp_path}/out",
                                                  f"checkpoint.dir={tmp_path}/ck", *overrides]))  # fmt: skip

    train("train.steps=2")
    with pytest.raises(JobError, match=r"^checkpoint \S+step_00000002: checkpoint was taken with seed=0 but data.seed is now 1"):
        train("train.steps=4", "data.seed=1")
