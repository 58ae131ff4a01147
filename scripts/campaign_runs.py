"""Whole training runs for the fault campaign (run_faults.py, fault_campaign.py) and the crash
harness: how a `scripts/train.py` run is launched (torchrun; CPU ranks on gloo, or one GPU per rank on
NCCL; the optimizer's state on a `posix:` or `kvikio:` tier), killed (SIGKILL of its whole process
tree, at a random moment or once it holds a file), and judged against an uninterrupted run of the same
command, bit for bit: the final checkpoint's model, every rank's optimizer bytes, every step's loss.

The CPU and the GPU campaigns are the same code: `Launch` is all that differs (train.device, hence
the backend train.py picks, the ranks and the tier scheme).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from fsdp_offload.dcp_reader import read_dcp_metadata

TRAIN = str(Path(__file__).resolve().parent / "train.py")
DEVICES = ("cpu", "cuda")
TIER_SCHEMES = ("posix", "kvikio")
STARTED = "[train][INFO] - start-up: "  # rank 0's line once the run is built and resumed, before its first step


@dataclass(frozen=True)
class Launch:
    """Where the runs' ranks go: `device` is train.device ("cpu": gloo ranks; "cuda": NCCL, rank r on
    GPU r, as run_setup.init_distributed picks them), `nproc` ranks, the optimizer's tier `tier_scheme:dir`."""

    device: str = "cpu"
    nproc: int = 2
    tier_scheme: str = "posix"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r}: choose one of {DEVICES}")
        if self.tier_scheme not in TIER_SCHEMES:
            raise ValueError(f"tier scheme {self.tier_scheme!r}: choose one of {TIER_SCHEMES}")
        if self.nproc < 1:
            raise ValueError(f"nproc {self.nproc}: give 1 or more ranks")

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"  # run_setup.init_distributed's choice

    def tier(self, where: Path | str) -> str:
        return f"{self.tier_scheme}:{where}"

    def env(self) -> dict[str, str]:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if self.device == "cuda":  # a fixed cuBLAS workspace config: a rerun takes the same reduction order
            env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        return env

    def unavailable(self) -> str | None:
        """Why this machine cannot run these ranks on this tier, or None when it can."""
        if self.device == "cuda":
            if not torch.cuda.is_available():
                return "--device cuda: no CUDA device is visible here; use --device cpu"
            if torch.cuda.device_count() < self.nproc:
                return f"--device cuda --nproc {self.nproc}: one GPU per rank, and {torch.cuda.device_count()} are visible"
        if self.tier_scheme == "kvikio":
            if importlib.util.find_spec("kvikio") is None:
                return "--tier-scheme kvikio: KvikIO is not installed (pip install fsdp-offload[gds]); use --tier-scheme posix"
            try:
                ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                return f"--tier-scheme kvikio: KvikIO needs the CUDA driver, libcuda.so.1 ({exc}); use --tier-scheme posix"
        return None

    def describe(self) -> dict:
        """The record's account of where the runs ran."""
        out: dict = {"train_device": self.device, "backend": self.backend, "nproc": self.nproc, "tier_scheme": self.tier_scheme,
                     "torch": torch.__version__}  # fmt: skip
        if self.device == "cuda":
            out["gpus"] = [torch.cuda.get_device_name(i) for i in range(self.nproc)]
            out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        if self.tier_scheme == "kvikio":
            import kvikio

            out["kvikio"] = getattr(kvikio, "__version__", "unknown")
        return out


class RunFailed(Exception):
    """An uninterrupted run that did not finish: nothing can be judged against it."""


@dataclass
class Job:
    proc: subprocess.Popen
    err: Path  # its stderr (a file: a pipe nobody reads while waiting to kill could block the ranks)
    started: float  # time.time() at launch
    ended: float | None = None  # time.time() once it exited


@dataclass
class Reference:
    """The uninterrupted run: its final state and losses, how long it took, when its training began."""

    state: dict
    losses: dict[int, float]
    run_s: float
    train_start_s: float
    repeat_bit_exact: bool | None  # a second uninterrupted run equal to it (None: not run)
    notes: list[str]  # its log's lines about the tier: what the plan put there, KvikIO's mode


class Runs:
    """Builds, launches and judges train.py runs under `root`. They build the CPU kernel where every
    run of the machine does: a kill during that build leaves torch's build lock there, which the next
    run must find stale and take over (kernels/cpu_adamw.build_lock), not wait for forever."""

    def __init__(self, root: Path, launch: Launch, steps: int, every: int, timeout_s: float, port: int) -> None:
        self.root, self.launch, self.steps, self.every, self.timeout_s, self.port = root, launch, steps, every, timeout_s, port
        self.startup_s = 1.0  # from launch to the start-up line, as the last run that got there took

    def command(self, run: Path, ckpt: Path | None = None, out: Path | None = None, keep: int | None = None) -> list[str]:
        # each rank's share of the tiny model shrinks with more ranks: subgroups and budget shrink with
        # it, so that every rank keeps 3 of its 5 subgroups in host memory and streams 2 through the tier
        share = 2 / self.launch.nproc
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.launch.nproc), "--master-port",
                str(self.port), TRAIN, "model=tiny", f"train.device={self.launch.device}",
                f"offload.tiers=['{self.launch.tier(run / 'tier')}']", f"offload.subgroup_numel={max(1024, int(16384 * share) // 1024 * 1024)}",
                f"offload.host_budget_gb={0.0008 * share:.6g}", f"train.steps={self.steps}",
                "train.progress=false", f"train.out_dir={out or run / 'out'}", f"hydra.run.dir={run / 'hydra'}",
                f"checkpoint.dir={ckpt or run / 'ckpt'}", f"checkpoint.every={self.every}", "checkpoint.resume=auto",
                f"checkpoint.keep={keep or self.steps}"]  # fmt: skip

    def start(self, cmd: list[str], run: Path) -> Job:
        (run / "tier").mkdir(parents=True, exist_ok=True)
        err = run / f"stderr.{len(list(run.glob('stderr.*')))}"
        with open(run / "log", "a") as log, open(err, "w") as err_file:
            proc = subprocess.Popen(cmd, stdout=log, stderr=err_file, text=True, env=self.launch.env())
        return Job(proc, err, time.time())

    def finish(self, job: Job) -> tuple[int | None, str]:
        """The run's exit code (None: it outlived the timeout and was killed) and its stderr."""
        try:
            job.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.kill(job)
            return None, job.err.read_text() + f"\n(no exit within {self.timeout_s:.0f} s: killed)"
        job.ended = time.time()
        return job.proc.returncode, job.err.read_text()

    def kill(self, job: Job) -> None:
        """SIGKILLs the run's tree (what it leaves behind is the next run's to cope with)."""
        kill_tree(job.proc.pid)
        job.proc.wait()
        job.ended = time.time()

    def final(self, ckpt: Path, scratch: Path) -> dict:
        return final_state(ckpt / f"step_{self.steps:08d}", scratch)


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it."""
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


def kill_tree(pid: int) -> None:
    """SIGKILLs `pid` and every process under it, as a scheduler ending the job does (torchrun starts
    each rank in a session of its own, so killing torchrun's group alone would leave the ranks)."""
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_when_open(job: Job, timeout_s: float, *patterns: str) -> bool:
    """SIGKILLs the run's whole process tree once any of its processes holds a file whose path has
    every one of `patterns` in it; False when the run ended first."""
    deadline = time.monotonic() + timeout_s
    tree, listed = [], 0.0
    while job.proc.poll() is None and time.monotonic() < deadline:
        if time.monotonic() - listed > 0.2:  # the ranks start after torchrun: list the tree again now and then
            tree, listed = process_tree(job.proc.pid), time.monotonic()
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
                if all(p in target for p in patterns):
                    kill_tree(job.proc.pid)
                    job.proc.wait()
                    return True
        time.sleep(0.002)
    return False


def final_state(ckpt: Path, scratch: Path) -> dict:
    """The final checkpoint's model (DCP's own converter) and every rank's subgroup bytes."""
    dcp_to_torch_save(str(ckpt / "model"), scratch)
    model = torch.load(scratch, weights_only=True)["model"]
    subgroups = {}
    for index, where in read_dcp_metadata(str(ckpt / "optimizer" / ".metadata")).storage_data.items():
        if ".subgroup_" in index.fqn:
            with open(ckpt / "optimizer" / where.relative_path, "rb") as f:
                f.seek(where.offset)
                subgroups[index.fqn] = f.read(where.length)
    return {"model": model, "subgroups": subgroups}


def same_state(a: dict, b: dict) -> bool:
    return a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and (
        a["subgroups"] == b["subgroups"])  # fmt: skip


def losses(run: Path) -> dict[int, float]:
    """Each step's loss, the last time the step ran (a resumed run repeats the steps after its checkpoint)."""
    out = {}
    for line in (run / "out" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["loss"]
    return out


def tail(text: str, lines: int = 8) -> list[str]:
    return text.splitlines()[-lines:]


def uninterrupted(runs: Runs, name: str) -> tuple[Path, Job]:
    run = runs.root / name
    job = runs.start(runs.command(run), run)
    code, err = runs.finish(job)
    if code != 0:
        raise RunFailed(f"the uninterrupted run {run} failed (exit {code}): " + " | ".join(tail(err) + tail((run / "log").read_text())))
    return run, job


def timing(run: Path, job: Job) -> tuple[float, float]:
    """(seconds the run took, seconds from its launch to its first step's start)."""
    run_s = (job.ended or time.time()) - job.started
    first = json.loads((run / "out" / "metrics.jsonl").read_text().splitlines()[0])
    began = datetime.fromisoformat(first["time"]).timestamp() - first["step_s"] - job.started
    return run_s, min(max(began, 0.2), run_s)


def reference(runs: Runs, repeat: bool) -> Reference:
    """The uninterrupted run; with `repeat`, a second one that must equal it bit for bit (on a GPU, the
    kernels' run-to-run determinism: without it no comparison below says anything). The faster of the
    two sets the kill trials' timing (the first may build the CPU kernel)."""
    run, job = uninterrupted(runs, "reference")
    run_s, began = timing(run, job)
    if STARTED not in (run / "log").read_text():
        raise RunFailed(f"{run / 'log'} has no line with {STARTED!r}, which the kill trials time their kills from")
    runs.startup_s = startup_took(run / "log", 0, job) or began
    state, got = runs.final(run / "ckpt", runs.root / "reference.pt"), losses(run)
    again = None
    if repeat:
        rerun, job_again = uninterrupted(runs, "reference_again")
        again = same_state(runs.final(rerun / "ckpt", runs.root / "again.pt"), state) and losses(rerun) == got
        if timing(rerun, job_again)[0] < run_s:
            run_s, began = timing(rerun, job_again)
            runs.startup_s = startup_took(rerun / "log", 0, job_again) or began
    # what the plan put on the tier, and KvikIO's mode
    lines = (run / "log").read_text().splitlines()
    notes = [line.split(" - ", 1)[-1] for line in lines if "KvikIO" in line or "] - plan: " in line][:3]
    return Reference(state, got, run_s, began, again, notes)


def started_training(job: Job, log: Path, seen: int, timeout_s: float) -> bool | None:
    """Waits until `log` has more than `seen` start-up lines (rank 0 logs one when its model, optimizer
    and any checkpoint are loaded); False when the run ended first, None when it did neither in time."""
    deadline = time.monotonic() + timeout_s
    while job.proc.poll() is None:
        if log.read_text().count(STARTED) > seen:
            return True
        if time.monotonic() > deadline:
            return None
        time.sleep(0.005)
    return False


def startup_took(log: Path, seen: int, job: Job) -> float | None:
    """Seconds from the job's launch to its start-up line (the one after the first `seen`), if it has one."""
    lines = [line for line in log.read_text().splitlines() if STARTED in line]
    try:
        return datetime.strptime(lines[seen][1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp() - job.started  # Hydra's local asctime
    except (IndexError, ValueError):
        return None


def kill_trial(runs: Runs, i: int, ref: Reference, rng: random.Random, kills: int) -> dict:
    """Starts the run, SIGKILLs every rank at a random moment (half of the time in its start-up, a
    checkpoint load included; half of the time in its training, where the updates, flushes and saves
    are), resumes, up to `kills` times, lets the last run finish, and compares its end with the
    reference's. The start-up's length is the last run's (it varies with the machine's load); a
    start-up kill whose moment comes after this run's start-up is drawn over its training instead; the
    training window is timed from the run's own start-up line."""
    run = runs.root / f"kill{i}"
    log = run / "log"
    killed_at: list[float] = []
    windows: list[str] = []
    while True:
        seen = log.read_text().count(STARTED) if log.exists() else 0
        job = runs.start(runs.command(run), run)
        if len(killed_at) < kills:
            window = "start-up" if rng.random() < 0.5 else "training"
            limit = rng.uniform(0.2, max(0.2, runs.startup_s)) if window == "start-up" else runs.timeout_s
            started = started_training(job, log, seen, limit)
            if started is None and window == "training":  # a hang, not a kill: the trial ends bad
                runs.kill(job)
                return {"trial": i, "nproc": runs.launch.nproc, "kills_at_s": killed_at, "kill_windows": windows, "outcome": "bad",
                        "error": [f"no start-up line within {runs.timeout_s:.0f} s: killed"] + tail(log.read_text(), 4),
                        "dirs": [str(run)]}  # fmt: skip
            if started:  # in training (a start-up kill whose moment came after the start-up becomes one there)
                window, delay = "training", rng.uniform(0.0, ref.run_s - ref.train_start_s)
            else:  # None: the start-up kill's moment came; False: the run ended
                delay = 0.0
            try:
                job.proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                runs.kill(job)
                killed_at.append(round(time.time() - job.started, 2))
                windows.append(window)
                runs.startup_s = startup_took(log, seen, job) or runs.startup_s
                continue
        # it ended before its kill, or it is the last run: a run that fails on its own (not killed) is
        # the product's failure, said and not retried
        code, err = runs.finish(job)
        runs.startup_s = startup_took(log, seen, job) or runs.startup_s
        break
    row: dict = {"trial": i, "nproc": runs.launch.nproc, "kills_at_s": killed_at, "kill_windows": windows, "exit_code": code}
    final = run / "ckpt" / f"step_{runs.steps:08d}"
    if code == 0 and final.exists():
        got = losses(run)
        row["state_equal"] = same_state(runs.final(run / "ckpt", run / "final.pt"), ref.state)
        row["losses_equal"] = got == ref.losses
        row["steps_differing"] = sorted(k for k in ref.losses if got.get(k) != ref.losses[k])
        exact = row["state_equal"] and row["losses_equal"]
        row["outcome"] = ("resumed_bit_exact" if killed_at else "missed") if exact else "bad"
    else:
        row.update(outcome="bad", error=tail(err) + tail((run / "log").read_text(), 4))
    if row["outcome"] == "bad":
        row["dirs"] = [str(run)]
    else:
        shutil.rmtree(run, ignore_errors=True)
    return row


def keep_logs(dirs: list[str], dest: Path) -> list[str]:
    """Copies the logs (stdout, stderr, metrics) of runs that went wrong to `dest`; returns the copies."""
    kept = []
    for d in map(Path, dirs):
        for f in [d / "log", *d.glob("stderr.*"), d / "out" / "metrics.jsonl"]:
            if f.is_file():
                to = dest / d.name / f.relative_to(d)
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, to)
                kept.append(str(to))
    return kept
