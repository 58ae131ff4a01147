"""The rows a training run writes: one JSON line a step (metrics.jsonl), TensorBoard scalars beside
them, the process's memory and file descriptors, the rows a resumed run drops, and an earlier run's
rows a fresh one moves aside (every rank's, before any rank writes)."""

from __future__ import annotations

import json
import math
import os
import re
import resource
import time

import torch.distributed as dist

from .job_errors import JobError


def tensorboard_writer(path: str):
    """A TensorBoard SummaryWriter at `path` (train.tensorboard=true)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ValueError(
            "train.tensorboard=true needs the tensorboard package: pip install tensorboard (or pip install -e '.[tensorboard]' in the checkout)"
        ) from exc
    return SummaryWriter(path)


def add_scalars(board, row: dict) -> None:
    """A JSONL row as TensorBoard scalars: its numbers, and the bytes it moved summed over tiers."""
    for key, value in row.items():
        if key not in ("step", "rank") and isinstance(value, (int, float)) and not isinstance(value, bool):  # (rank 0 writes)
            board.add_scalar(f"train/{key}", value, row["step"])
    for key in ("bytes_read", "bytes_written"):
        if isinstance(row.get(key), dict):
            board.add_scalar(f"train/{key}", sum(row[key].values()), row["step"])


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def process_now() -> dict:
    """This process's resident memory (GiB) and open file descriptors now: what a leak would grow."""
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {"host_rss_gib": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30, "open_fds": len(os.listdir("/proc/self/fd"))}


def set_aside(path: str) -> str | None:
    """Moves an earlier run's metrics file at `path` to `<stem>.<its last write><suffix>` beside it, so a
    run starting fresh in that dir writes rows of its own alone, and nothing is lost; returns where it
    went (None: no such file, or an empty one)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if st.st_size == 0:
        return None
    stem, suffix = os.path.splitext(path)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(st.st_mtime))
    aside, n = f"{stem}.{stamp}{suffix}", 1
    while os.path.exists(aside):
        aside, n = f"{stem}.{stamp}-{n}{suffix}", n + 1
    os.replace(path, aside)
    return aside


def rows_file(out_dir: str, metrics_file: str, rank: int) -> str:
    """Where `rank` writes its rows: `metrics_file` (rank 0's) or `rank<N>.<metrics_file>` in `out_dir`."""
    return os.path.join(out_dir, metrics_file if rank == 0 else f"rank{rank}.{metrics_file}")


def set_aside_all(out_dir: str, metrics_file: str) -> list[tuple[str, str]]:
    """Moves every rank's rows of an earlier run in `out_dir` aside (`set_aside`), those of ranks this
    run does not have too: an earlier run with more ranks left `rank<N>.<metrics_file>` files that a
    reader of the dir would take for this run's. Returns (file, where it went) for each one moved."""
    ours = re.compile(r"(rank\d+\.)?" + re.escape(metrics_file))  # (not the ones set aside: their names are stamped)
    try:
        names = sorted(os.listdir(out_dir))
    except FileNotFoundError:
        return []
    moved = []
    for name in names:
        if ours.fullmatch(name) and (aside := set_aside(os.path.join(out_dir, name))) is not None:
            moved.append((os.path.join(out_dir, name), aside))
    return moved


def start_fresh(out_dir: str, metrics_file: str, group: dist.ProcessGroup | None) -> list[tuple[str, str]]:
    """For a run starting fresh in `out_dir` (a collective over `group`, None: this process alone): rank 0
    moves every earlier run's rows aside before any rank opens its file (the others wait for it: a rank
    appending to a file as it is moved would lose rows); then each rank moves its own file aside if it is
    still there (an out dir local to each node, which rank 0 does not see). Returns what this rank moved.
    An OSError on rank 0 ends every rank: rank 0 raises it (its line names the option), the others a
    JobError, which rank 0 says for them."""
    rank = 0 if group is None else dist.get_rank(group)
    moved: list[tuple[str, str]] = []
    failed: OSError | None = None
    if rank == 0:
        try:
            moved = set_aside_all(out_dir, metrics_file)
        except OSError as exc:
            failed = exc
    if group is not None and dist.get_world_size(group) > 1:
        said = [None if failed is None else f"moving an earlier run's rows aside in {out_dir} failed on rank 0: {failed}"]
        dist.broadcast_object_list(said, src=dist.get_global_rank(group, 0), group=group)
        if said[0] is not None and rank != 0:
            raise JobError(said[0])
    if failed is not None:
        raise failed
    own = rows_file(out_dir, metrics_file, rank)
    if rank != 0 and (aside := set_aside(own)) is not None:
        moved.append((own, aside))
    return moved


def drop_rows_from(path: str, step: int) -> None:
    """Drops the rows of steps `step` and after from the metrics file at `path` (an earlier run's, past
    the checkpoint this one resumes from), so each step has one row."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if _row_step(line) < step]
    if len(kept) < len(lines):
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)


def _row_step(line: str) -> float:
    """The step of a metrics row; infinity for a line that is not one (torn by a kill: it goes)."""
    try:
        return json.loads(line)["step"] if line.endswith("\n") else math.inf
    except (ValueError, KeyError, TypeError):
        return math.inf


def add_update_metrics(row: dict, m) -> None:
    """Adds the metrics of the row's own update (an OffloadAdamW's StepMetrics) to it."""
    row.update(update_s=m.update_s, exposed_update_s=m.exposed_update_s, overlap_s=m.overlap_s,
               update_mparams_per_s=m.update_mparams_per_s, effective_io_gbps=m.effective_io_gbps,
               bytes_read=m.bytes_read, bytes_written=m.bytes_written, cache_hits=m.cache_hits,
               subgroups_per_tier=m.subgroups_per_tier, subgroups_on_gpu=m.subgroups_on_gpu, skipped=m.skipped,
               lock_wait_s=m.lock_wait_s, norm_s=m.norm_s, cpu_kernel_s=m.cpu_kernel_s)  # fmt: skip
