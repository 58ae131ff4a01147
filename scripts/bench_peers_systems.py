"""bench_peers' systems: what each one is, and the command line and environment that run it.

This product and the GPU-only baseline run through scripts/train.py; the FSDP2 and DeepSpeed peers run
in bench_peers' worker mode (bench_peers_worker.py). With --nproc K > 1 every one of them runs under
`torchrun --standalone --nproc-per-node K`; at K = 1 it is one plain process (the world of one that
torchrun would start, without the launcher's own process around it).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "scripts" / "train.py"
ENTRY = REPO / "scripts" / "bench_peers.py"
GIB = 1 << 30
ERROR_TAG = "BENCH_ERROR:"  # a worker's one-line reason for not running, read back by the parent
# What ZeRO-Infinity moves per param and step (DEVICE.md): FP32 param, exp_avg, exp_avg_sq and grad
# read in the update, the first three written back, and the FP32 grad written during backward.
ZERO_INFINITY_BYTES_PER_PARAM = 32
# Disk space a peer needs per param on --tier-dir (checked before it starts): ZeRO-Infinity's FP32 p, m, v
# and grad. This product's train.py plans its own (what the GPU and the host cache leave to the tier) and
# refuses, naming the shortfall, before it builds anything.
DISK_BYTES_PER_PARAM = {"zero_infinity": 16}


@dataclass(frozen=True)
class System:
    name: str
    what: str
    runner: str  # "train.py" (this product, gpu_only), "fsdp" or "deepspeed" (bench_peers' worker mode)
    clip: bool = True
    offload: str = ""  # train.py's offload recipe (none: GPU-only), or DeepSpeed's offload_optimizer device
    disk: bool = False  # moves state through --tier-dir
    overrides: tuple[str, ...] = ()  # train.py overrides that make this variant of the product

    @property
    def is_product(self) -> bool:
        """Runs OffloadAdamW (train.py with an offload recipe other than none)."""
        return self.runner == "train.py" and self.offload != "none"


SYSTEMS = {
    s.name: s
    for s in (
        System("gpu_only", "plain FSDP2 + fused torch AdamW on the GPU, FP32 sharded params (scripts/train.py offload=none): "
               "the hardware's own speed where the model fits", "train.py", offload="none"),  # fmt: skip
        System("host", "this product, scripts/train.py offload=host (FP32 state in host memory)", "train.py", offload="host"),
        System("fsdp_cpu_offload_clip", "FSDP2 CPUOffloadPolicy + torch fused AdamW on CPU + clip_grad_norm_", "fsdp"),
        System("disk", "this product, scripts/train.py offload=disk (tier dir, host budget)", "train.py", offload="disk", disk=True),
        System("disk_grads_on_gpu", "this product, offload=disk, the bf16 grads kept in GPU memory and the whole host "
               "budget for the FP32 cache (offload.grad_path=gpu_bf16)", "train.py", offload="disk", disk=True,
               overrides=("++offload.grad_path=gpu_bf16",)),  # fmt: skip
        System("zero_infinity", "DeepSpeed ZeRO-3, offload_optimizer nvme on the tier dir, DeepSpeedCPUAdam", "deepspeed",
               offload="nvme", disk=True),  # fmt: skip
        System("host_noclip", "this product, offload=host, no clipping", "train.py", clip=False, offload="host"),
        System("host_noclip_next_forward", "this product, offload=host, no clipping, the update started at the next "
               "forward rather than during backward (offload.overlap=next_forward)", "train.py", clip=False,
               offload="host", overrides=("++offload.overlap=next_forward",)),  # fmt: skip
        System("host_sync", "this product, offload=host, the update not overlapped (offload.overlap=none)", "train.py",
               offload="host", overrides=("++offload.overlap=none",)),  # fmt: skip
        System("host_noclip_sync", "this product, offload=host, no clipping, the update not overlapped", "train.py",
               clip=False, offload="host", overrides=("++offload.overlap=none",)),  # fmt: skip
        System("disk_sync", "this product, offload=disk, the update not overlapped", "train.py", offload="disk",
               disk=True, overrides=("++offload.overlap=none",)),  # fmt: skip
        System("host_gpu0", "this product, offload=host, no state on the GPU (offload.gpu_fraction=0; the recipe's is auto)",
               "train.py", offload="host", overrides=("++offload.gpu_fraction=0",)),  # fmt: skip
        System("disk_gpu0", "this product, offload=disk, no state on the GPU (offload.gpu_fraction=0): every byte of state "
               "streams through the disk (grad_path=auto: the grads wait on the GPU where the cache would spill)", "train.py",
               offload="disk", disk=True, overrides=("++offload.gpu_fraction=0",)),  # fmt: skip
        System("disk_gpu0_whole", "disk_gpu0 with the masters whole (offload.split_masters=false: 12 bytes a param in the "
               "cache and on the disk, not 10)", "train.py", offload="disk", disk=True,
               overrides=("++offload.gpu_fraction=0", "++offload.split_masters=false")),  # fmt: skip
        System("disk_gpu0_host_grads", "disk_gpu0 with the grads in host memory (offload.grad_path=host_bf16, the default "
               "before grad_path=auto)", "train.py", offload="disk", disk=True,
               overrides=("++offload.gpu_fraction=0", "++offload.grad_path=host_bf16")),  # fmt: skip
        System("fsdp_cpu_offload", "FSDP2 CPUOffloadPolicy + torch fused AdamW on CPU, no clipping", "fsdp", clip=False),
        System("zero_offload", "DeepSpeed ZeRO-3, offload_optimizer cpu, DeepSpeedCPUAdam", "deepspeed", offload="cpu"),
        System("multipath", "this product, scripts/train.py offload=multipath (tier dir + shm dir, host budget)", "train.py",
               offload="multipath", disk=True),  # fmt: skip
        System("multipath_gpu0", "this product, offload=multipath, no state on the GPU (offload.gpu_fraction=0): every byte "
               "of state streams through the tier dir and the shm dir", "train.py", offload="multipath", disk=True,
               overrides=("++offload.gpu_fraction=0",)),  # fmt: skip
    )
}


def tier_spec(path: str, args: argparse.Namespace) -> str:
    """This product's POSIX tier at `path`, with --tier-options (the raw measurement uses the same)."""
    return f"posix:{path}" + (f"?{args.tier_options}" if args.tier_options else "")


def launcher(args: argparse.Namespace) -> list[str]:
    """How a system's script is started: torchrun for several ranks, else the interpreter itself."""
    if args.nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]


def system_command(system: System, args: argparse.Namespace, sys_dir: str, run_dir: str, rows_path: str, shm_dir: str | None) -> list[str]:
    """The command line that runs `system`: train.py with its recipe, or this script's worker mode."""
    norm = args.max_grad_norm if system.clip else None
    if system.runner != "train.py":
        return launcher(args) + [
            str(ENTRY), "--worker", system.name, "--rows", rows_path, "--model", args.model, "--seq", str(args.seq),
            "--batch", str(args.batch), "--micro-batches", str(args.micro_batches), "--steps", str(args.steps),
            "--device", args.device, "--seed", str(args.seed), "--max-grad-norm", str(args.max_grad_norm), "--tier-dir", sys_dir,
        ]  # fmt: skip
    cmd = launcher(args) + [
        str(TRAIN), f"model={args.model}", f"offload={system.offload}", "data=synthetic", f"data.seq_len={args.seq}",
        f"data.micro_batch={args.batch}", f"data.seed={args.seed}", "model.activation_checkpointing=true",
        "model.reshard_after_forward=true", "model.sum_grads_unsharded=false",
        f"train.steps={args.steps}", f"train.micro_batches={args.micro_batches}", f"train.device={args.device}",
        f"train.seed={args.seed}", "train.progress=false", "train.log_every=1", f"hydra.run.dir={run_dir}",
        # ++: set whether or not the offload recipe names it (both optimizers clip with it)
        "++offload.max_grad_norm=" + ("null" if norm is None else repr(norm)),
    ]  # fmt: skip
    if system.disk:
        tiers = [sys_dir] + ([shm_dir] if shm_dir else [])
        cmd += ["offload.tiers=[" + ",".join(f"'{tier_spec(t, args)}'" for t in tiers) + "]", f"offload.host_budget_gb={args.host_budget_gb}",
                # calibration lands in this run's profile, not the user's (the tier dirs are new each run)
                f"++offload.bandwidth_profile={os.path.join(os.path.dirname(run_dir), 'bandwidth.json')}"]  # fmt: skip
    return cmd + list(system.overrides) + (args.train_override if system.is_product else [])


def rank_files(system: System, run_dir: str, rows_path: str, nproc: int) -> list[str]:
    """Each rank's per-step JSONL, rank 0 first: train.py's metrics files, or the worker's rows."""
    if system.runner == "train.py":
        return [os.path.join(run_dir, "metrics.jsonl")] + [os.path.join(run_dir, f"rank{r}.metrics.jsonl") for r in range(1, nproc)]
    return [worker_rows_path(rows_path, r) for r in range(nproc)]


def worker_rows_path(rows_path: str, rank: int) -> str:
    """Where a worker rank writes its rows: `rows_path` for rank 0, a sibling file for the others."""
    return rows_path if rank == 0 else f"{rows_path}.rank{rank}"


def system_env(system: System) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}  # a failure's last line is its exception
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if system.runner == "deepspeed":
        # DeepSpeed's op builder rejects arch suffixes such as the machine's '9.0a' (DEVICE.md)
        arch = env.get("TORCH_CUDA_ARCH_LIST")
        if arch:
            env["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)a\b", r"\1", arch)
    return env
