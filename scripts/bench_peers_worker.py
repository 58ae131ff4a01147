"""bench_peers' worker mode: one peer (FSDP2 CPUOffloadPolicy, or DeepSpeed ZeRO-3 with its optimizer
offloaded) trained on the model and tokens train.py uses, one JSON row per step and rank.

Started by the parent as `bench_peers.py --worker NAME ...`, alone or under torchrun: the process group
comes from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), which a lone worker sets up as
a world of one. A worker that cannot run says why on one ERROR_TAG line and exits 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path

from bench_peers_systems import ERROR_TAG, GIB, SYSTEMS, worker_rows_path

PEER_LR = 3e-3  # train.yaml's lr; the peers keep it constant (train.py warms up): speed does not depend on it
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


def fail(reason: str) -> None:
    print(f"{ERROR_TAG} {reason}", file=sys.stderr, flush=True)
    sys.exit(3)


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def model_args(args: argparse.Namespace):
    """The preset with activation checkpointing, long enough for --seq (train.py's model.* overrides)."""
    from fsdp_offload.models import MODEL_PRESETS

    preset = MODEL_PRESETS[args.model]
    return dataclasses.replace(preset, activation_checkpointing=True, max_seq_len=max(args.seq, preset.max_seq_len))


def join_world() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torchrun's environment; a lone worker is a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


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
    """ZeRO-3, bf16, optimizer state offloaded to NVMe (ZeRO-Infinity) or CPU (ZeRO-Offload), accumulating
    --micro-batches micro-batches a step.

    NVMe settings as measured in DEVICE.md (sub_group 1e8, aio queue depth 32 x 8 threads). In DeepSpeed
    0.19 aio's thread count is `intra_op_parallelism` (an older `thread_count` key would be ignored).
    """
    offload_optimizer: dict = {"device": offload, "pin_memory": True}
    if offload == "nvme":
        offload_optimizer.update(nvme_path=args.tier_dir, buffer_count=4, fast_init=False)
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": args.micro_batches,
        "bf16": {"enabled": True},
        "gradient_clipping": max_grad_norm or 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": PEER_LR, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {"stage": 3, "sub_group_size": 100_000_000, "offload_optimizer": offload_optimizer},
        "aio": {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 8, "single_submit": False,
                "overlap_events": True},  # fmt: skip
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class FsdpPeer:
    """FSDP2 CPUOffloadPolicy: micro-batch grads summed by FSDP2 in the FP32 CPU shards, then clip and
    torch's fused CPU AdamW once a step."""

    def __init__(self, args: argparse.Namespace, device, max_grad_norm: float | None, info: dict) -> None:
        import torch

        self.model = build_fsdp_cpu_offload(args, device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=PEER_LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True)
        self.max_grad_norm, self.micro_batches = max_grad_norm, args.micro_batches
        info["optimizer"] = "torch.optim.AdamW(fused=True) on CPU"

    def forward(self, tokens):
        return self.model(tokens)

    def backward(self, loss, last: bool) -> None:
        (loss / self.micro_batches).backward()  # a mean over the step's micro-batches, as train.py's

    def update(self, last: bool) -> None:
        import torch

        if not last:
            return
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()


class DeepSpeedPeer:
    """A DeepSpeed engine with gradient_accumulation_steps = --micro-batches: backward and step() once a
    micro-batch, as DeepSpeed expects; the engine scales the loss and steps at the boundary."""

    def __init__(self, args: argparse.Namespace, device, max_grad_norm: float | None, info: dict, offload: str) -> None:
        import deepspeed
        import torch

        from fsdp_offload.models import Transformer

        with torch.device("meta"):
            model = Transformer(model_args(args))
        model.to_empty(device=device)
        torch.manual_seed(args.seed)
        model.init_weights()
        config = ds_config(args, offload, max_grad_norm)
        info.update(deepspeed=deepspeed.__version__, ds_config=config)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        info["optimizer"] = type(inner).__name__  # DeepSpeedCPUAdam expected
        swapper = getattr(self.engine.optimizer, "optimizer_swapper", None)  # set when the state goes to NVMe
        info["optimizer_swapper"] = type(swapper).__name__ if swapper is not None else None

    def forward(self, tokens):
        return self.engine(tokens)

    def backward(self, loss, last: bool) -> None:
        self.engine.backward(loss)

    def update(self, last: bool) -> None:
        self.engine.step()  # steps the optimizer at the accumulation boundary only


def run_worker(args: argparse.Namespace) -> None:
    system = SYSTEMS[args.worker]
    max_grad_norm = args.max_grad_norm if system.clip else None
    # a worker stopped at the parent's timeout (torchrun passes the SIGTERM on) says where it was
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    if system.runner == "deepspeed":
        try:  # first: without DeepSpeed nothing else matters
            import deepspeed
        except Exception as exc:  # noqa: BLE001 - any import failure is the reason
            fail(f"import deepspeed failed ({type(exc).__name__}: {exc}); on the GPU machine run `bash scripts/setup_gpu_machine.sh WHEEL_DIR LIBAIO_ROOT` first")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fsdp_offload.data import DataConfig, TokenBatches
    from fsdp_offload.models import num_params
    from fsdp_offload.threads import cpu_threads_per_rank, use_cpu_threads

    start = time.perf_counter()
    rank, local_rank, world = join_world()
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but torch.cuda.is_available() is False (no GPU or no CUDA build of torch)")
    if system.runner == "deepspeed" and args.device != "cuda":
        fail("DeepSpeed's ZeRO-3 optimizer offload needs a CUDA device (got --device cpu)")
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torchrun sets OMP_NUM_THREADS=1 for several ranks: the CPU optimizers get train.py's share instead
    use_cpu_threads(cpu_threads_per_rank(None, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    margs = model_args(args)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    info: dict = {"params": num_params(margs), "torch": torch.__version__, "world_size": world, "cpu_threads": torch.get_num_threads()}
    if system.runner == "fsdp":
        # gloo beside NCCL: clip_grad_norm_ reduces the norms of the CPU-resident shards on the CPU
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        peer = FsdpPeer(args, device, max_grad_norm, info)
    else:
        deepspeed.init_distributed(dist_backend="nccl")  # torchrun's environment
        peer = DeepSpeedPeer(args, device, max_grad_norm, info, system.offload)
    data = DataConfig(kind="synthetic", seq_len=args.seq, micro_batch=args.batch, seed=args.seed)
    batches = TokenBatches(data, margs.vocab_size, rank=rank, world_size=world)  # train.py's stream, rank by rank
    info["init_s"] = time.perf_counter() - start
    if rank == 0:
        print(f"{system.name}: set up in {info['init_s']:.1f} s", flush=True)
    with open(worker_rows_path(args.rows, rank), "a") as log:
        log.write(json.dumps({"info": info}) + "\n")
        log.flush()
        for step in range(args.steps):
            row = {"step": step, "loss": 0.0, "forward_s": 0.0, "backward_s": 0.0, "update_s": 0.0}
            t_start = time.perf_counter()
            for k in range(args.micro_batches):
                last = k + 1 == args.micro_batches
                tokens = next(batches).to(device)
                t0 = time.perf_counter()
                logits = peer.forward(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                sync()
                t1 = time.perf_counter()
                peer.backward(loss, last)
                sync()
                t2 = time.perf_counter()
                peer.update(last)  # DeepSpeed's step() on every micro-batch: counted as update time
                sync()
                row["forward_s"] += t1 - t0
                row["backward_s"] += t2 - t1
                row["update_s"] += time.perf_counter() - t2
                row["loss"] += loss.item() / args.micro_batches
            row["step_s"] = time.perf_counter() - t_start
            loss_mean = torch.tensor([row["loss"]], device=device)
            dist.all_reduce(loss_mean)  # the ranks' mean, as train.py logs it
            row.update(loss=loss_mean.item() / world, host_peak_gib=host_peak_gib())
            if device.type == "cuda":
                row["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            log.write(json.dumps(row) + "\n")
            log.flush()
            if rank == 0:
                print(f"{system.name} step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "step"), flush=True)
        if system.disk:  # proof that the state really went to the tier dir
            info["tier_dir_bytes"] = sum(f.stat().st_size for f in Path(args.tier_dir).rglob("*") if f.is_file())
            log.write(json.dumps({"info": info}) + "\n")
    dist.destroy_process_group()
