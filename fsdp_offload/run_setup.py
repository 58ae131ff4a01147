"""What a training run sets up around its steps: the process group, the output dir, the lr schedule,
and the RNG state a checkpoint keeps."""

from __future__ import annotations

import math
import os
import random
from datetime import timedelta

import hydra
import numpy as np
import torch
import torch.distributed as dist

from .machine import nearest_existing
from .recipe import TrainConfig


def lr_lambda(cfg: TrainConfig):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def init_distributed(device: str, timeout_s: float = 1800) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is visible: use train.device=cpu")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():  # else the caller's group (run() from a notebook or a test)
        backend, timeout = "nccl" if device == "cuda" else "gloo", timedelta(seconds=timeout_s)
        if "RANK" in os.environ:  # a launcher's job (torchrun, srun): its rendezvous
            dist.init_process_group(backend, timeout=timeout)
        else:  # plain `python scripts/train.py`: a world of one, met in this process, with no port to collide on
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def rng_state() -> dict:
    """Every RNG's state as tensors and plain values (a checkpoint is loaded with weights_only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}  # fmt: skip
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def check_writable_dir(path: str, option: str) -> None:
    """`path` is a dir this process can write in, or can be made one: an output dir that cannot fails
    here, before the model is built, not at the first save after hours of training."""
    existing = nearest_existing(path)
    if not os.path.isdir(existing):
        raise ValueError(f"{option}={path}: {existing} is a file, not a directory; give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option}={path}: {existing} is not writable by uid {os.getuid()}; fix its mode or give another path")


def run_dir(out_dir: str | None) -> str:
    """The job's one output dir: `train.out_dir`, else rank 0's Hydra run dir, which every rank writes
    its files into (a launcher other than torchrun may start the ranks at different times, each with
    a Hydra dir of its own)."""
    if out_dir is None:
        if not hydra.core.hydra_config.HydraConfig.initialized():
            raise ValueError("train.out_dir is not set and no Hydra run dir exists (run() outside @hydra.main): set train.out_dir")
        out_dir = hydra.core.hydra_config.HydraConfig.get().runtime.output_dir
    out = [out_dir]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(out, src=0)
    os.makedirs(out[0], exist_ok=True)
    return out[0]
