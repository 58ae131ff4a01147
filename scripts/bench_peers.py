"""This product beside its peers: the same LLaMA training step, one system per process, one JSON.

Every system trains the same model (fsdp_offload.models, preset --model, 1.35B by default) on the
same synthetic tokens (seed 0), sequence --seq, micro-batch --batch, bf16 compute, activation
checkpointing, clipping at --max-grad-norm, one GPU:

  host                   this product: `scripts/train.py offload=host` (FP32 state in host memory)
  host_noclip            the same without clipping (the other side of ratio_vs_fsdp_cpu_offload): the
                         recipe's overlap=auto then updates each subgroup as backward hands in its grads
  host_noclip_next_forward  the same with the update started at the next forward (overlap=next_forward)
  disk                   `offload=disk`: state on --tier-dir behind --host-budget-gb of host memory
  multipath              `offload=multipath`: --tier-dir and --shm-dir, same host budget
  fsdp_cpu_offload_clip  FSDP2 CPUOffloadPolicy + torch fused AdamW on CPU + clip_grad_norm_
  fsdp_cpu_offload       the same without clipping
  zero_infinity          DeepSpeed ZeRO-3, offload_optimizer nvme on --tier-dir (DeepSpeedCPUAdam)
  zero_offload           DeepSpeed ZeRO-3, offload_optimizer cpu (DeepSpeedCPUAdam)

This product runs through scripts/train.py exactly as a user runs it (its per-step JSONL is read
back); the peers run in this script's own worker mode. Each system is its own process, so its host
peak is that process's ru_maxrss and a crash costs only that system: a system that fails, times out
or cannot start (no CUDA, `import deepspeed` fails, no disk space, time budget spent) is recorded
with {"error": "<reason>"} and a line in the table, never dropped. Steps 2.. are averaged (the first
warms up allocators, kernels and the page cache).

The machines are shared and a system's step moves by 10-15% from one process to the next, so one
call can run the systems --rounds times, taking turns (each round in the opposite order of the one
before): each system's row is then its median round (`iteration_s_rounds` lists every round), and
each ratio the median of the rounds' ratios, a ratio taken within one round (`ratio_rounds`).

Just before each disk system, the disk under --tier-dir is measured as the pipeline uses it
(`fsdp_offload.calibrate.measure_raw_io`: a pre-sized O_DIRECT file, the tier's request size and
threads; write, read, and both at once with half the threads each; median of 3):
`raw_mixed_io_gbps`, against which `physical_limit_s` = disk bytes per step / that rate. It is
measured again right after the system (`raw_mixed_io_after_gbps`, `physical_limit_after_s`): a
disk that bursts on credits is faster before a run than during it (`bench_io.py --sustained-s`
shows whether this one does).

On the GPU machine, with the wheels of ../shared/wheels/{device,peers} and libaio unpacked into an
ignored folder that travels with the checkout (say .carry/, see scripts/setup_gpu_machine.sh), in one
call of under 10 minutes: DeepSpeed builds its ops on first use (~2 min) before its ~25 s steps;
--time-budget-s makes it write the JSON before the limit, reporting what it could not start:

    bash scripts/setup_gpu_machine.sh .carry/wheels .carry/libaio && python3 scripts/bench_peers.py \\
        --systems disk_grads_on_gpu,zero_infinity --steps 5 --warmup-steps 2 --raw-io-gib 2 \\
        --device-kind nvidia-h100-x1 --out $OUT --log-dir $OUT/logs --time-budget-s 540

Here (CPU, tiny model; DeepSpeed peers report why they cannot run):

    python scripts/bench_peers.py --model tiny --seq 64 --device cpu --steps 3 --raw-io-gib 0.0625
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "scripts" / "train.py"
GIB = 1 << 30
# What ZeRO-Infinity moves per param and step (DEVICE.md): FP32 param, exp_avg, exp_avg_sq and grad
# read in the update, the first three written back, and the FP32 grad written during backward.
ZERO_INFINITY_BYTES_PER_PARAM = 32
# Disk space a system needs per param on --tier-dir (checked before it starts): FP32 p, m, v (this
# product); plus the FP32 grad (ZeRO-Infinity).
DISK_BYTES_PER_PARAM = {"disk": 12, "disk_grads_on_gpu": 12, "disk_sync": 12, "disk_auto": 12, "zero_infinity": 16}
PEER_LR = 3e-3  # train.yaml's lr; the peers keep it constant (train.py warms up): speed does not depend on it
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
ERROR_TAG = "BENCH_ERROR:"  # a worker's one-line reason for not running, read back by the parent


@dataclass(frozen=True)
class System:
    name: str
    what: str
    runner: str  # "train.py" (this product), "fsdp" or "deepspeed" (this script's worker mode)
    clip: bool = True
    offload: str = ""  # the product's offload recipe, or DeepSpeed's offload_optimizer device
    disk: bool = False  # moves state through --tier-dir
    overrides: tuple[str, ...] = ()  # train.py overrides that make this variant of the product


SYSTEMS = {
    s.name: s
    for s in (
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
        System("host_auto", "this product, offload=host, spare GPU memory used after step 1 (offload.gpu_fraction=auto)",
               "train.py", offload="host", overrides=("++offload.gpu_fraction=auto",)),  # fmt: skip
        System("disk_auto", "this product, offload=disk, spare GPU memory used after step 1 (offload.gpu_fraction=auto)",
               "train.py", offload="disk", disk=True, overrides=("++offload.gpu_fraction=auto",)),  # fmt: skip
        System("fsdp_cpu_offload", "FSDP2 CPUOffloadPolicy + torch fused AdamW on CPU, no clipping", "fsdp", clip=False),
        System("zero_offload", "DeepSpeed ZeRO-3, offload_optimizer cpu, DeepSpeedCPUAdam", "deepspeed", offload="cpu"),
        System("multipath", "this product, scripts/train.py offload=multipath (tier dir + shm dir, host budget)", "train.py",
               offload="multipath", disk=True),  # fmt: skip
    )
}
# ratio name -> (peer, ours): the peer's iteration time over ours, like for like
RATIOS = {
    "ratio_vs_fsdp_cpu_offload_clip": ("fsdp_cpu_offload_clip", "host"),
    "ratio_vs_fsdp_cpu_offload": ("fsdp_cpu_offload", "host_noclip"),
    "ratio_vs_zero_infinity": ("zero_infinity", "disk"),
    "ratio_disk_grads_on_gpu_vs_zero_infinity": ("zero_infinity", "disk_grads_on_gpu"),
    "ratio_vs_zero_offload": ("zero_offload", "host"),
    "ratio_multipath_vs_zero_infinity": ("zero_infinity", "multipath"),
    "ratio_host_auto_vs_fsdp_cpu_offload_clip": ("fsdp_cpu_offload_clip", "host_auto"),
    "ratio_disk_auto_vs_zero_infinity": ("zero_infinity", "disk_auto"),
}


def product_clip_overrides(max_grad_norm: float | None) -> list[str]:
    """train.py overrides for clipping (the one place to change when the option moves)."""
    value = "null" if max_grad_norm is None else repr(max_grad_norm)
    overrides = [f"++offload.max_grad_norm={value}"]  # ++: set it whether or not the offload recipe names it
    if "max_grad_norm" in train_recipe_keys():  # train.py before the move drives both from train.max_grad_norm
        overrides.append(f"train.max_grad_norm={value}")
    return overrides


def train_recipe_keys() -> set[str]:
    from omegaconf import OmegaConf

    return set(OmegaConf.load(REPO / "fsdp_offload" / "recipes" / "train.yaml").get("train", {}))


# ------------------------------------------------------------------------------------------------
# The peers, in this script's worker mode (one system per process)
# ------------------------------------------------------------------------------------------------


def fail(reason: str) -> None:
    print(f"{ERROR_TAG} {reason}", file=sys.stderr, flush=True)
    sys.exit(3)


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def model_args(args: argparse.Namespace):
    from fsdp_offload.models import MODEL_PRESETS

    return dataclasses.replace(
        MODEL_PRESETS[args.model], activation_checkpointing=True, max_seq_len=max(args.seq, MODEL_PRESETS[args.model].max_seq_len)
    )


def token_batches(args: argparse.Namespace, vocab_size: int):
    """The stream train.py's data=synthetic gives (same seed, same samples)."""
    from fsdp_offload.data import DataConfig, TokenBatches

    return TokenBatches(DataConfig(kind="synthetic", seq_len=args.seq, micro_batch=args.batch, seed=args.seed), vocab_size)


def worker_device(args: argparse.Namespace):
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but torch.cuda.is_available() is False (no GPU or no CUDA build of torch)")
    return torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")


def build_fsdp_cpu_offload(args: argparse.Namespace, device):
    """The product's FSDP units (`shard_units`) with CPUOffloadPolicy and bf16 compute; FP32 params on CPU."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from fsdp_offload.models import Transformer
    from fsdp_offload.parallelize import data_parallel_mesh, shard_units

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")  # pinning needs CUDA
    with torch.device("meta"):
        model = Transformer(model_args(args))
    shard_units(model, mesh=data_parallel_mesh(device), mp_policy=mp, offload_policy=offload)
    model.to_empty(device="cpu")  # the sharded params live on CPU under CPUOffloadPolicy
    torch.manual_seed(args.seed)
    model.init_weights()
    for name in ("rope_cos", "rope_sin"):  # buffers are not FSDP's: the compute device's
        setattr(model, name, getattr(model, name).to(device))
    return model


def ds_config(args: argparse.Namespace, offload: str, max_grad_norm: float | None) -> dict:
    """ZeRO-3, bf16, optimizer state offloaded to NVMe (ZeRO-Infinity) or CPU (ZeRO-Offload).

    NVMe settings as measured in DEVICE.md (sub_group 1e8, aio queue depth 32 x 8 threads). In DeepSpeed
    0.19 aio's thread count is `intra_op_parallelism` (an older `thread_count` key would be ignored).
    """
    offload_optimizer: dict = {"device": offload, "pin_memory": True}
    if offload == "nvme":
        offload_optimizer.update(nvme_path=args.tier_dir, buffer_count=4, fast_init=False)
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "gradient_clipping": max_grad_norm or 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": PEER_LR, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": 3, "sub_group_size": 100_000_000, "offload_optimizer": offload_optimizer},
        "aio": {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 8, "single_submit": False,
                "overlap_events": True},  # fmt: skip
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def run_worker(args: argparse.Namespace) -> None:
    system = SYSTEMS[args.worker]
    max_grad_norm = args.max_grad_norm if system.clip else None
    if system.runner == "deepspeed":
        try:  # first: without DeepSpeed nothing else matters
            import deepspeed
        except Exception as exc:  # noqa: BLE001 - any import failure is the reason
            fail(f"import deepspeed failed ({type(exc).__name__}: {exc}); on the GPU machine run `bash scripts/setup_gpu_machine.sh WHEEL_DIR LIBAIO_ROOT` first")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fsdp_offload.models import num_params

    start = time.perf_counter()
    device = worker_device(args)
    if system.runner == "deepspeed" and device.type != "cuda":
        fail("DeepSpeed's ZeRO-3 optimizer offload needs a CUDA device (got --device cpu)")
    margs = model_args(args)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    info: dict = {"params": num_params(margs), "torch": torch.__version__}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if system.runner == "fsdp":
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        model = build_fsdp_cpu_offload(args, device)
        # fused=True on the CPU FP32 params: torch's fused CPU AdamW
        optimizer = torch.optim.AdamW(model.parameters(), lr=PEER_LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True)
        info["optimizer"] = "torch.optim.AdamW(fused=True) on CPU"

        def forward(tokens):
            return model(tokens)

        def backward(loss):
            loss.backward()

        def update():
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
    else:
        deepspeed.init_distributed(dist_backend="nccl")
        from fsdp_offload.models import Transformer

        with torch.device("meta"):
            model = Transformer(margs)
        model.to_empty(device=device)
        torch.manual_seed(args.seed)
        model.init_weights()
        config = ds_config(args, system.offload, max_grad_norm)
        info["deepspeed"] = deepspeed.__version__
        info["ds_config"] = config
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        info["optimizer"] = type(inner).__name__  # DeepSpeedCPUAdam expected
        swapper = getattr(engine.optimizer, "optimizer_swapper", None)  # set when the state goes to NVMe
        info["optimizer_swapper"] = type(swapper).__name__ if swapper is not None else None

        def forward(tokens):
            return engine(tokens)

        def backward(loss):
            engine.backward(loss)

        def update():
            engine.step()

    batches = token_batches(args, margs.vocab_size)
    info["init_s"] = time.perf_counter() - start
    with open(args.rows, "a") as log:
        log.write(json.dumps({"info": info}) + "\n")
        log.flush()
        for step in range(args.steps):
            t_start = time.perf_counter()
            tokens = next(batches).to(device)
            t0 = time.perf_counter()
            logits = forward(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            sync()
            t1 = time.perf_counter()
            backward(loss)
            sync()
            t2 = time.perf_counter()
            update()
            sync()
            t3 = time.perf_counter()
            row = {"step": step, "loss": loss.item(), "forward_s": t1 - t0, "backward_s": t2 - t1, "update_s": t3 - t2,
                   "step_s": t3 - t_start, "host_peak_gib": host_peak_gib()}  # fmt: skip
            if device.type == "cuda":
                row["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"{system.name} step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "step"), flush=True)
        if system.disk:  # proof that the state really went to the tier dir
            info["tier_dir_bytes"] = sum(f.stat().st_size for f in Path(args.tier_dir).rglob("*") if f.is_file())
            log.write(json.dumps({"info": info}) + "\n")
    if dist.is_initialized():
        dist.destroy_process_group()


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


# ------------------------------------------------------------------------------------------------
# Running one system and summing it up
# ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tier_spec(path: str, args: argparse.Namespace) -> str:
    """This product's POSIX tier at `path`, with --tier-options (the raw measurement uses the same)."""
    return f"posix:{path}" + (f"?{args.tier_options}" if args.tier_options else "")


def system_command(system: System, args: argparse.Namespace, sys_dir: str, run_dir: str, rows_path: str, shm_dir: str | None) -> list[str]:
    norm = args.max_grad_norm if system.clip else None
    if system.runner == "train.py":
        cmd = [sys.executable, str(TRAIN), f"model={args.model}", f"offload={system.offload}", "data=synthetic",
               f"data.seq_len={args.seq}", f"data.micro_batch={args.batch}", f"data.seed={args.seed}",
               "model.activation_checkpointing=true", f"train.steps={args.steps}", f"train.device={args.device}",
               f"train.seed={args.seed}", "train.progress=false", "train.log_every=1", f"hydra.run.dir={run_dir}",
               *product_clip_overrides(norm)]  # fmt: skip
        if system.disk:
            tiers = [sys_dir] + ([shm_dir] if shm_dir else [])
            cmd += ["offload.tiers=[" + ",".join(f"'{tier_spec(t, args)}'" for t in tiers) + "]", f"offload.host_budget_gb={args.host_budget_gb}",
                    # calibration lands in this run's profile, not the user's (the tier dirs are new each run)
                    f"++offload.bandwidth_profile={os.path.join(os.path.dirname(run_dir), 'bandwidth.json')}"]  # fmt: skip
        return cmd + list(system.overrides) + args.train_override
    return [sys.executable, str(Path(__file__).resolve()), "--worker", system.name, "--rows", rows_path, "--model", args.model,
            "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps), "--device", args.device,
            "--seed", str(args.seed), "--max-grad-norm", str(args.max_grad_norm), "--tier-dir", sys_dir]  # fmt: skip


def system_env(system: System, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}  # a failure's last line is its exception
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if system.runner != "train.py":  # a world of one for torch.distributed / deepspeed.initialize
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if system.runner == "deepspeed":
        # DeepSpeed's op builder rejects arch suffixes such as the machine's '9.0a' (DEVICE.md)
        arch = env.get("TORCH_CUDA_ARCH_LIST")
        if arch:
            env["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)a\b", r"\1", arch)
    return env


def run_process(cmd: list[str], env: dict, log_path: str, timeout: float) -> tuple[int, float, float, bool]:
    """Runs `cmd` in its own session with output to `log_path`, killed (its whole group) after `timeout`
    seconds. Returns (exit code, negative for a signal; the peak RSS in GiB of it and its children
    (ru_maxrss from wait4); wall seconds; whether it timed out)."""
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
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                kill_at = time.perf_counter() + 10  # then SIGKILL
            if time.perf_counter() > kill_at:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if timed_out:  # whatever the group left behind (a compiler, a data loader) goes too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, usage.ru_maxrss / 2**20, time.perf_counter() - start, timed_out


def failure_reason(log_path: str) -> str:
    """The worker's ERROR_TAG line, train.py's 'error:' line, or the last exception line of the log."""
    try:
        lines = [l.strip() for l in Path(log_path).read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if line.startswith(ERROR_TAG):
            return line[len(ERROR_TAG) :].strip()
    for line in reversed(lines):
        if line.startswith("error:") or re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line) or line.startswith("Killed"):
            return line[:500]
    return lines[-1][:500] if lines else "no output"


def read_rows(path: str) -> tuple[dict, list[dict]]:
    info, rows = {}, []
    with contextlib.suppress(FileNotFoundError):
        for line in Path(path).read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
                d = json.loads(line)
                if "info" in d:
                    info = d["info"]
                else:
                    rows.append(d)
    return info, rows


def disk_bytes(by_tier: dict, tier_dir: str) -> int:
    """Bytes of a JSONL bytes_read/bytes_written dict ({tier spec: bytes}) that went to `tier_dir`."""
    root = os.path.realpath(tier_dir)
    total = 0
    for spec, n in (by_tier or {}).items():
        path = spec[spec.find("/") :].split("?")[0] if "/" in spec else ""
        if path and os.path.realpath(path).startswith(root):
            total += n
    return total


def mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def summarize(system: System, rows: list[dict], info: dict, args: argparse.Namespace, sys_dir: str, raw_io: dict,
              params: int, host_peak: float) -> dict:  # fmt: skip
    measured = rows[args.warmup_steps :] or rows[-1:]  # the first steps warm up
    out: dict = {
        "steps_run": len(rows),
        "steps_averaged": [r["step"] + 1 for r in measured],  # 1-based, as "steps 2+"
        "iteration_s": mean(measured, "step_s"),
        "forward_s": mean(measured, "forward_s"),
        "backward_s": mean(measured, "backward_s"),
        "update_s": mean(measured, "update_s"),
    }
    if any("exposed_update_s" in r for r in measured):
        out["exposed_update_s"] = mean(measured, "exposed_update_s")
        out["exposed_update_note"] = "from the step's own exposed_update_s (update time not hidden behind forward/backward)"
    else:
        out["exposed_update_s"] = out["update_s"]
        out["exposed_update_note"] = (
            "= update_s: this system's step reports no exposed_update_s"
            + ("" if system.runner == "train.py" else " (its update does not overlap forward/backward)")
        )
    if any("overlap_s" in r for r in measured):
        out["overlap_s"] = mean(measured, "overlap_s")
    if any("norm_s" in r for r in measured):  # this product: step()'s time for the global grad norm
        out["norm_s"] = mean(measured, "norm_s")
        out["norm_share_of_iteration"] = out["norm_s"] / out["iteration_s"] if out["iteration_s"] else None
    # The system process's own ru_maxrss (RUSAGE_SELF, logged after each step: start-up included).
    # wait4's figure also covers its children, e.g. the compilers of a first DeepSpeed op build.
    out["host_peak_gib"] = max((r["host_peak_gib"] for r in rows if "host_peak_gib" in r), default=host_peak)
    out["host_peak_gib_with_children"] = host_peak
    rss = [r["host_rss_gib"] for r in rows if "host_rss_gib" in r]  # this product: resident memory at each step's end
    out["host_rss_end_gib"] = rss[-1] if rss else None
    gpu = [r["gpu_peak_gib"] for r in rows if "gpu_peak_gib" in r]
    out["gpu_peak_gib"] = max(gpu) if gpu else None
    out["loss_first"], out["loss_last"] = rows[0].get("loss"), rows[-1].get("loss")
    out["max_grad_norm"] = args.max_grad_norm if system.clip else None

    # I/O: what moved through the tier dir per step, and how fast
    out["effective_io_gbps"] = out["raw_mixed_io_gbps"] = out["physical_limit_s"] = None
    if system.runner == "train.py" and system.disk:
        moved = [sum(r.get("bytes_read", {}).values()) + sum(r.get("bytes_written", {}).values()) for r in measured]
        on_disk = [disk_bytes(r.get("bytes_read", {}), sys_dir) + disk_bytes(r.get("bytes_written", {}), sys_dir) for r in measured]
        out["io_bytes_per_step"] = sum(moved) / len(moved)
        out["disk_bytes_per_step"] = sum(on_disk) / len(on_disk)
        out["effective_io_gbps"] = mean(measured, "effective_io_gbps")
        out["io_gbps_over_update"] = out["io_bytes_per_step"] / out["update_s"] / 1e9 if out["update_s"] else None
        out["effective_io_note"] = ("measured: bytes read + written by the update over the time its I/O was under way "
                                    "(the JSONL's effective_io_gbps); grads never touch the tier")  # fmt: skip
    elif system.name == "zero_infinity":
        moved = ZERO_INFINITY_BYTES_PER_PARAM * params
        out["io_bytes_per_step"] = out["disk_bytes_per_step"] = moved
        busy = (out["update_s"] or 0) + (out["backward_s"] or 0)
        out["effective_io_gbps"] = moved / busy / 1e9 if busy else None
        out["effective_io_note"] = (f"estimated: {ZERO_INFINITY_BYTES_PER_PARAM} bytes/param/step (FP32 p, m, v, grad read; "
                                    "p, m, v written; FP32 grad written in backward) over backward_s + update_s")  # fmt: skip
    if system.disk:
        out["raw_io"] = raw_io
    if system.disk and raw_io.get("mixed_gbps"):
        out["raw_mixed_io_gbps"] = raw_io["mixed_gbps"]
        if out.get("disk_bytes_per_step") is not None:
            out["physical_limit_s"] = out["disk_bytes_per_step"] / (raw_io["mixed_gbps"] * 1e9)
            if system.offload == "multipath":
                out["physical_limit_note"] = "disk bytes only: what went to the shm path is not charged to the disk"
    out.update({k: v for k, v in info.items() if k not in ("params",)})
    return out


def with_raw_after(out: dict, raw_after: dict) -> dict:
    """`out` with the disk as measured right after the system ran: the limit its steps met, on a disk
    whose rate moves with the load it just had (a cloud disk bursts on credits that a run drains)."""
    out = {**out, "raw_io_after": raw_after}
    if raw_after.get("mixed_gbps"):
        out["raw_mixed_io_after_gbps"] = raw_after["mixed_gbps"]
        if out.get("disk_bytes_per_step") is not None:
            out["physical_limit_after_s"] = out["disk_bytes_per_step"] / (raw_after["mixed_gbps"] * 1e9)
    return out


def measure_disk(args: argparse.Namespace) -> dict:
    """The disk under --tier-dir measured as the pipeline uses it, just before a disk system runs and
    again just after it (the machines' disks drift by tens of percent within minutes)."""
    if args.raw_io_gib <= 0:
        return {"skipped": "--raw-io-gib 0"}
    from fsdp_offload.calibrate import measure_raw_io
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


def run_system(system: System, args: argparse.Namespace, run_root: str, raw_io: dict, params: int, deadline: float | None) -> dict:
    base = {"what": system.what}
    log_path = os.path.join(run_root, f"{system.name}.log")
    if deadline is not None:
        left = deadline - time.perf_counter()
        if left < args.min_system_s:
            return {**base, "error": f"not run: the --time-budget-s of {args.time_budget_s:.0f} s is spent ({max(left, 0):.0f} s left)"}
    need = DISK_BYTES_PER_PARAM.get(system.name, 0) * params
    if need and system.runner == "train.py":
        need = max(need - args.host_budget_gb * GIB, GIB)  # the tier files are sparse: the cache's share is never written
    if need and shutil.disk_usage(args.tier_dir).free < need * 1.05:
        free = shutil.disk_usage(args.tier_dir).free
        return {**base, "error": f"not run: {system.name} needs about {need / GIB:.1f} GiB on {args.tier_dir}, "
                                 f"{free / GIB:.1f} GiB free; pass --tier-dir on a larger disk"}  # fmt: skip
    # Fresh dirs for this system's files, removed after it whatever happened (a killed run leaves its
    # files behind; on the shm path they would hold RAM)
    sys_dir = tempfile.mkdtemp(prefix=f"{system.name}-", dir=args.tier_dir)
    shm_dir = tempfile.mkdtemp(prefix=f"bench-peers-{system.name}-", dir=args.shm_dir) if system.offload == "multipath" else None
    run_dir = os.path.join(run_root, system.name)
    rows_path = os.path.join(run_root, f"{system.name}.steps.jsonl")
    cmd = system_command(system, args, sys_dir, run_dir, rows_path, shm_dir)
    timeout = args.system_timeout_s if deadline is None else min(args.system_timeout_s, deadline - time.perf_counter())
    print(f"== {system.name}: {system.what} (log {log_path})", flush=True)
    try:
        code, host_peak, wall, timed_out = run_process(cmd, system_env(system, args), log_path, timeout)
    finally:
        for d in (sys_dir, shm_dir):
            if d:
                shutil.rmtree(d, ignore_errors=True)
    info, rows = read_rows(os.path.join(run_dir, "metrics.jsonl") if system.runner == "train.py" else rows_path)
    base.update(command=shlex.join(cmd), log=log_path, wall_s=wall, exit_code=code)
    error = None
    if timed_out:
        error = f"timed out after {wall:.0f} s ({len(rows)} of {args.steps} steps done; see {log_path})"
    elif code != 0:
        error = f"exit code {code}: {failure_reason(log_path)}"
    elif len(rows) < args.steps:
        error = f"exited 0 but logged {len(rows)} of {args.steps} steps (see {log_path})"
    if error:
        out = {**base, "error": error}
        if rows:
            out["partial"] = summarize(system, rows, info, args, sys_dir, raw_io, params, host_peak)
        print(f"   {system.name}: ERROR {error}", flush=True)
        return out
    out = {**base, **summarize(system, rows, info, args, sys_dir, raw_io, params, host_peak)}
    out["init_s"] = out.get("init_s", wall - sum(r["step_s"] for r in rows))
    print(f"   {system.name}: iteration {out['iteration_s']:.3f} s (forward {out['forward_s']:.3f}, backward "
          f"{out['backward_s']:.3f}, update {out['update_s']:.3f}), host peak {out['host_peak_gib']:.1f} GiB, wall {wall:.0f} s", flush=True)  # fmt: skip
    return out


def ratios(runs: dict) -> tuple[dict, dict]:
    values, basis = {}, {}
    for name, (peer, ours) in RATIOS.items():
        p, o = runs.get(peer), runs.get(ours)
        basis[name] = f"{peer}.iteration_s / {ours}.iteration_s"
        if p is None or o is None:
            values[name] = None
            basis[name] += f" (not computed: {peer if p is None else ours} was not selected)"
        elif "error" in p or "error" in o:
            values[name] = None
            basis[name] += f" (not computed: {peer if 'error' in p else ours} failed or was not run)"
        else:
            values[name] = p["iteration_s"] / o["iteration_s"]
    return values, basis


def median_round(rounds: list[dict]) -> dict:
    """Each system's run from its median round by iteration time (the lower middle of an even count),
    with every round's iteration time beside it; a system that failed in every round keeps its first
    error."""
    out = {}
    for name in (n for n in SYSTEMS if any(n in r for r in rounds)):
        tried = [(k, r[name]) for k, r in enumerate(rounds) if name in r]
        good = sorted(((k, run) for k, run in tried if "error" not in run), key=lambda kr: kr[1]["iteration_s"])
        k, run = good[(len(good) - 1) // 2] if good else tried[0]
        out[name] = {**run, "round": k}
        if len(rounds) > 1:
            out[name]["iteration_s_rounds"] = [run.get("iteration_s") for _, run in tried]
    return out


def round_ratios(rounds: list[dict]) -> tuple[dict, dict, dict]:
    """Each ratio as the median of the ratios taken within one round (the lower middle of an even
    count; None where no round has both sides), its basis, and every round's value."""
    per_round = [ratios(r) for r in rounds]
    values, basis, each = {}, dict(per_round[0][1]), {}
    for name in RATIOS:
        each[name] = [v[name] for v, _ in per_round]
        taken = sorted(x for x in each[name] if x is not None)
        values[name] = statistics.median_low(taken) if taken else None  # one round's ratio, as the rows are
        if len(rounds) > 1 and taken:  # else the first round's reason stands
            basis[name] = f"median over {len(rounds)} rounds of {RATIOS[name][0]}.iteration_s / {RATIOS[name][1]}.iteration_s, each within one round"
    return values, basis, each


def fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(runs: dict, ratio_values: dict, basis: dict, ratio_each: dict) -> None:
    head = f"{'system':<22} {'iteration':>9} {'forward':>8} {'backward':>8} {'update':>8} {'exposed':>8} {'GPU GiB':>8} {'host GiB':>8} {'eff I/O GB/s':>12} {'raw before/after':>16}"
    print("\n" + head)
    for name, r in runs.items():
        if "error" in r:
            print(f"{name:<22} error: {r['error']}")
            continue
        print(f"{name:<22} {fmt(r['iteration_s']):>9} {fmt(r['forward_s']):>8} {fmt(r['backward_s']):>8} {fmt(r['update_s']):>8} "
              f"{fmt(r['exposed_update_s']):>8} {fmt(r['gpu_peak_gib'], '.1f'):>8} {fmt(r['host_peak_gib'], '.1f'):>8} "
              f"{fmt(r['effective_io_gbps'], '.2f'):>12} "
              f"{fmt(r.get('raw_mixed_io_gbps'), '.2f') + '/' + fmt(r.get('raw_mixed_io_after_gbps'), '.2f'):>16}")  # fmt: skip
        if "iteration_s_rounds" in r:
            print(f"{'':<22} rounds: {', '.join(fmt(x) for x in r['iteration_s_rounds'])} (the row is round {r['round']})")
    for name, v in ratio_values.items():
        rounds = f"; rounds: {', '.join(fmt(x, '.2f') for x in ratio_each[name])}" if len(ratio_each[name]) > 1 else ""
        print(f"{name} = {fmt(v, '.2f')}  ({basis[name]}{rounds})")


def gpu_name() -> str | None:
    """The GPU's name from nvidia-smi (the parent never opens a CUDA context of its own)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or None
    return None


def save(args: argparse.Namespace, result: dict) -> str:
    """Through the project's results helper (`record` adds command, device and commit); git is asked
    in the repo, wherever this was started from."""
    from fsdp_offload import results

    out, cwd = os.path.abspath(args.out), os.getcwd()
    os.chdir(REPO)
    try:
        if hasattr(results, "record"):
            return results.record("bench_peers", args.device_kind, out, result)
        return results.write_result(out, "bench_peers", args.device_kind,
                                    {"command": shlex.join(["python3", *sys.argv]), "device": args.device_kind, "commit": results.git_commit(), **result})  # fmt: skip
    finally:
        os.chdir(cwd)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", help="a preset of fsdp_offload.models.MODEL_PRESETS (tiny for a CPU test)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    ap.add_argument("--batch", type=int, default=1, help="micro-batch")
    ap.add_argument("--steps", type=int, default=5, help="steps per system; those after --warmup-steps are averaged")
    ap.add_argument("--warmup-steps", type=int, default=1,
                    help="steps left out of the averages, every system alike (2 leaves out gpu_fraction=auto's move after step 1)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list, run in this order (default all: {','.join(SYSTEMS)})")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the systems this many times, taking turns; rows are each system's median round, ratios the median of each round's")
    ap.add_argument("--tier-dir", default=None, help="disk dir for the disk runs (default: a new temp dir under /var/tmp, on the root disk)")
    ap.add_argument("--shm-dir", default="/dev/shm", help="the second path of the multipath run")
    ap.add_argument("--host-budget-gb", type=float, default=8.0, help="this product's host budget on disk runs (default 8: ZeRO-Infinity's host peak)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping of the *clip systems, the product and DeepSpeed")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                    help="extra Hydra override for this product's runs, repeatable (e.g. ++offload.kernel=torch)")
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
        if args.steps < 1:
            ap.error("--steps must be >= 1")
        if args.rounds < 1:
            ap.error(f"--rounds={args.rounds} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    started = time.perf_counter()
    deadline = started + args.time_budget_s if args.time_budget_s else None
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    from fsdp_offload.models import MODEL_PRESETS, num_params

    if args.model not in MODEL_PRESETS:
        sys.exit(f"error: --model {args.model}: choose one of {sorted(MODEL_PRESETS)}")
    margs = model_args(args)
    params = num_params(margs)
    gpu = gpu_name() if args.device == "cuda" else None
    args.device_kind = args.device_kind or (gpu.replace(" ", "-") if gpu else "cpu")
    made_tier_dir = args.tier_dir is None
    if made_tier_dir:
        args.tier_dir = tempfile.mkdtemp(prefix="bench-peers-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    os.makedirs(args.tier_dir, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_root = os.path.abspath(os.path.join(args.log_dir, f"bench_peers_{stamp}"))
    os.makedirs(run_root, exist_ok=True)
    selected = [SYSTEMS[s] for s in args.systems.split(",") if s]
    tier_fs = fs_type(args.tier_dir)
    print(f"{params / 1e9:.3f}B params ({args.model}), seq {args.seq}, batch {args.batch}, {args.steps} steps, device {args.device}; "
          f"tier dir {args.tier_dir} ({tier_fs}); logs in {run_root}", flush=True)  # fmt: skip
    if tier_fs in ("tmpfs", "ramfs"):
        print(f"warning: --tier-dir {args.tier_dir} is on {tier_fs} (RAM), not a disk", flush=True)

    rounds: list[dict[str, dict]] = []
    try:
        for k in range(args.rounds):
            runs: dict[str, dict] = {}
            root = run_root if args.rounds == 1 else os.path.join(run_root, f"round{k}")
            os.makedirs(root, exist_ok=True)
            for system in selected if k % 2 == 0 else selected[::-1]:  # turns: no system always first
                try:
                    raw_io = measure_disk(args) if system.disk else {}
                    runs[system.name] = run_system(system, args, root, raw_io, params, deadline)
                    if system.disk and "wall_s" in runs[system.name]:  # it ran: the disk as it left it
                        runs[system.name] = with_raw_after(runs[system.name], measure_disk(args))
                except Exception as exc:  # noqa: BLE001 - the bench itself failed on this system: say so, go on
                    runs[system.name] = {"what": system.what, "error": f"bench_peers failed to run it: {type(exc).__name__}: {exc}"}
            rounds.append({name: runs[name] for name in SYSTEMS if name in runs})
    finally:
        if made_tier_dir:
            shutil.rmtree(args.tier_dir, ignore_errors=True)
    ordered = median_round(rounds)
    ratio_values, basis, ratio_each = round_ratios(rounds)
    import torch

    result = {  # command, device and commit: added by the results helper (see save)
        "model": {"preset": args.model, "params": params, "params_billion": params / 1e9, "args": dataclasses.asdict(margs),
                  "seq_len": args.seq, "micro_batch": args.batch, "compute_dtype": "bfloat16", "activation_checkpointing": True,
                  "data": f"synthetic (fsdp_offload.data, seed {args.seed})"},  # fmt: skip
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
            "iteration_s: data fetch + forward + backward + update, synchronized; host_peak_gib: the system process's own ru_maxrss",
            "peers keep lr constant at train.yaml's lr; the product follows train.py's warmup/cosine schedule (speed does not depend on lr)",
            "multipath: state on the shm path is in RAM but not in the process's RSS",
            "gpu_peak_gib: torch.cuda.max_memory_allocated over the process; this product and DeepSpeed initialise the "
            "FP32 model on the GPU (counted), the FSDP2 peer on the CPU",
        ],
        "gpu_name": gpu,
        "torch_parent": torch.__version__,
        "cpu_count": os.cpu_count(),
        "log_dir": run_root,
        "wall_s": time.perf_counter() - started,
    }
    path = save(args, result)
    print_table(ordered, ratio_values, basis, ratio_each)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
