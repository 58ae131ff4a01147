"""Checkpoint benchmark: the optimizer's state saved and loaded through DCP, one subgroup at a time.

Builds OffloadAdamW over `--numel` params with `--host-budget-gb` of host cache (the rest on the tier),
takes one step, then saves its state with the streaming planners once per writer count in `--writers`
(side by side in one run) and loads the first save back into a fresh optimizer on the same tier
(page cache dropped for the checkpoint's files first, so the load reads the disk). Reports GB/s
against the raw write/read bandwidth of the checkpoint dir, and checks the loaded state equals the
saved one.

    python scripts/bench_checkpoint.py --tier posix:/mnt/nvme/tier --ckpt-dir /mnt/nvme/ck --writers 1 2 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.cache import aligned_host_buffer
from fsdp_offload.rawio import measure_raw_io
from fsdp_offload.optimizer_state import CheckedFileSystemWriter, OffloadOptimizerState, StreamingLoadPlanner, StreamingSavePlanner
from fsdp_offload.results import record


def build(args: argparse.Namespace) -> tuple[OffloadAdamW, torch.nn.Parameter]:
    param = torch.nn.Parameter(torch.randn(args.numel))
    cfg = OffloadConfig(tiers=[args.tier], subgroup_numel=args.subgroup_numel, host_budget_gb=args.host_budget_gb)
    return OffloadAdamW([param], lr=1e-4, offload=cfg), param


def drop_page_cache(root: str) -> None:
    """Evicts the (fsynced, so clean) pages of the files under `root`, so a load reads the disk."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", required=True, help="tier spec of the optimizer's state, e.g. posix:/mnt/nvme/tier")
    ap.add_argument("--ckpt-dir", required=True, help="where the checkpoints go (emptied first)")
    ap.add_argument("--numel", type=int, default=1_345_400_000, help="params (default: the 1b recipe's)")
    ap.add_argument("--subgroup-numel", type=int, default=100 * (1 << 20))
    ap.add_argument("--host-budget-gb", type=float, default=12.0)
    ap.add_argument("--writers", type=int, nargs="+", default=[1, 2, 4], help="FileSystemWriter thread counts to compare")
    ap.add_argument("--device-kind", default="cpu", help="machine kind for the record (e.g. nvidia-h200)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: no_dist is meant
    if any(w < 1 for w in args.writers):
        ap.error(f"--writers {args.writers}: each count must be at least 1")

    shutil.rmtree(args.ckpt_dir, ignore_errors=True)
    os.makedirs(args.ckpt_dir)
    raw = measure_raw_io(args.ckpt_dir, 4 << 30)
    print(f"raw {args.ckpt_dir}: write {raw.write_gbps:.2f} GB/s, read {raw.read_gbps:.2f} GB/s", flush=True)

    opt, param = build(args)
    param.grad = torch.randn(args.numel, dtype=torch.bfloat16)
    opt.step()
    state_bytes = sum(sg.state_bytes for sg in opt.layout.subgroups)
    in_memory = opt.store.cache.num_slots
    print(f"{state_bytes / 1e9:.1f} GB of state in {len(opt.layout)} subgroups, {in_memory} in host memory", flush=True)

    saves = {}
    for writers in args.writers:
        path = os.path.join(args.ckpt_dir, f"writers{writers}")
        t0 = time.perf_counter()
        dcp.save({"optim": OffloadOptimizerState(opt)}, storage_writer=CheckedFileSystemWriter(path, thread_count=writers),
                 planner=StreamingSavePlanner())  # fmt: skip
        saves[writers] = time.perf_counter() - t0
        print(f"  save, {writers} writer(s): {saves[writers]:.1f} s, {state_bytes / saves[writers] / 1e9:.2f} GB/s", flush=True)

    first = os.path.join(args.ckpt_dir, f"writers{args.writers[0]}")
    fresh, _ = build(args)
    drop_page_cache(first)
    t0 = time.perf_counter()
    dcp.load({"optim": OffloadOptimizerState(fresh)}, storage_reader=FileSystemReader(first), planner=StreamingLoadPlanner())
    load_s = time.perf_counter() - t0
    print(f"  load: {load_s:.1f} s, {state_bytes / load_s / 1e9:.2f} GB/s", flush=True)
    equal = True
    for sg in range(len(opt.layout)):
        a, b = (aligned_host_buffer(opt.layout.subgroups[sg].state_bytes) for _ in range(2))
        opt.store.read(sg, a)
        fresh.store.read(sg, b)
        equal &= torch.equal(a, b)
    opt.close()
    fresh.close()

    best = min(saves, key=saves.get)
    result = {
        "tier": args.tier,
        "state_gb": state_bytes / 1e9,
        "subgroups": len(opt.layout),
        "subgroups_in_host_memory": in_memory,
        "raw_io": raw.as_dict(),
        "save_s": {str(w): s for w, s in saves.items()},
        "save_gbps": {str(w): state_bytes / s / 1e9 for w, s in saves.items()},
        "load_s": load_s,
        "load_gbps": state_bytes / load_s / 1e9,
        "loaded_equals_saved": equal,
    }
    out = record("bench_checkpoint", args.device_kind, args.out, result)
    print(f"\n{'writers':>8} {'save s':>7} {'save GB/s':>10} {'raw write':>10}")
    for w, s in saves.items():
        print(f"{w:>8} {s:>7.1f} {state_bytes / s / 1e9:>10.2f} {raw.write_gbps:>10.2f}")
    print(f"load {load_s:.1f} s, {result['load_gbps']:.2f} GB/s (raw read {raw.read_gbps:.2f}); loaded equals saved: {equal}")
    print(f"best: {best} writer(s); wrote {out}")


if __name__ == "__main__":
    main()
