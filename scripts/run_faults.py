"""Run-level cases of the fault campaign (scripts/fault_campaign.py --run-trials N): whole training
runs of scripts/train.py (torchrun, 2 gloo ranks, the tiny model streaming through a tier dir, a
checkpoint every --every steps), each faced with one fault of the checkpoint or run dir, each ending in
one outcome:

  resumed_bit_exact  the run, resumed after the fault, ends where an uninterrupted run ends: the final
                     checkpoint's model and every rank's optimizer bytes equal the reference's
  refused_named      the run stopped with exactly one `error:` line that names the cause (the file,
                     the option, the holder), no traceback from the product, nothing lost
  missed             a kill meant for a save or a load came after it was done (said, not counted as a
                     pass nor a failure; the run is still checked bit for bit)
  bad                anything else: must never happen

The cases: kill_during_save (every rank SIGKILLed while a step_*.tmp file is open), kill_during_load
(while a checkpoint file is open on resume), damaged_trainer_state (a bit flipped in a rank's trainer
state entry), optimizer_from_another_step, two_writers (a second run on the dir of a live one: refused,
naming the first; the first ends bit for bit), full_checkpoint_dir (a tmpfs that fills at the second
checkpoint: refused, and a resume once there is room ends bit for bit), full_run_dir (train.out_dir on
a full tmpfs). The tmpfs cases need root; elsewhere they are recorded as skipped, saying why.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from crash_harness import final_state, kill_tree

from fsdp_offload.dcp_reader import read_dcp_metadata

TRAIN = str(Path(__file__).resolve().parent / "train.py")
CASES = ("kill_during_save", "kill_during_load", "damaged_trainer_state", "optimizer_from_another_step", "two_writers",
         "full_checkpoint_dir", "full_run_dir")  # fmt: skip


class Runs:
    """Builds, launches and judges train.py runs under `root`."""

    def __init__(self, root: Path, steps: int, every: int, timeout_s: float) -> None:
        self.root, self.steps, self.every, self.timeout_s = root, steps, every, timeout_s
        self.port = 29300 + os.getpid() % 300

    def command(self, run: Path, ckpt: Path | None = None, out: Path | None = None, keep: int | None = None) -> list[str]:
        steps = self.steps
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(self.port), TRAIN,
                "model=tiny", f"offload.tiers=['posix:{run / 'tier'}']", "offload.host_budget_gb=0.0008", f"train.steps={steps}",
                "train.progress=false", f"train.out_dir={out or run / 'out'}", f"hydra.run.dir={run / 'hydra'}",
                f"checkpoint.dir={ckpt or run / 'ckpt'}", f"checkpoint.every={self.every}", "checkpoint.resume=auto",
                f"checkpoint.keep={keep or self.steps}"]  # fmt: skip

    def launch(self, cmd: list[str], run: Path) -> subprocess.Popen:
        (run / "tier").mkdir(parents=True, exist_ok=True)
        log = open(run / "log", "a")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def finish(self, proc: subprocess.Popen) -> tuple[int, str]:
        _, err = proc.communicate(timeout=self.timeout_s)
        return proc.returncode, err

    def final(self, ckpt: Path, scratch: Path) -> dict:
        return final_state(ckpt / f"step_{self.steps:08d}", scratch)


def refusal(code: int, err: str, *must_name: str) -> dict:
    """refused_named when the run stopped with one error line naming everything in `must_name`."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    traced = any("fsdp_offload/" in line and ", line " in line for line in err.splitlines())
    named = len(lines) == 1 and all(s in lines[0] for s in must_name)
    return {"outcome": "refused_named" if code != 0 and named and not traced else "bad", "error": lines[:2], "exit_code": code}


def kill_when_open(proc: subprocess.Popen, pattern: str, timeout_s: float) -> bool:
    """SIGKILLs the run's whole process tree once any of its processes holds a file whose path has
    `pattern` in it; False when the run ended first."""
    deadline = time.monotonic() + timeout_s
    tree, listed = [], 0.0
    while proc.poll() is None and time.monotonic() < deadline:
        if time.monotonic() - listed > 0.2:  # the ranks start after torchrun: list the tree again now and then
            tree, listed = _tree(proc.pid), time.monotonic()
        for pid in tree:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if pattern in target:
                    kill_tree(proc.pid)
                    proc.wait()
                    return True
        time.sleep(0.002)
    return False


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def resumed(runs: Runs, run: Path, reference: dict, killed: bool) -> dict:
    """Resumes the run to its end and compares the final state with the reference."""
    code, err = runs.finish(runs.launch(runs.command(run), run))
    if code != 0:
        return {"outcome": "bad", "exit_code": code, "error": err.splitlines()[-5:]}
    exact = _same(runs.final(run / "ckpt", run / "final.pt"), reference)
    return {"outcome": ("resumed_bit_exact" if killed else "missed") if exact else "bad", "bit_exact": exact}


def _same(a: dict, b: dict) -> bool:
    import torch

    return a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and (
        a["subgroups"] == b["subgroups"])  # fmt: skip


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
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], capture_output=True, text=True)
    return None if done.returncode == 0 else f"mount failed: {done.stderr.strip()}"


def umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], check=False)


def case(name: str, i: int, runs: Runs, reference: dict, ref_ckpt: Path, rng: random.Random) -> dict:
    run = runs.root / f"{name}{i}"
    run.mkdir(parents=True)
    if name == "kill_during_save":
        proc = runs.launch(runs.command(run), run)
        killed = kill_when_open(proc, ".tmp/", runs.timeout_s)
        return {**resumed(runs, run, reference, killed), "killed": killed}
    if name == "kill_during_load":
        stop = runs.command(run) + [f"train.kill_at_step={runs.every * 2}"]  # killed right after a checkpoint
        code, err = runs.finish(runs.launch(stop, run))
        if not (run / "ckpt" / f"step_{runs.every * 2:08d}").is_dir():
            return {"outcome": "bad", "exit_code": code, "error": err.splitlines()[-5:]}
        proc = runs.launch(runs.command(run), run)
        killed = kill_when_open(proc, f"/ckpt/step_{runs.every * 2:08d}/", runs.timeout_s)
        return {**resumed(runs, run, reference, killed), "killed": killed}
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
        code, err = runs.finish(runs.launch(runs.command(run), run))
        return {**refusal(code, err, str(last), named, f"checkpoint.resume={ckpt / f'step_{runs.every:08d}'}"), "damaged": named}
    if name == "two_writers":  # two jobs started at once on one checkpoint dir: one trains, the other is refused
        other = runs.root / f"{name}{i}b"
        other.mkdir()
        first = runs.launch(runs.command(run), run)
        runs.port += 1
        second = runs.launch(runs.command(other, ckpt=run / "ckpt"), other)
        runs.port -= 1
        (code_a, err_a), (code_b, err_b) = runs.finish(first), runs.finish(second)
        if (code_a == 0) == (code_b == 0):
            return {"outcome": "bad", "exit_codes": [code_a, code_b], "error": (err_a + err_b).splitlines()[-6:]}
        code, err = (code_b, err_b) if code_a == 0 else (code_a, err_a)
        refused = refusal(code, err, f"checkpoint.dir={run / 'ckpt'} is being written by another run", "pid ")
        exact = _same(runs.final(run / "ckpt", run / "final.pt"), reference)
        return {**refused, "outcome": refused["outcome"] if exact else "bad", "winner_bit_exact": exact}
    if name == "full_checkpoint_dir":
        ckpt = run / "small"
        why = tmpfs(ckpt, "3m")  # room for one checkpoint (about 2 MB) and not two
        if why:
            return {"outcome": "skipped", "why": why}
        try:
            code, err = runs.finish(runs.launch(runs.command(run, ckpt=ckpt, keep=1), run))
            refused = refusal(code, err, f"checkpoint.dir={ckpt}: cannot write", "No space left on device", "free space")
            subprocess.run(["mount", "-o", "remount,size=64m", str(ckpt)], check=True)
            code, err = runs.finish(runs.launch(runs.command(run, ckpt=ckpt, keep=1), run))  # room again: resume
            exact = code == 0 and _same(runs.final(ckpt, run / "final.pt"), reference)
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
            code, err = runs.finish(runs.launch(runs.command(run, out=out), run))
            return refusal(code, err, f"train.out_dir={out}", "No space left on device", "free space")
        finally:
            umount(out)
    raise ValueError(f"unknown case {name}")


def campaign(trials: int, seed: int, root_dir: str, steps: int = 6, every: int = 2, timeout_s: float = 300) -> dict:
    """Runs `trials` cases, dealt round-robin over CASES, after one reference run; returns the record's part."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="run-faults-", dir=root_dir))
    runs = Runs(root, steps, every, timeout_s)
    rng = random.Random(seed)
    ref = root / "reference"
    ref.mkdir()
    code, err = runs.finish(runs.launch(runs.command(ref), ref))
    if code != 0:
        raise SystemExit(f"error: the reference run failed: {err[-2000:]}")
    reference = runs.final(ref / "ckpt", root / "ref.pt")
    results = []
    for i in range(trials):
        name = CASES[i % len(CASES)]
        started = time.perf_counter()
        row = {"case": name, **case(name, i, runs, reference, ref / "ckpt", rng), "wall_s": round(time.perf_counter() - started, 1)}
        results.append(row)
        print(f"{name} #{i}: {row['outcome']}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    counts: dict[str, dict[str, int]] = {}
    for row in results:
        counts.setdefault(row["case"], {}).setdefault(row["outcome"], 0)
        counts[row["case"]][row["outcome"]] += 1
    return {"run_trials": len(results), "run_bad": sum(r["outcome"] == "bad" for r in results), "run_outcomes": counts,
            "run_trials_detail": results, "run_steps": steps, "run_every": every}  # fmt: skip
