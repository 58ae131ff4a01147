"""Recording benchmark results: one JSON file per run, with the command, machine and commit."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time


CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where this package's code lies


def git_commit() -> str:
    """HEAD of the checkout this package runs from (whatever the working directory: run from another
    repository, git there would name that one's), with '-dirty' when tracked files have changes;
    $FSDP_OFFLOAD_COMMIT where the code runs from a copy without .git (the GPU machine); "unknown"
    where the package does not lie at the top of a git checkout (an installed copy)."""
    if os.environ.get("FSDP_OFFLOAD_COMMIT"):
        return os.environ["FSDP_OFFLOAD_COMMIT"]

    # git asks $GIT_DIR and its kin before the working directory: a caller's would name its repository
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR")}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=CHECKOUT, env=env, capture_output=True, text=True, check=True).stdout.strip()

    try:
        if os.path.realpath(git("rev-parse", "--show-toplevel")) != os.path.realpath(CHECKOUT):
            return "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_names() -> list[str]:
    """The names of the host's GPUs from nvidia-smi, whatever CUDA_VISIBLE_DEVICES hides ([] where there
    is none or nvidia-smi fails; no CUDA context is opened here)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return []


def record(bench: str, device: str, out_dir: str, result: dict, launcher: str | None = None, path: str | None = None) -> str:
    """Writes `result` to out_dir/<bench>_<device>_<time>.json with what makes it reproducible: the
    command (sys.argv, after `launcher`, e.g. "torchrun --nproc-per-node 8", else after the python
    executable), device (the kind asked for), the host's GPUs (a kind may be served by another
    card), commit, host and time. Returns the path. `path`: an earlier record of this run to write
    over (a bench that records after each case, so that a run cut short keeps the cases it finished)."""
    command = " ".join([launcher or os.path.basename(sys.executable), *sys.argv])
    gpus = gpu_names()
    return write_result(out_dir, bench, device, {"command": command, "device": device, "gpu_name": gpus[0] if gpus else None,
                                                 "gpu_count": len(gpus), "commit": git_commit(), **result}, path)  # fmt: skip


def write_result(out_dir: str, bench: str, device: str, result: dict, path: str | None = None) -> str:
    """Writes `result` (plus host and time) to out_dir/<bench>_<device>_<time>.json, or over `path`;
    returns the path. A bench script calls `record`, which adds the command, device and commit first."""
    os.makedirs(out_dir, exist_ok=True)
    full = {"host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}
    path = path or os.path.join(out_dir, f"{bench}_{device}_{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(full, f, indent=2)
    return path
