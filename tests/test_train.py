"""The training script end to end: the README's main command, kill and resume, bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "scripts" / "train.py")
METRICS = {
    "step", "loss", "lr", "tokens_per_s", "forward_s", "backward_s", "update_s", "step_s", "update_mparams_per_s",
    "effective_io_gbps", "bytes_read", "bytes_written", "host_peak_gib", "grad_norm", "cache_hits", "subgroups_per_tier",
    "lock_wait_s", "time", "step_call_s", "exposed_update_s", "overlap_s", "subgroups_on_gpu", "skipped", "cpu_threads",
    "host_rss_gib", "open_fds", "norm_s", "cpu_kernel_s",
}  # fmt: skip


def train(tmp: Path | None, *overrides: str, ranks: int = 0, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, TRAIN] if ranks == 0 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),  # (a free port of its own)
        TRAIN,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_dir = [] if tmp is None else [f"hydra.run.dir={tmp}"]  # None: Hydra's own, timestamped, per process
    out = subprocess.run(
        cmd + [*run_dir, "train.progress=false", *overrides], capture_output=True, text=True, env=env, timeout=300, cwd=cwd
    )
    if check and out.returncode != 0:
        raise AssertionError(f"train.py failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_main_command_trains_the_tiny_model(tmp_path):
    train(tmp_path / "run")
    log = rows(tmp_path / "run" / "metrics.jsonl")
    assert len(log) == 50
    assert all(METRICS <= set(r) for r in log), METRICS - set(log[0])
    assert all(r["norm_s"] > 0 for r in log)  # the recipe clips: every step takes the norm
    assert all(0 < r["cpu_kernel_s"] < r["update_s"] for r in log)  # the CPU updates every subgroup, within the update
    first, last = np.mean([r["loss"] for r in log[:5]]), np.mean([r["loss"] for r in log[-5:]])
    assert last < first - 1.0, (first, last)
    assert sum(sum(r["bytes_read"].values()) for r in log) > 0  # the state really streamed through the tier


def test_auto_host_budget_is_sized_once_for_the_plan_and_the_optimizer(tmp_path):
    """host_budget_gb=auto is measured once, before the model is built: the placement the planner logs
    is the one the optimizer builds (the memory the process takes in between is the headroom's)."""
    out = train(tmp_path / "run", "offload.host_budget_gb=auto", "train.steps=2")
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert placement["plan"]["cache_slots"] == placement["built"]["cache_slots"]
    assert placement["plan"]["gpu_subgroups"] == placement["built"]["gpu_subgroups"]
    assert "offload.host_budget_gb=auto (" in out.stdout + out.stderr
    # what the step keeps on its device, as the run resolved the presets' auto, and why
    assert (placement["activation_checkpointing"], placement["reshard_after_forward"]) == (False, False)
    assert placement["step_memory_why"].startswith("auto: host memory holds the step keeping the activations and the gathered units")
    assert "activation checkpointing off, units kept gathered from forward to backward (auto: " in out.stdout + out.stderr


def test_plain_fsdp2_records_what_its_step_keeps_on_the_device(tmp_path):
    """offload=none (FSDP2 with torch AdamW) resolves the presets' auto from its 16 bytes a param and records it
    as the offloaded runs do, in placement.json (no plan, nothing built by the planner)."""
    train(tmp_path / "run", "offload=none", "train.steps=2")
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    assert "plan" not in placement and (placement["activation_checkpointing"], placement["reshard_after_forward"]) == (False, False)
    assert placement["step_memory_why"].startswith("auto: about ") and "keeping the activations and the gathered units" in (
        placement["step_memory_why"])


def test_two_tiers_are_measured_once_a_node_for_the_plan_and_the_optimizer(tmp_path):
    """Without a bandwidth profile, the node's first rank measures the tiers for the plan and hands the
    speeds to the node's other ranks; the plan hands them to the optimizer."""
    tiers = [tmp_path / "a", tmp_path / "b"]
    for d in tiers:
        d.mkdir()
    spec = ",".join(f"'posix:{d}'" for d in tiers)
    out = train(tmp_path / "run", f"++offload.tiers=[{spec}]", "++offload.placement=learned", "++offload.calibration_gb=0.01",
                "train.steps=2", ranks=2)  # fmt: skip
    logged = out.stdout + out.stderr
    assert [logged.count(f"measured posix:{d}:") for d in tiers] == [1, 1], logged[-3000:]
    assert logged.count("offload.overlap='auto'") == 1, logged[-3000:]  # the same on both ranks: said by rank 0
    assert "offload.overlap='auto': none" in logged  # a model on the CPU: the update inside step()


def final_state(ckpt: str, out: Path) -> dict:
    """The model (through DCP's own converter: a plain DCP checkpoint) and every rank's subgroups
    (their raw bytes, where the checkpoint's metadata says they lie)."""
    dcp_to_torch_save(f"{ckpt}/model", out)
    model = torch.load(out, weights_only=False)["model"]
    subgroups = {}
    for index, where in FileSystemReader(f"{ckpt}/optimizer").read_metadata().storage_data.items():
        if ".subgroup_" in index.fqn:
            with open(f"{ckpt}/optimizer/{where.relative_path}", "rb") as f:
                f.seek(where.offset)
                subgroups[index.fqn] = f.read(where.length)
    return {"model": model, "subgroups": subgroups}


@pytest.mark.bad_input
def test_killed_run_resumes_bit_for_bit(tmp_path):
    # the update overlapped with the next forward, as on a GPU ("auto" runs it inside step() on a CPU)
    common = ["train.steps=8", "checkpoint.every=4", "offload.overlap=next_forward"]
    train(tmp_path / "a", *common, f"checkpoint.dir={tmp_path}/ck_a", ranks=2)
    (tmp_path / "tier_b").mkdir()
    tier_b = f"offload.tiers=[posix:{tmp_path}/tier_b]"
    killed = train(tmp_path / "b", *common, tier_b, f"checkpoint.dir={tmp_path}/ck_b", "train.kill_at_step=4", ranks=2, check=False)
    assert killed.returncode != 0  # SIGKILLed right after the step-4 checkpoint
    assert len(list((tmp_path / "tier_b").rglob("*.subgroups"))) == 2  # the killed ranks' tier files
    resumed_run = train(tmp_path / "b2", *common, tier_b, f"checkpoint.dir={tmp_path}/ck_b", "checkpoint.resume=required", ranks=2)
    assert not list((tmp_path / "tier_b").rglob("*.subgroups"))  # its start removed them, its close its own
    assert f"resuming from {tmp_path}/ck_b/step_00000004" in resumed_run.stdout
    assert (tmp_path / "b2" / "rank1.metrics.jsonl").exists()  # every rank writes into the one run dir
    assert {r["rank"] for r in rows(tmp_path / "b2" / "rank1.metrics.jsonl")} == {1}  # rows merged from both still say whose
    assert {r["rank"] for r in rows(tmp_path / "b2" / "metrics.jsonl")} == {0}
    whole = {r["step"]: r["loss"] for r in rows(tmp_path / "a" / "metrics.jsonl")}
    resumed = {r["step"]: r["loss"] for r in rows(tmp_path / "b2" / "metrics.jsonl")}
    assert sorted(resumed) == [4, 5, 6, 7]
    assert all(resumed[s] == whole[s] for s in resumed), (whole, resumed)
    a = final_state(f"{tmp_path}/ck_a/step_00000008", tmp_path / "a.pt")
    b = final_state(f"{tmp_path}/ck_b/step_00000008", tmp_path / "b.pt")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert {k.split(".")[1] for k in a["subgroups"]} == {"rank0", "rank1"}
    assert a["subgroups"] == b["subgroups"]  # masters and moments, both ranks

    # the same checkpoint into another world size or model shape: refused before any training
    out = train(tmp_path / "c", *common, f"checkpoint.dir={tmp_path}/ck_b", "train.steps=12", check=False)
    assert out.returncode == 2 and "world_size=2" in out.stderr, out.stderr[-2000:]
    out = train(tmp_path / "d", *common, f"checkpoint.dir={tmp_path}/ck_b", "model.dim=128", ranks=2, check=False)
    assert "checkpoint" in out.stderr and "this run has model.dim=128" in out.stderr, out.stderr[-2000:]
    # one without its optimizer/ part (an older layout, or copied in part): refused, saying so
    shutil.copytree(f"{tmp_path}/ck_b/step_00000008", f"{tmp_path}/ck_old/step_00000008")
    shutil.rmtree(f"{tmp_path}/ck_old/step_00000008/optimizer")
    out = train(tmp_path / "e", *common, f"checkpoint.dir={tmp_path}/ck_old", check=False)
    assert out.returncode == 2 and "no optimizer/.metadata: written by an older" in out.stderr, out.stderr[-2000:]
    # a damaged one: refused in one line that names the checkpoint, the entry and the fix
    shutil.copytree(f"{tmp_path}/ck_b/step_00000008", f"{tmp_path}/ck_bad/step_00000008")
    where = next(info for index, info in FileSystemReader(f"{tmp_path}/ck_bad/step_00000008/optimizer").read_metadata()
                 .storage_data.items() if index.fqn == "optimizer.rank0.subgroup_000000")  # fmt: skip
    with open(f"{tmp_path}/ck_bad/step_00000008/optimizer/{where.relative_path}", "r+b") as f:
        f.seek(where.offset + 4096)
        f.write(b"\xff" * 64)
    out = train(tmp_path / "f", *common, f"checkpoint.dir={tmp_path}/ck_bad", "train.steps=12", ranks=2, check=False)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and errors and "ck_bad/step_00000008 cannot be read (optimizer/__" in errors[0], out.stderr[-3000:]
    assert "optimizer.rank0.subgroup_000000): subgroup 0 is corrupted" in errors[0] and "restore it, or resume with" in errors[0]
    # a model file cut short (an interrupted copy, a full disk): refused, naming the older checkpoint to resume from
    shutil.copytree(f"{tmp_path}/ck_b", f"{tmp_path}/ck_cut")
    for shard in Path(f"{tmp_path}/ck_cut/step_00000008/model").glob("*.distcp"):
        os.truncate(shard, shard.stat().st_size // 2)
    out = train(tmp_path / "g", *common, f"checkpoint.dir={tmp_path}/ck_cut", "train.steps=12", ranks=2, check=False)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and errors and f"checkpoint {tmp_path}/ck_cut/step_00000008 cannot be read (model/" in errors[0], out.stderr[-3000:]
    assert f"resume with checkpoint.resume={tmp_path}/ck_cut/step_00000004" in errors[0], errors[0]


def test_skipped_fp16_steps_keep_one_row_each_with_their_own_metrics(tmp_path):
    """With fp16 and the loss scale growing every step, steps overflow and are skipped now and then: a
    skip's metrics follow the end of the overlapped update before it, and each row gets its own."""
    train(tmp_path / "run", "train.steps=20", "offload.param_dtype=float16", "offload.loss_scale_growth_interval=1")
    log = rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(20)) and all("update_s" in r for r in log)
    assert log[0]["lr"] == pytest.approx(log[4]["lr"] / 5)  # each row's own lr: step 0 is 1/5 into the warmup
    skipped = [r["skipped"] for r in log]
    assert any(skipped) and not all(skipped)
    # the scale halves on a skipped step and doubles on a good one
    assert all(r["skipped"] == (r["loss_scale"] < prev["loss_scale"]) for prev, r in zip(log, log[1:]))


def test_a_run_resumed_into_its_own_dir_has_one_row_per_step(tmp_path):
    """Killed after step 3 with a checkpoint after step 2, resumed into the same run dir: steps 2 and 3
    are done again, and their rows replace the killed run's."""
    # the update not overlapped: step 2's row is written before the kill (else it waits for step 3)
    common = ["train.steps=4", "checkpoint.every=2", f"checkpoint.dir={tmp_path}/ck", "offload.overlap=none"]
    assert train(tmp_path / "run", *common, "train.kill_at_step=3", check=False).returncode != 0
    assert [r["step"] for r in rows(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]
    # a step to profile that the resumed run does not run: refused before anything is built
    out = train(tmp_path / "run", *common, "train.profile_step=1", check=False)
    assert out.returncode == 2 and "train.profile_step=1 is not a step of this run: it resumes from" in out.stderr, out.stderr[-2000:]
    assert "profile one of steps 2 to 3" in out.stderr
    train(tmp_path / "run", *common)
    assert [r["step"] for r in rows(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 3]
    typo = train(tmp_path / "run", *common[:2], f"checkpoint.dir={tmp_path}/cj", "checkpoint.resume=required", check=False)
    assert typo.returncode == 2 and "holds no complete checkpoint" in typo.stderr, typo.stderr[-2000:]
    assert not (tmp_path / "cj").exists()  # refused before the mistyped dir was made
    again = train(tmp_path / "run", *common)  # a finished run started again says so, and keeps its rows
    assert "nothing to run, the checkpoint is at step 4, train.steps=4" in again.stdout, again.stdout[-2000:]
    assert [r["step"] for r in rows(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_run_resumed_with_a_longer_schedule_follows_it_from_the_resumed_step(tmp_path):
    """Trained 4 steps of a 4-step schedule, then resumed with train.steps=8: the resumed steps take the
    8-step schedule's lr from the first of them (loading had put the checkpoint's lr in the optimizer,
    a step late otherwise), said once, naming the change; a changed weight decay is said and applied too."""
    train(tmp_path / "whole", "train.steps=8", "train.warmup_steps=2", "checkpoint.every=4", f"checkpoint.dir={tmp_path}/ck_whole")
    common = ["train.warmup_steps=2", "checkpoint.every=4", f"checkpoint.dir={tmp_path}/ck"]
    train(tmp_path / "short", "train.steps=4", *common)
    resumed = train(tmp_path / "longer", "train.steps=8", *common)
    whole = {r["step"]: r["lr"] for r in rows(tmp_path / "whole" / "metrics.jsonl")}
    longer = {r["step"]: r["lr"] for r in rows(tmp_path / "longer" / "metrics.jsonl")}
    assert sorted(longer) == [4, 5, 6, 7] and all(longer[s] == whole[s] for s in longer), (whole, longer)
    said = [line for line in (resumed.stdout + resumed.stderr).splitlines() if "other hyperparameters than the checkpoint's" in line]
    assert len(said) == 1 and "resumed at step 4" in said[0] and "train.steps 4 -> 8" in said[0], said
    # the same schedule: every lr as the checkpoint holds it, nothing said
    again = train(tmp_path / "again", "train.steps=8", "train.warmup_steps=2", f"checkpoint.dir={tmp_path}/ck_whole",
                  f"checkpoint.resume={tmp_path}/ck_whole/step_00000004")  # fmt: skip
    assert "other hyperparameters" not in again.stdout + again.stderr
    assert {r["step"]: r["lr"] for r in rows(tmp_path / "again" / "metrics.jsonl")} == {s: whole[s] for s in longer}
    decay = train(tmp_path / "decay", "train.steps=8", "train.warmup_steps=2", "train.weight_decay=0.0",
                  f"checkpoint.dir={tmp_path}/ck_whole", f"checkpoint.resume={tmp_path}/ck_whole/step_00000004")  # fmt: skip
    assert "train.weight_decay 0.1 -> 0.0" in decay.stdout + decay.stderr
    micro = train(tmp_path / "micro", "train.steps=5", "train.warmup_steps=2", "train.micro_batches=2", "offload.host_budget_gb=0.01",
                  f"checkpoint.dir={tmp_path}/ck_whole", f"checkpoint.resume={tmp_path}/ck_whole/step_00000004")  # fmt: skip
    said = [line for line in (micro.stdout + micro.stderr).splitlines() if "other hyperparameters than the checkpoint's" in line]
    assert len(said) == 1 and "train.micro_batches 1 -> 2" in said[0], said  # (its clip and micro-batch size: as saved)
    clip = train(tmp_path / "clip", "train.steps=5", "train.warmup_steps=2", "offload.max_grad_norm=0.5", "data.micro_batch=4",
                 f"checkpoint.dir={tmp_path}/ck_whole", f"checkpoint.resume={tmp_path}/ck_whole/step_00000004")  # fmt: skip
    assert "offload.max_grad_norm 1.0 -> 0.5" in clip.stdout + clip.stderr and "data.micro_batch 2 -> 4" in clip.stdout + clip.stderr
    loss = {r["step"]: r["loss"] for r in rows(tmp_path / "decay" / "metrics.jsonl")}
    assert loss[4] == {r["step"]: r["loss"] for r in rows(tmp_path / "again" / "metrics.jsonl")}[4]  # same params going in
    assert loss[5] != {r["step"]: r["loss"] for r in rows(tmp_path / "again" / "metrics.jsonl")}[5]  # step 4 decayed them less


def test_a_run_rewound_to_an_older_checkpoint_moves_the_newer_ones_aside(tmp_path):
    """Resumed from step 4 of a run that reached step 8: step 8 belongs to the run being re-done, and a
    later checkpoint.resume=auto must not go back to it. It is moved aside (kept), said once."""
    ck = tmp_path / "ck"
    train(tmp_path / "first", "train.steps=8", "checkpoint.every=4", f"checkpoint.dir={ck}")
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000004", "step_00000008"]
    out = train(tmp_path / "rewound", "train.steps=6", "checkpoint.every=2", f"checkpoint.dir={ck}",
                f"checkpoint.resume={ck}/step_00000004")  # fmt: skip
    said = [line for line in (out.stdout + out.stderr).splitlines() if "moved aside, kept" in line]
    assert len(said) == 1 and f"{ck}/step_00000008.superseded" in said[0], said
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000004", "step_00000006", "step_00000008.superseded"]
    later = train(tmp_path / "later", "train.steps=7", f"checkpoint.dir={ck}")
    assert f"resuming from {ck}/step_00000006" in later.stdout, later.stdout[-2000:]


@pytest.mark.bad_input
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=llama_nope"], "Could not find 'model/llama_nope'"),
        (["offload=nope"], "Could not find 'offload/nope'"),
        (["train.profile_steps=2"], "Could not override 'train.profile_steps'; Key 'profile_steps' is not in struct; the options "
                                    "of a group are the keys of its recipe (fsdp_offload/recipes/<group>/); did you mean train.profile_step?"),
        (["offload.tiers=[posix:/nonexistent/dir]"], "tier dir /nonexistent/dir does not exist"),
        (["data.kind=memmap", "data.path=/nonexistent.bin"], "/nonexistent.bin"),
        (["offload.host_budget_gb=0.0001"], "below the pipeline's minimum"),
        (["checkpoint.dir={tmp}/afile"], "checkpoint.dir={tmp}/afile: {tmp}/afile is a file, not a directory"),
        (["checkpoint.dir={tmp}/afile/ck"], "checkpoint.dir={tmp}/afile/ck: {tmp}/afile is a file, not a directory"),
        (["offload.max_grad_norm=None"], "offload.max_grad_norm='None' must be a positive number, or null"),
        (["train.profile_step=-1"], "train.profile_step=-1 must be a whole number >= 0"),
        (["train.steps=3", "train.profile_step=3"], "train.profile_step=3 is not a step of this run: steps count from 0, to train.steps - 1 = 2"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, overrides, message):
    (tmp_path / "afile").write_text("")  # where a directory belongs
    overrides, message = [o.format(tmp=tmp_path) for o in overrides], message.format(tmp=tmp_path)
    out = train(tmp_path / "run", *overrides, check=False)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


@pytest.mark.bad_input
def test_a_misspelt_option_is_said_once_a_job_with_the_nearest_key(tmp_path):
    out = train(tmp_path / "run", "train.profile_steps=2", ranks=2, check=False)
    assert out.returncode != 0 and out.stderr.count("did you mean train.profile_step?") == 1, out.stderr[-3000:]
    assert "To append to your config" not in out.stderr


@pytest.mark.bad_input
def test_bad_token_files(tmp_path):
    short = tmp_path / "short.bin"
    np.arange(10, dtype=np.uint16).tofile(short)
    out = train(tmp_path / "a", "data.kind=memmap", f"data.path={short}", check=False)
    assert out.returncode == 2 and "short.bin" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")  # not a whole number of uint16 tokens
    out = train(tmp_path / "b", "data.kind=memmap", f"data.path={odd}", check=False)
    assert out.returncode == 2 and "dtype" in out.stderr, out.stderr[-2000:]


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.bad_input
def test_checkpoint_rank_state_loads_no_code():
    from fsdp_offload.checkpoint.run import _pack, _unpack

    state = {"step": 3, "rng": torch.get_rng_state(), "python": (3, (1, 2), None), "lrs": [0.1]}
    back = _unpack(_pack(state))
    assert back["step"] == 3 and torch.equal(back["rng"], state["rng"]) and back["python"] == (3, (1, 2), None)
    with pytest.raises(Exception, match="Weights only load failed"):
        _unpack(_pack({"evil": _RunsCode()}))


def fake_checkpoint(path: Path) -> Path:
    for part in ("model", "optimizer"):
        (path / part).mkdir(parents=True)
        (path / part / ".metadata").write_bytes(b"")
    return path


@pytest.mark.bad_input
def test_resume_modes_say_what_they_do_and_refuse_what_they_cannot(tmp_path):
    from fsdp_offload.checkpoint import CheckpointConfig, resume_point
    from fsdp_offload.job_errors import JobError

    runs = tmp_path / "ck"
    assert resume_point(CheckpointConfig(dir=str(runs))) == (None, f"no checkpoint in checkpoint.dir={runs}: starting fresh")
    # a JobError: every rank meets it alike, and rank 0 says it once for the job
    with pytest.raises(JobError, match="checkpoint.resume=required, but checkpoint.dir=.* holds no complete checkpoint"):
        resume_point(CheckpointConfig(dir=str(runs), resume="required"))
    step4 = fake_checkpoint(runs / "step_00000004")
    fake_checkpoint(runs / "step_00000008")
    assert resume_point(CheckpointConfig(dir=str(runs)))[0] == str(runs / "step_00000008")
    assert resume_point(CheckpointConfig(dir=str(runs), resume="required"))[0] == str(runs / "step_00000008")
    assert resume_point(CheckpointConfig(dir=str(runs), resume=str(step4)))[0] == str(step4)
    assert resume_point(CheckpointConfig(dir=str(runs), resume=False))[0] is None  # false means never
    with pytest.raises(ValueError, match="is one checkpoint, not the dir of a run's checkpoints: give checkpoint.dir="):
        resume_point(CheckpointConfig(dir=str(step4)))
    with pytest.raises(ValueError, match="nowhere: no such dir .*; the newest in checkpoint.dir=.*: /.*/step_00000004, /.*/step_00000008$"):
        resume_point(CheckpointConfig(dir=str(runs), resume=str(tmp_path / "nowhere")))  # (one the run's keep removed, say)
    (tmp_path / "half").mkdir()
    with pytest.raises(ValueError, match="half: not a complete checkpoint \\(it needs model/ and optimizer/"):
        resume_point(CheckpointConfig(dir=str(runs), resume=str(tmp_path / "half")))
    with pytest.raises(ValueError, match="; did you mean checkpoint.resume=required\\?"):
        resume_point(CheckpointConfig(dir=str(runs), resume="requird"))


def test_tensorboard_gets_every_logged_row(tmp_path):
    pytest.importorskip("tensorboard", reason="train.tensorboard=true needs tensorboard (the dev extra has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tmp_path / "run", "train.steps=3", "train.tensorboard=true")
    board = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    board.Reload()
    losses = [e.value for e in board.Scalars("train/loss")]
    assert losses == pytest.approx([r["loss"] for r in rows(tmp_path / "run" / "metrics.jsonl")])
    assert {"train/update_s", "train/exposed_update_s", "train/bytes_read"} <= set(board.Tags()["scalars"])


def test_a_profiled_step_leaves_its_trace_and_table_in_the_run_dir(tmp_path):
    train(tmp_path / "run", "train.steps=3", "train.profile_step=1")
    trace = json.loads((tmp_path / "run" / "trace_step1_rank0.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])  # the step's forward and backward ops
    assert "aten::mm" in (tmp_path / "run" / "trace_step1_rank0.txt").read_text()
    assert not list((tmp_path / "run").glob("trace_step0*")) and not list((tmp_path / "run").glob("trace_step2*"))
    assert [r.get("profiled", False) for r in rows(tmp_path / "run" / "metrics.jsonl")] == [False, True, False]


def test_a_profiled_step_holds_its_whole_overlapped_update(tmp_path):
    """With the update on its own thread, train.py waits for the profiled step's update before the
    profiler stops: the trace holds it whole, every subgroup's update and copy back in it."""
    train(tmp_path / "run", "train.steps=3", "train.profile_step=1", "offload.overlap=next_forward")
    events = [e for e in json.loads((tmp_path / "run" / "trace_step1_rank0.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    # this step's: the latest (the last step's is here too where its thread had not begun it before the window)
    update = max((e for e in events if e["name"] == "fsdp_offload.update"), key=lambda e: e["ts"])
    inside = lambda e: e["tid"] == update["tid"] and update["ts"] <= e["ts"] and e["ts"] + e["dur"] <= update["ts"] + update["dur"]  # noqa: E731
    subgroups = json.loads((tmp_path / "run" / "placement.json").read_text())["plan"]["subgroups"]
    assert sum(e["name"] == "fsdp_offload.update_subgroup" and inside(e) for e in events) == subgroups
    assert sum(e["name"] == "fsdp_offload.copy_back" and inside(e) for e in events) == subgroups


def test_a_profiled_step_holds_the_ops_of_a_thread_started_before_it(tmp_path):
    """The overlapped update runs on a worker thread that exists before the profiled step: its regions
    and ops are in the trace too."""
    import threading

    from fsdp_offload.train_step import profiled

    go, done = threading.Event(), threading.Event()

    def worker() -> None:
        go.wait()
        with torch.profiler.record_function("fsdp_offload.update_subgroup"):
            torch.mm(torch.ones(64, 64), torch.ones(64, 64))
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    with profiled(str(tmp_path / "trace"), torch.device("cpu")):
        go.set()
        assert done.wait(60)
    thread.join()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    [region] = [e for e in events if e.get("name") == "fsdp_offload.update_subgroup"]
    assert any(e.get("name") == "aten::mm" and e["tid"] == region["tid"] for e in events)


def test_ranks_share_one_run_dir_even_when_hydra_picks_it(tmp_path):
    # each rank's Hydra names its dir from its own clock; every rank writes into rank 0's
    train(None, "train.steps=2", ranks=2, cwd=tmp_path)
    dirs = {p.parent for p in tmp_path.rglob("*metrics.jsonl")}
    assert len(dirs) == 1, dirs
    assert {p.name for p in next(iter(dirs)).glob("*metrics.jsonl")} == {"metrics.jsonl", "rank1.metrics.jsonl"}
    # and one Hydra dir, however far apart the ranks started: named from torchrun's start, not each rank's own
    assert [p.relative_to(tmp_path) for p in tmp_path.glob("outputs/*/*")] == [next(iter(dirs)).relative_to(tmp_path)]


def test_two_jobs_started_in_one_second_get_run_dirs_of_their_own(monkeypatch):
    """The run dir's name ends with the launcher's pid (torchrun's agent, the parent of a job's ranks on a
    node; else the process's own): two jobs in one second used to share one, and the refused one rewrote
    the live one's .hydra/config.yaml."""
    from fsdp_offload.node import run_stamp

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d/\d\d-\d\d-\d\d-{os.getpid()}", run_stamp()), run_stamp()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")  # a rank: its parent is the agent
    assert run_stamp().endswith(f"-{os.getppid()}")



def test_a_fresh_run_moves_an_earlier_run_s_rows_aside(tmp_path):
    """A run that starts fresh in a dir holding an earlier run's metrics writes rows of its own alone; the
    earlier ones are kept beside, named by their last write (a resumed run drops rows instead)."""
    from fsdp_offload.run_rows import set_aside

    path = tmp_path / "metrics.jsonl"
    assert set_aside(str(path)) is None  # nothing there
    path.write_text("")
    assert set_aside(str(path)) is None and path.exists()  # an empty one is this run's to append to
    path.write_text('{"step": 0}\n')
    os.utime(path, (0, 86400 * 365))
    first = set_aside(str(path))
    path.write_text('{"step": 0}\n{"step": 1}\n')
    os.utime(path, (0, 86400 * 365))  # the same second: never over the first
    second = set_aside(str(path))
    assert not path.exists() and first != second
    assert re.fullmatch(r"metrics\.\d{8}-\d{6}\.jsonl", Path(first).name)  # (its last write, in local time)
    assert [r["step"] for r in rows(Path(first))] == [0] and [r["step"] for r in rows(Path(second))] == [0, 1]
