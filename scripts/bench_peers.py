"""This product beside its peers and beside the GPU alone: the same LLaMA training step, one system per
process (tree), one JSON.

Every system trains the same model (fsdp_offload.models, preset --model, 1.35B by default) on the
same synthetic tokens (seed 0), sequence --seq, micro-batch --batch, --micro-batches micro-batches
accumulated a step, bf16 compute, activation checkpointing, clipping at --max-grad-norm, on --nproc
ranks of one node (each rank one GPU):

  gpu_only               `scripts/train.py offload=none`: plain FSDP2 + fused torch AdamW on the GPU, FP32
                         sharded params (the hardware's own speed, where the model fits)
  host                   this product: `scripts/train.py offload=host` (FP32 state in host memory)
  disk                   `offload=disk`: state on --tier-dir behind --host-budget-gb of host memory a rank
  multipath              `offload=multipath`: --tier-dir and --shm-dir, same host budget
  host_noclip, host_sync, host_gpu0, disk_sync, disk_gpu0, disk_gpu0_whole, disk_gpu0_host_grads, disk_grads_on_gpu, ...
                         variants of the product (one option each: see bench_peers_systems.py)
  fsdp_cpu_offload_clip  FSDP2 CPUOffloadPolicy + torch fused AdamW on CPU + clip_grad_norm_
  fsdp_cpu_offload       the same without clipping
  zero_infinity          DeepSpeed ZeRO-3, offload_optimizer nvme on --tier-dir (DeepSpeedCPUAdam)
  zero_offload           DeepSpeed ZeRO-3, offload_optimizer cpu (DeepSpeedCPUAdam)

This product and gpu_only run through scripts/train.py exactly as a user runs them (`train.micro_batches`;
their per-step JSONL is read back); the peers run in this script's worker mode (bench_peers_worker.py:
FSDP2 sums N micro-batches' grads and then clips and steps; DeepSpeed gets gradient_accumulation_steps N
and N engine.backward/engine.step calls). With --nproc K > 1 each system runs under `torchrun
--standalone --nproc-per-node K` (the workers take their process group from torchrun's environment,
DeepSpeed's through deepspeed.init_distributed); --nproc 1 runs it as one plain process. A system that
fails, times out or cannot start (no CUDA, `import deepspeed` fails, no disk space, time budget spent)
is recorded with {"error": "<reason>"} and a line in the table, never dropped.

Each system's row (`runs`) has: command, device, commit, system, micro_batches, nproc; iteration_s,
forward_s, backward_s, update_s, exposed_update_s (rank 0's, steps after --warmup-steps averaged);
step_s_all (every step) and first_steps_s (steps 0 and 1); tokens_per_step (all ranks and micro-batches)
and tokens_per_s; model_tflops = (6 * params + 12 * n_layers * dim * seq) * tokens_per_step / iteration_s
/ 1e12 (the node's: all params, embeddings included, plus attention's scores; activation checkpointing's
recompute not counted) and model_tflops_per_gpu; share_of_gpu_only (tokens/s over gpu_only's in the same
round, where gpu_only ran); compute_limit_s (forward+backward alone: gpu_only's forward_s + backward_s in
the same round where it ran, else the system's own; `compute_limit_from` says which) and
iteration_over_compute_limit; host_peak_gib (each rank's own ru_maxrss, summed over the node's ranks:
`host_peak_gib_per_rank`), gpu_peak_gib (torch.cuda.max_memory_allocated of the fullest GPU);
grad_accumulation (this product's resolved offload.grad_accumulation, from its metrics rows or its log
line; null for the others, `grad_accumulation_from` says why), grad_path (this product's resolved
offload.grad_path from every rank's metrics rows: one value, or the list where ranks differ).

The machines are shared and a system's step moves by 10-15% from one process to the next, so one
call can run the systems --rounds times, taking turns (each round in the opposite order of the one
before): each system's row is then its median round (`iteration_s_rounds` lists every round), with
share_of_gpu_only and compute_limit_s taken within that round, and each peer ratio the median of the
rounds' ratios, a ratio taken within one round (`ratio_rounds`).

Just before each disk system, the disk under --tier-dir is measured as the pipeline uses it
(`fsdp_offload.rawio.measure_raw_io`: a pre-sized O_DIRECT file, the tier's request size and
threads; write, read, and both at once with half the threads each; median of 3):
`raw_mixed_io_gbps`, against which `physical_limit_s` = disk bytes per step (all ranks) / that rate.
It is measured again right after the system (`raw_mixed_io_after_gbps`, `physical_limit_after_s`): a
disk that bursts on credits is faster before a run than during it.

On the GPU machine, with the wheels of ../shared/wheels/{device,peers} and libaio unpacked into an
ignored folder that travels with the checkout (say .carry/, see scripts/setup_gpu_machine.sh), each in
one call of under 10 minutes (--time-budget-s writes the JSON before the limit, reporting what it could
not start). Issue #33 on one GPU, 8 micro-batches a step (and again with --micro-batches 1):

    bash scripts/setup_gpu_machine.sh .carry/wheels && python3 scripts/bench_peers.py \\
        --systems gpu_only,host,disk,fsdp_cpu_offload_clip --micro-batches 8 --rounds 1 --steps 4 \\
        --warmup-steps 2 --raw-io-gib 2 --device-kind nvidia-h100-x1 --out $OUT --log-dir $OUT/logs --time-budget-s 540

Issue #31 on 4 GPUs (DeepSpeed builds its ops on first use, ~1 min each, before its ~25 s steps):

    bash scripts/setup_gpu_machine.sh .carry/wheels .carry/libaio && python3 scripts/bench_peers.py \\
        --nproc 4 --systems host,disk,zero_offload,zero_infinity --steps 4 --warmup-steps 2 --raw-io-gib 2 \\
        --host-budget-gb 2.5 --device-kind nvidia-h100-x4 --out $OUT --log-dir $OUT/logs --time-budget-s 540

Here (CPU, tiny model; DeepSpeed peers report why they cannot run; --nproc 2 on gloo works too):

    python3 scripts/bench_peers.py --model tiny --seq 64 --device cpu --steps 3 --raw-io-gib 0.0625 \\
        --systems gpu_only,host,disk,fsdp_cpu_offload_clip,zero_offload --micro-batches 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench_peers_launch import run_system
from bench_peers_report import MODEL_TFLOPS_FORMULA, against_gpu_only, median_round, print_table, round_ratios, turn, workload
from bench_peers_systems import REPO, SYSTEMS
from bench_peers_worker import model_args, run_worker


def fs_type(path: str) -> str:
    """The file system type of `path` (longest mount point in /proc/mounts), or 'unknown'."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            mount = parts[1].replace("\\040", " ")
            if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, parts[2]
    return kind


def in_repo(fn, *a):
    """`fn(*a)` with the repo as the working dir: git is asked there, wherever this was started from."""
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return fn(*a)
    finally:
        os.chdir(cwd)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", help="a preset of fsdp_offload.models.MODEL_PRESETS (tiny for a CPU test)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    ap.add_argument("--batch", type=int, default=1, help="samples per micro-batch and rank")
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches accumulated per step, every system alike")
    ap.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) of this node; > 1 runs each system under torchrun")
    ap.add_argument("--steps", type=int, default=5, help="steps per system; those after --warmup-steps are averaged")
    ap.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the averages, every system alike")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list, run in this order (default all: {','.join(SYSTEMS)})")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the systems this many times, taking turns; rows are each system's median round, ratios the median of each round's")
    ap.add_argument("--tier-dir", default=None, help="disk dir for the disk runs (default: a new temp dir under /var/tmp, on the root disk)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="the second path of the multipath run")
    ap.add_argument("--host-budget-gb", type=float, default=8.0,
                    help="this product's host budget a rank on disk runs (default 8: ZeRO-Infinity's host peak on one GPU)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping of every system but the *noclip/fsdp_cpu_offload ones")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Hydra override for this product's runs (not gpu_only's), repeatable (e.g. ++offload.kernel=torch)")
    ap.add_argument("--raw-io-gib", type=float, default=4.0, help="file size of the raw disk measurement (0: skip it)")
    ap.add_argument("--tier-options", default="", help="query of this product's disk tiers, e.g. threads=8&request_mb=16; "
                    "the raw measurement uses the same threads and request size")
    ap.add_argument("--raw-io-samples", type=int, default=3)
    ap.add_argument("--system-timeout-s", type=float, default=1800, help="a system still running after this is killed and reported")
    ap.add_argument("--time-budget-s", type=float, default=None, help="stop starting systems when this is spent (the JSON is still written)")
    ap.add_argument("--min-system-s", type=float, default=45, help="with --time-budget-s: least time left to start a system")
    ap.add_argument("--device-kind", default=None, help="machine kind for the record (default: cpu, or the GPU's name)")
    ap.add_argument("--out", default="benchmarks/results", help="where the JSON goes")
    ap.add_argument("--log-dir", default="benchmarks/logs", help="per-system logs and run dirs go under <log-dir>/bench_peers_<time>/")
    ap.add_argument("--worker", default=None, choices=sorted(SYSTEMS), help=argparse.SUPPRESS)
    ap.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is None:
        unknown = [s for s in args.systems.split(",") if s and s not in SYSTEMS]
        if unknown:
            ap.error(f"--systems: unknown {unknown}; choose from {','.join(SYSTEMS)}")
        if not args.max_grad_norm > 0:
            ap.error(f"--max-grad-norm={args.max_grad_norm} must be positive (the *noclip/fsdp_cpu_offload systems run without)")
        for name in ("steps", "rounds", "micro_batches", "nproc"):
            if getattr(args, name) < 1:
                ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    started = time.perf_counter()
    deadline = started + args.time_budget_s if args.time_budget_s else None
    import torch

    from fsdp_offload import results
    from fsdp_offload.models import MODEL_PRESETS

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model not in MODEL_PRESETS:
        sys.exit(f"error: --model {args.model}: choose one of {sorted(MODEL_PRESETS)}")
    gpus = results.gpu_names() if args.device == "cuda" else []
    if args.device == "cuda" and args.nproc > len(gpus):
        sys.exit(f"error: --nproc {args.nproc} needs {args.nproc} GPUs; nvidia-smi lists {len(gpus)}")
    margs = model_args(args)
    work = workload(margs, args)
    args.device_kind = args.device_kind or (gpus[0].replace(" ", "-") if gpus else "cpu")
    commit = in_repo(results.git_commit)
    made_tier_dir = args.tier_dir is None
    if made_tier_dir:
        args.tier_dir = tempfile.mkdtemp(prefix="bench-peers-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.makedirs(args.tier_dir, exist_ok=True)
    run_root = os.path.abspath(os.path.join(args.log_dir, f"bench_peers_{time.strftime('%Y%m%d-%H%M%S')}"))
    os.makedirs(run_root, exist_ok=True)
    selected = [SYSTEMS[s] for s in args.systems.split(",") if s]
    tier_fs = fs_type(args.tier_dir)
    print(f"{work.params / 1e6:.1f}M params ({args.model}), seq {args.seq}, batch {args.batch} x {args.micro_batches} micro-batches "
          f"x {args.nproc} rank(s) = {work.tokens_per_step} tokens a step, {args.steps} steps, device {args.device}; "
          f"tier dir {args.tier_dir} ({tier_fs}); logs in {run_root}", flush=True)  # fmt: skip
    if tier_fs in ("tmpfs", "ramfs"):
        print(f"warning: --tier-dir {args.tier_dir} is on {tier_fs} (RAM), not a disk", flush=True)

    rounds: list[dict[str, dict]] = []
    try:
        for k in range(args.rounds):
            runs: dict[str, dict] = {}
            root = run_root if args.rounds == 1 else os.path.join(run_root, f"round{k}")
            os.makedirs(root, exist_ok=True)
            for system in turn(selected, k):
                try:
                    runs[system.name] = {"device": args.device_kind, "commit": commit, **run_system(system, args, root, work, deadline)}
                except Exception as exc:  # noqa: BLE001 - the bench itself failed on this system: say so, go on
                    runs[system.name] = {"system": system.name, "what": system.what, "micro_batches": args.micro_batches,
                                         "error": f"bench_peers failed to run it: {type(exc).__name__}: {exc}"}  # fmt: skip
            rounds.append(against_gpu_only({name: runs[name] for name in SYSTEMS if name in runs}))
    finally:
        if made_tier_dir:
            shutil.rmtree(args.tier_dir, ignore_errors=True)
    ordered = median_round(rounds)
    ratio_values, basis, ratio_each = round_ratios(rounds)
    result = {  # command, device and commit: added by the results helper
        "model": {"preset": args.model, "params": work.params, "params_billion": work.params / 1e9, "args": dataclasses.asdict(margs),
                  "seq_len": args.seq, "micro_batch": args.batch, "micro_batches": args.micro_batches, "nproc": args.nproc,
                  "tokens_per_step": work.tokens_per_step, "flops_per_token": work.flops_per_token,
                  "compute_dtype": "bfloat16", "activation_checkpointing": True, "reshard_after_forward": True, "sum_grads_unsharded": False,
                  "data": f"synthetic (fsdp_offload.data, seed {args.seed})"},  # fmt: skip
        "model_tflops_formula": MODEL_TFLOPS_FORMULA,
        "steps": args.steps,
        "averaged": f"steps {args.warmup_steps + 1}.. (the first {args.warmup_steps} warm up)" if args.steps > args.warmup_steps else "the last step only",
        "max_grad_norm": args.max_grad_norm,
        "host_budget_gb": args.host_budget_gb,
        "tier_dir": args.tier_dir,
        "tier_fs": tier_fs,
        "shm_dir": args.shm_dir,
        **ratio_values,
        "ratios_basis": basis,
        "rounds": args.rounds,
        "runs": ordered,
        **({"ratio_rounds": ratio_each, "round_runs": rounds} if args.rounds > 1 else {}),
        "notes": [
            "iteration_s: data fetch + forward + backward + update of all micro-batches, synchronized, rank 0's",
            "host_peak_gib: each rank's own ru_maxrss (start-up included), summed over the node's ranks",
            "peers keep lr constant at train.yaml's lr; the product follows train.py's warmup/cosine schedule (speed does not depend on lr)",
            "multipath: state on the shm path is in RAM but not in the process's RSS: shm_peak_gib (the most the ranks' "
            "tier files there held at once, sampled every 0.2 s) and host_peak_with_shm_gib add it",
            "train.py's systems (this product, gpu_only) run with model.activation_checkpointing=true, "
            "model.reshard_after_forward=true and model.sum_grads_unsharded=false, as the FSDP2 peer's fully_shard does "
            "and ZeRO-3 must (a reduce-scatter every micro-batch): the same compute, gathers and reductions",
            "gpu_peak_gib: torch.cuda.max_memory_allocated over the steps (train.py resets it after start-up; the "
            "workers do not: DeepSpeed initialises the FP32 model on the GPU, the FSDP2 peer on the CPU)",
        ],
        "torch_parent": torch.__version__,
        "cpu_count": os.cpu_count(),
        "log_dir": run_root,
        "wall_s": time.perf_counter() - started,
    }
    path = in_repo(results.record, "bench_peers", args.device_kind, os.path.abspath(args.out), result)
    print(f"wrote {path}")
    print_table(ordered, ratio_values, basis, ratio_each)


if __name__ == "__main__":
    main()
