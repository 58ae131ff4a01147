"""A rank that stops answering (SIGSTOP) is named in the log by the others within the watchdog's
silence, once, long before the collective timeout; it is said again when it answers."""

from __future__ import annotations

import logging
import os
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_utils import free_port

from fsdp_offload.watchdog import RankWatchdog


def _entry(rank: int, world: int, port: int, log_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    handler = logging.FileHandler(f"{log_path}.{rank}")
    logging.getLogger("train").addHandler(handler)
    logging.getLogger("train").setLevel(logging.INFO)
    try:
        dog = RankWatchdog(silence_s=2.0).start()
        dist.barrier()
        if rank == 1:
            with open(f"{log_path}.pid1", "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 sends SIGCONT once it has named this rank
        else:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and "rank 1 (" not in open(f"{log_path}.0").read():
                time.sleep(0.2)
            os.kill(int(open(f"{log_path}.pid1").read()), signal.SIGCONT)
            while time.monotonic() < deadline and "rank 1 answers again" not in open(f"{log_path}.0").read():
                time.sleep(0.2)
        dist.barrier()  # both ranks go on: the watchdog only reports
        dog.stop()
    finally:
        dist.destroy_process_group()


def test_a_stopped_rank_is_named_within_the_watchdog_silence(tmp_path):
    log = str(tmp_path / "log")
    mp.start_processes(_entry, args=(2, free_port(), log), nprocs=2, start_method="spawn")
    said = open(f"{log}.0").read()
    assert said.count("watchdog: rank 1 (") == 1, said
    assert f"has not answered for" in said and "train.collective_timeout_s" in said and "rank 1 answers again" in said
    assert "watchdog" not in open(f"{log}.1").read()  # the stopped rank's own log: nothing about rank 0


def test_a_watchdog_needs_a_positive_silence():
    with pytest.raises(ValueError, match="silence_s > 0"):
        RankWatchdog(0)
