"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

RAM_DIR_MIN_FREE = 512 << 20


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
