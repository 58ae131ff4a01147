"""Running a function on N CPU ranks (gloo), or on one GPU rank (NCCL), from a test."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import math
import multiprocessing
import os
import shutil
import socket
import tempfile
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free now, for a test that hands MASTER_PORT to what it starts. run_ranks and
    run_on_one_gpu need none: a port found free can be taken by another test process (pytest -n, or
    another suite on the machine) before the ranks bind it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_group(monkeypatch, backend: str) -> Iterator[None]:
    """A process group of pytest's own process alone (rank 0 of 1) on `backend`, destroyed at the end; its
    env set through `monkeypatch`, so none of it outlives the test (a MASTER_PORT left behind made later
    train.py runs fail to bind it)."""
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(name, value)
    dist.init_process_group(backend)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _rendezvous_file() -> Iterator[str]:
    """A file:// rendezvous of its own for one group's ranks: no port to pick, none to race for."""
    folder = tempfile.mkdtemp(prefix="fsdp-offload-rdzv-")
    try:
        yield "file://" + os.path.join(folder, "store")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _entry(rank: int, world_size: int, rendezvous: str, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    # CPU ranks, also on a GPU machine: FSDP2 would otherwise move inputs to the GPU it sees
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        # A caught exception's traceback can keep the group alive in a reference cycle; freed only at exit,
        # after destroy_process_group, its gloo threads abort the process ("terminate called ...").
        gc.collect()
        dist.destroy_process_group()


# The ranks fork from a server process that has imported torch and the package once: a fresh
# interpreter per rank spent about 2 s of CPU importing them, at every run_ranks call of the suite.
# (Modules only: Python 3.11's forkserver does not take the tests' sys.path.)
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "fsdp_offload"])


def run_ranks(world_size: int, fn: Callable, *args) -> None:
    """Runs fn(rank, world_size, *args) on `world_size` gloo ranks; raises if any rank fails."""
    with _rendezvous_file() as rendezvous:
        mp.start_processes(_entry, args=(world_size, rendezvous, fn, args), nprocs=world_size, start_method="forkserver")


# A GPU test's child runs for seconds; one that hangs (a stream wait never met, a thread that keeps it
# from exiting) prints every thread's stack and exits, failing its test, instead of holding the suite.
GPU_CHILD_HANG_S = 150


def _gpu_entry(rank: int, rendezvous: str, fn: Callable, args: tuple) -> None:
    faulthandler.dump_traceback_later(GPU_CHILD_HANG_S, exit=True)  # left armed through the exit
    os.environ.update(RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=rendezvous, rank=0, world_size=1)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def run_on_one_gpu(fn: Callable, *args) -> None:
    """Runs fn(*args) in a fresh process as the one NCCL rank of cuda:0; raises if it fails."""
    with _rendezvous_file() as rendezvous:
        mp.start_processes(_gpu_entry, args=(rendezvous, fn, args), nprocs=1, start_method="spawn")


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """The optimizer's rank-local masters and moments, on the host (waits for an update in flight)."""
    from fsdp_offload.fsdp import local_data

    state = opt.state_dict()["state"]
    return [local_data(state[i][k]) for i in range(len(state)) for k in ("master_param", "exp_avg", "exp_avg_sq")]


def trained_state(opt, model) -> list[torch.Tensor]:
    """Every rank-local tensor a step writes, on the host: the optimizer's masters and moments, then the
    model's params."""
    from fsdp_offload.fsdp import local_data

    return optimizer_tensors(opt) + [local_data(p).detach().cpu() for p in model.parameters()]


def spy_step_transfers(opt) -> list[list]:
    """A list that gets each step's transfers (as the optimizer takes them for its metrics) appended."""
    per_step = []
    take = opt.store.take_io

    def spy():
        transfers, hits = take()
        per_step.append(transfers)
        return transfers, hits

    opt.store.take_io = spy
    return per_step


def reference_clip(grads: list[torch.Tensor], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    """A reference step's clipping, as the optimizer's hooks take it: the global L2 norm of the ranks'
    local grad shards (each grad's sum of squares, summed, one all-reduce) and the grads in FP32 scaled
    by the clip factor."""
    from fsdp_offload.grads import square_sum

    sq = torch.stack([square_sum(g.reshape(-1)) for g in grads]).sum().reshape(1)
    dist.all_reduce(sq)
    norm = math.sqrt(float(sq))
    clip = min(1.0, max_norm / (norm + 1e-6))
    return norm, [g.float() * clip for g in grads]
