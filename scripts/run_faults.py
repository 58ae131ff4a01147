"""Run-level cases of the fault campaign (scripts/fault_campaign.py --run-trials N): whole training
runs of scripts/train.py (torchrun; gloo ranks on the CPU or NCCL ranks on one GPU each; the tiny model
streaming through a `posix:` or `kvikio:` tier dir; a checkpoint every few steps: campaign_runs.Launch),
each faced with one fault of the checkpoint or run dir, each ending in one outcome:

  resumed_bit_exact  the run, resumed after the fault, ends where an uninterrupted run ends: the final
                     checkpoint's model and every rank's optimizer bytes equal the reference's
  refused_named      the run stopped with exactly one `error:` line that names the cause (the file,
                     the option, the holder), no traceback from the product, nothing lost
  missed             a kill meant for a save or a load came after it was done (said, not counted as a
                     pass nor a failure; the run is still checked bit for bit)
  skipped            the case cannot run on this machine (the record says why)
  bad                anything else: must never happen

The cases: kill_during_save (every rank SIGKILLed while a step_*.tmp file is open), kill_during_load
(while a checkpoint file is open on resume), damaged_trainer_state (a bit flipped in a rank's trainer
state entry), optimizer_from_another_step, two_writers (a second run on the dir of a live one: refused,
naming the first; the first ends bit for bit), full_checkpoint_dir (a tmpfs that fills at the second
checkpoint: refused, and a resume once there is room ends bit for bit), full_run_dir (train.out_dir on
a full tmpfs). The tmpfs cases need root and a mount the machine allows; elsewhere they are skipped,
saying why.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from pathlib import Path

from campaign_runs import Reference, Runs, kill_when_open, same_state, tail

from fsdp_offload.dcp_reader import read_dcp_metadata

CASES = ("kill_during_save", "kill_during_load", "damaged_trainer_state", "optimizer_from_another_step", "two_writers",
         "full_checkpoint_dir", "full_run_dir")  # fmt: skip


def refusal(code: int | None, err: str, *must_name: str) -> dict:
    """refused_named when the run stopped with one error line naming everything in `must_name`."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    traced = any("fsdp_offload/" in line and ", line " in line for line in err.splitlines())
    named = len(lines) == 1 and all(s in lines[0] for s in must_name)
    stopped = code not in (0, None)  # None: it hung until the timeout killed it
    return {"outcome": "refused_named" if stopped and named and not traced else "bad", "error": lines[:2] or tail(err, 4),
            "exit_code": code}  # fmt: skip


def resumed(runs: Runs, run: Path, ref: Reference, killed: bool) -> dict:
    """Resumes the run to its end and compares the final state with the reference."""
    code, err = runs.finish(runs.start(runs.command(run), run))
    if code != 0:
        return {"outcome": "bad", "exit_code": code, "error": tail(err, 5)}
    exact = same_state(runs.final(run / "ckpt", run / "final.pt"), ref.state)
    return {"outcome": ("resumed_bit_exact" if killed else "missed") if exact else "bad", "bit_exact": exact}


def flip_trainer_state_bit(step_dir: Path, rng: random.Random) -> str:
    """Flips one bit of a random rank's trainer state entry; returns its file."""
    entries = [(i, info) for i, info in read_dcp_metadata(str(step_dir / "model" / ".metadata")).storage_data.items()
               if i.fqn.startswith("rank")]  # fmt: skip
    index, info = rng.choice(entries)
    path = step_dir / "model" / info.relative_path
    at = info.offset + rng.randrange(info.length)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    return f"model/{info.relative_path}"


def tmpfs(where: Path, size: str) -> str | None:
    """Mounts a tmpfs of `size` at `where`; the reason when it cannot."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], capture_output=True,
                              text=True)  # fmt: skip
    except OSError as exc:  # no mount(8) on this machine
        return f"cannot run mount: {exc}"
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


def umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], check=False)


def case(name: str, i: int, runs: Runs, ref: Reference, rng: random.Random) -> dict:
    run = runs.root / f"{name}{i}"
    run.mkdir(parents=True)
    ref_ckpt = runs.root / "reference" / "ckpt"
    if name == "kill_during_save":
        job = runs.start(runs.command(run), run)
        killed = kill_when_open(job, runs.timeout_s, f"{run}/ckpt/step_", ".tmp/")  # a step_*.tmp/ being written
        return {**resumed(runs, run, ref, killed), "killed": killed}
    if name == "kill_during_load":
        stop = runs.command(run) + [f"train.kill_at_step={runs.every * 2}"]  # killed right after a checkpoint
        code, err = runs.finish(runs.start(stop, run))
        if not (run / "ckpt" / f"step_{runs.every * 2:08d}").is_dir():
            return {"outcome": "bad", "exit_code": code, "error": tail(err, 5)}
        job = runs.start(runs.command(run), run)
        killed = kill_when_open(job, runs.timeout_s, f"{run}/ckpt/step_{runs.every * 2:08d}/")
        return {**resumed(runs, run, ref, killed), "killed": killed}
    if name in ("damaged_trainer_state", "optimizer_from_another_step"):
        ckpt = run / "ckpt"
        last = ckpt / f"step_{runs.every * 2:08d}"
        for step in (runs.every, runs.every * 2):
            shutil.copytree(ref_ckpt / f"step_{step:08d}", ckpt / f"step_{step:08d}")
        if name == "damaged_trainer_state":
            named = flip_trainer_state_bit(last, rng)
        else:
            shutil.rmtree(last / "optimizer")
            shutil.copytree(ckpt / f"step_{runs.every:08d}" / "optimizer", last / "optimizer")
            named = "optimizer/.metadata"
        code, err = runs.finish(runs.start(runs.command(run), run))
        return {**refusal(code, err, str(last), named, f"checkpoint.resume={ckpt / f'step_{runs.every:08d}'}"), "damaged": named}
    if name == "two_writers":  # two jobs started at once on one checkpoint dir: one trains, the other is refused
        other = runs.root / f"{name}{i}b"
        other.mkdir()
        first = runs.start(runs.command(run), run)
        runs.port += 1
        second = runs.start(runs.command(other, ckpt=run / "ckpt"), other)
        runs.port -= 1
        (code_a, err_a), (code_b, err_b) = runs.finish(first), runs.finish(second)
        if (code_a == 0) == (code_b == 0):
            return {"outcome": "bad", "exit_codes": [code_a, code_b], "error": tail(err_a + err_b, 6)}
        code, err = (code_b, err_b) if code_a == 0 else (code_a, err_a)
        refused = refusal(code, err, f"checkpoint.dir={run / 'ckpt'} is being written by another run", "pid ")
        exact = same_state(runs.final(run / "ckpt", run / "final.pt"), ref.state)
        return {**refused, "outcome": refused["outcome"] if exact else "bad", "winner_bit_exact": exact}
    if name == "full_checkpoint_dir":
        ckpt = run / "small"
        why = tmpfs(ckpt, "3m")  # room for one checkpoint (about 2 MB) and not two
        if why:
            return {"outcome": "skipped", "why": why}
        try:
            code, err = runs.finish(runs.start(runs.command(run, ckpt=ckpt, keep=1), run))
            refused = refusal(code, err, f"checkpoint.dir={ckpt}: cannot write", "No space left on device", "free space")
            grown = subprocess.run(["mount", "-o", "remount,size=64m", str(ckpt)], capture_output=True, text=True)
            if grown.returncode != 0:
                return {**refused, "outcome": "bad", "why": f"the tmpfs could not be grown for the resume: {grown.stderr.strip()}"}
            code, err = runs.finish(runs.start(runs.command(run, ckpt=ckpt, keep=1), run))  # room again: resume
            exact = code == 0 and same_state(runs.final(ckpt, run / "final.pt"), ref.state)
            return {**refused, "outcome": refused["outcome"] if exact else "bad", "resumed_bit_exact": exact}
        finally:
            umount(ckpt)
    if name == "full_run_dir":
        out = run / "small"
        why = tmpfs(out, "1m")
        if why:
            return {"outcome": "skipped", "why": why}
        try:
            with open(out / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass
            code, err = runs.finish(runs.start(runs.command(run, out=out), run))
            return refusal(code, err, f"train.out_dir={out}", "No space left on device", "free space")
        finally:
            umount(out)
    raise ValueError(f"unknown case {name}: choose from {CASES}")


def run_case(name: str, i: int, runs: Runs, ref: Reference, rng: random.Random) -> dict:
    """Case `name` as trial `i` against the reference; its record row."""
    started = time.perf_counter()
    row = {"case": name, "nproc": runs.launch.nproc, **case(name, i, runs, ref, rng)}
    row["wall_s"] = round(time.perf_counter() - started, 1)
    dirs = [runs.root / f"{name}{i}", runs.root / f"{name}{i}b"]
    if row["outcome"] == "bad":  # kept for a look: its logs go beside the record
        row["dirs"] = [str(d) for d in dirs if d.exists()]
    else:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return row
