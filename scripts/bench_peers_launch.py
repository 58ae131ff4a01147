"""bench_peers: running one system in a process (tree) of its own and reading back what it logged.

A system that fails, times out or cannot start is returned with {"error": "<reason>"}, never dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench_peers_report import Workload, summarize, with_raw_after
from bench_peers_systems import DISK_BYTES_PER_PARAM, ERROR_TAG, GIB, REPO, System, rank_files, system_command, system_env, tier_spec

# the line a product rank logs when it accumulates (fsdp_offload.optimizer): where the FP32 sums live
GRAD_ACCUMULATION_LINE = re.compile(r"offload\.grad_accumulation=.*summed in FP32 on the (GPU|host)")


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (torchrun's ranks start sessions of their own, out of its group)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, sig: int) -> None:
    """Signals `pid`'s group and every process below it, each by its id."""
    below = descendants(pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
    for child in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, sig)


def run_process(cmd: list[str], env: dict, log_path: str, timeout: float) -> tuple[int, float, float, bool]:
    """Runs `cmd` in its own session with output to `log_path`, killed (with every process below it)
    after `timeout` seconds. Returns (exit code, negative for a signal; the largest RSS in GiB of it or
    any one of its children (ru_maxrss from wait4); wall seconds; whether it timed out)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out, kill_at = False, float("inf")
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - start > timeout and not timed_out:
                timed_out = True
                kill_tree(proc.pid, signal.SIGTERM)
                kill_at = time.perf_counter() + 10  # then SIGKILL
            if time.perf_counter() > kill_at:
                kill_tree(proc.pid, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if timed_out:  # whatever the group left behind (a compiler, a data loader) goes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, usage.ru_maxrss / 2**20, time.perf_counter() - start, timed_out


class DirPeak:
    """The most bytes the ranks' tier files under a directory held at once, sampled every 0.2 s while in
    the `with` block: the RAM a run's state on a tmpfs (the shm path) took, which no RSS shows."""

    def __init__(self, path: str | None):
        self.path, self.peak_bytes = path, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> DirPeak:
        if self.path:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.path:
            self._thread.join()

    def _watch(self) -> None:
        while True:
            self.peak_bytes = max(self.peak_bytes, tier_state_bytes(self.path))
            if self._stop.wait(0.2):
                return


def tier_state_bytes(path: str) -> int:
    """Bytes allocated to the ranks' tier files under `path` (`rank<r>-...subgroups`; st_blocks, so sparse
    holes are not counted): not the start-up measurement's file, which comes and goes before the state."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            if name.startswith("rank") and name.endswith(".subgroups"):
                with contextlib.suppress(OSError):  # a file renamed or removed while we walk
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def failure_reason(log_path: str) -> str:
    """The worker's ERROR_TAG line, train.py's 'error:' line, or the last exception line of the log
    that is not torchrun's own summary of a failed rank."""
    try:
        text = Path(log_path).read_text(errors="replace")
        lines = [re.sub(r"^\[rank\d+\]:\s*", "", l.strip()) for l in text.splitlines() if l.strip()]  # torchrun's prefix
    except OSError:
        return "no log"
    for line in lines:
        if line.startswith(ERROR_TAG):
            return line[len(ERROR_TAG) :].strip()
    own = [l for l in lines if "torch.distributed.elastic" not in l]  # not torchrun's summary of a failed rank
    for line in reversed(own):
        if line.startswith("error:"):
            return line[:500]
    for line in reversed(own):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line) or line.startswith("Killed"):
            return line[:500]
    return lines[-1][:500] if lines else "no output"


def read_rows(path: str) -> tuple[dict, list[dict]]:
    """The last info line and the step rows of one rank's JSONL (a line cut by a kill is skipped)."""
    info, rows = {}, []
    with contextlib.suppress(FileNotFoundError):
        for line in Path(path).read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                d = json.loads(line)
                if "info" in d:
                    info = d["info"]
                else:
                    rows.append(d)
    return info, rows


def logged_grad_accumulation(log_path: str) -> str | None:
    """The product's resolved offload.grad_accumulation as its log line says it ("gpu" or "host")."""
    with contextlib.suppress(OSError):
        for line in Path(log_path).read_text(errors="replace").splitlines():
            m = GRAD_ACCUMULATION_LINE.search(line)
            if m:
                return m.group(1).lower()
    return None


def measure_disk(args: argparse.Namespace) -> dict:
    """The disk under --tier-dir measured as the pipeline uses it, just before a disk system runs and
    again just after it (the machines' disks drift by tens of percent within minutes)."""
    if args.raw_io_gib <= 0:
        return {"skipped": "--raw-io-gib 0"}
    from fsdp_offload.rawio import measure_raw_io
    from fsdp_offload.storage.base import TierError
    from fsdp_offload.storage.spec import TierSpec, io_settings

    try:
        threads, request = io_settings(TierSpec.parse(tier_spec(args.tier_dir, args)))
        raw = measure_raw_io(args.tier_dir, int(args.raw_io_gib * GIB), request, threads, args.raw_io_samples)
    except (OSError, ValueError, TierError) as exc:
        print(f"warning: raw I/O measurement in {args.tier_dir} failed: {exc}", flush=True)
        return {"error": f"raw I/O measurement in {args.tier_dir} failed: {exc}"}
    print(f"raw disk at {args.tier_dir}: write {raw.write_gbps:.2f}, read {raw.read_gbps:.2f}, mixed {raw.mixed_gbps:.2f} GB/s "
          f"(read {raw.mixed_read_gbps:.2f} + write {raw.mixed_write_gbps:.2f}), O_DIRECT {raw.direct}", flush=True)  # fmt: skip
    return raw.as_dict()


def not_startable(system: System, args: argparse.Namespace, params: int, deadline: float | None) -> str | None:
    """Why `system` is not started (time budget spent, too little disk), or None."""
    if deadline is not None:
        left = deadline - time.perf_counter()
        if left < args.min_system_s:
            return f"not run: the --time-budget-s of {args.time_budget_s:.0f} s is spent ({max(left, 0):.0f} s left)"
    need = DISK_BYTES_PER_PARAM.get(system.name, 0) * params
    if need and system.runner == "train.py":
        need = max(need - args.host_budget_gb * GIB * args.nproc, GIB)  # the tier files are sparse: the cache's share is never written
    free = shutil.disk_usage(args.tier_dir).free
    if need and free < need * 1.05:
        return f"not run: {system.name} needs about {need / GIB:.1f} GiB on {args.tier_dir}, {free / GIB:.1f} GiB free; pass --tier-dir on a larger disk"
    return None


def run_system(system: System, args: argparse.Namespace, run_root: str, work: Workload, deadline: float | None) -> dict:
    """Runs `system` once (the disk measured around it if it is a disk system) and sums it up."""
    base = {"system": system.name, "what": system.what, "micro_batches": args.micro_batches, "nproc": args.nproc}
    reason = not_startable(system, args, work.params, deadline)
    if reason:
        return {**base, "error": reason}
    raw_io = measure_disk(args) if system.disk else {}
    # Fresh dirs for this system's files, removed after it whatever happened (a killed run leaves its
    # files behind; on the shm path they would hold RAM)
    sys_dir = tempfile.mkdtemp(prefix=f"{system.name}-", dir=args.tier_dir)
    shm_dir = tempfile.mkdtemp(prefix=f"bench-peers-{system.name}-", dir=args.shm_dir) if system.offload == "multipath" else None
    run_dir = os.path.join(run_root, system.name)
    rows_path = os.path.join(run_root, f"{system.name}.steps.jsonl")
    log_path = os.path.join(run_root, f"{system.name}.log")
    cmd = system_command(system, args, sys_dir, run_dir, rows_path, shm_dir)
    timeout = args.system_timeout_s if deadline is None else min(args.system_timeout_s, deadline - time.perf_counter())
    print(f"== {system.name}: {system.what} (log {log_path})", flush=True)
    try:
        with DirPeak(shm_dir) as shm:
            code, host_peak, wall, timed_out = run_process(cmd, system_env(system), log_path, timeout)
    finally:
        for d in (sys_dir, shm_dir):
            if d:
                shutil.rmtree(d, ignore_errors=True)
    ranks = [read_rows(path) for path in rank_files(system, run_dir, rows_path, args.nproc)]
    rows = ranks[0][1]
    base.update(command=shlex.join(cmd), log=log_path, wall_s=wall, exit_code=code)
    if system.is_product:
        base["logged_grad_accumulation"] = logged_grad_accumulation(log_path)
    error = None
    if timed_out:
        error = f"timed out after {wall:.0f} s ({len(rows)} of {args.steps} steps done; see {log_path})"
    elif code != 0:
        error = f"exit code {code}: {failure_reason(log_path)}"
    elif any(len(r) < args.steps for _, r in ranks):
        error = f"exited 0 but logged {[len(r) for _, r in ranks]} of {args.steps} steps by rank (see {log_path})"
    if error:
        print(f"   {system.name}: ERROR {error}", flush=True)
        out = {**base, "error": error}
        if rows:
            out["partial"] = summarize(system, ranks, args, sys_dir, raw_io, work, host_peak, base)
        return out
    out = summarize(system, ranks, args, sys_dir, raw_io, work, host_peak, base)
    out["init_s"] = out.get("init_s", wall - sum(r["step_s"] for r in rows))
    if shm_dir:  # the node's host memory is its ranks' RSS plus what they kept on the tmpfs
        out["shm_peak_gib"] = shm.peak_bytes / GIB
        out["host_peak_with_shm_gib"] = out["host_peak_gib"] + out["shm_peak_gib"]
    if system.disk:  # it ran: the disk as it left it
        out = with_raw_after(out, measure_disk(args))
    print(f"   {system.name}: iteration {out['iteration_s']:.3f} s (forward {out['forward_s']:.3f}, backward "
          f"{out['backward_s']:.3f}, update {out['update_s']:.3f}), {out['tokens_per_s']:.0f} tokens/s, host peak "
          f"{out['host_peak_gib']:.1f} GiB, wall {wall:.0f} s", flush=True)  # fmt: skip
    return out
