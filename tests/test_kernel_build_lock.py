"""The fused kernel's build dir lock: a load never waits forever for a lock left by a killed process
(torch's own `lock` file, which every later load used to wait for, silently), and a live builder is
waited for with a bounded wait that names the file."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from fsdp_offload.kernels.cpu_adamw import build_lock

HOLD = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)"


def test_a_lock_file_left_by_a_killed_build_is_removed(tmp_path):
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its holder is SIGKILLed
    with build_lock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()


def test_the_lock_dies_with_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "build.flock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=r"build\.flock.*TORCH_EXTENSIONS_DIR"):
            with build_lock(str(tmp_path), wait_s=0.2):
                pass
    finally:
        holder.kill()
        holder.wait()
    with build_lock(str(tmp_path), wait_s=30):  # the killed holder's flock went with it
        fd = os.open(tmp_path / "build.flock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by us now
        os.close(fd)
