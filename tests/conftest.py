"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

RAM_DIR_MIN_FREE = 512 << 20

if torch.cuda.is_available():
    # Fix this process's view of the GPU before any CPU test hides it from what it starts (below): once
    # CUDA is initialised torch caches device_count(), read from CUDA_VISIBLE_DEVICES as it is at that
    # moment, and a count first taken inside a CPU test (0) broke every GPU test after it.
    torch.cuda.init()
    assert torch.cuda.device_count() > 0


@pytest.fixture(autouse=True)
def cpu_only_children(request, monkeypatch):
    """What a CPU test starts (train.py, torchrun, a script) runs on the CPU also on a GPU machine, as
    dist_utils.run_ranks' ranks do: train.device=auto would take the GPU, and two ranks would share it.
    Tests marked `gpu` keep it."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def ram_dir(tmp_path):
    """A fresh directory on tmpfs, for throttled tiers: there the throttle alone sets the pace, so
    timing and calibration tests measure the throttle, not a CI machine's disk (whose O_DIRECT writes
    under load are slower than the speeds those tests set). tmp_path where /dev/shm is missing or small."""
    shm = "/dev/shm"
    if not os.path.isdir(shm) or shutil.disk_usage(shm).free < RAM_DIR_MIN_FREE or not os.access(shm, os.W_OK):
        yield tmp_path
        return
    d = tempfile.mkdtemp(prefix="fsdp-offload-test-", dir=shm)
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# The longest tests (each tens of seconds on 2 cores: several process launches) go first, so that
# `pytest -n 2` does not end on one of them while the other worker idles.
LONGEST_FIRST = (
    "test_train.py::test_killed_run_resumes_bit_for_bit", "test_notebook.py::", "test_fsdp.py::test_fsdp_offload_matches",
    "test_bench_peers.py::", "test_package.py::", "test_bench_local_ranks.py::", "test_lock.py::test_four_processes",
    "test_hf_clients.py::", "test_job_faults.py::test_a_second_run", "test_train.py::test_a_run_resumed_into_its_own_dir",
    "test_hf_llama.py::", "test_overlap.py::test_overlapped_update_is_bit_exact", "test_campaign.py::test_whole_runs",
    "test_train.py::test_a_run_resumed_with_a_longer_schedule", "test_train.py::test_a_run_rewound",
)  # fmt: skip


def pytest_collection_modifyitems(items: list) -> None:
    items.sort(key=lambda item: not any(name in item.nodeid for name in LONGEST_FIRST))  # stable: the rest keep their order
