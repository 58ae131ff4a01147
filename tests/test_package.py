"""The package as users install it: the loop called twice from Python in one process, and a wheel
installed into a fresh virtual environment that trains through its console command, with no source
checkout on the path."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TWICE = """
import sys
from hydra import compose, initialize_config_dir
from fsdp_offload.train import run

with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    runs = [run(compose("train", overrides=["train.steps=3", "train.progress=false", f"train.out_dir={sys.argv[2]}/{k}"]))
            for k in range(2)]
assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]], runs
print("twice ok")
"""


def test_run_is_callable_twice_in_one_process(tmp_path):
    out = subprocess.run([sys.executable, "-c", TWICE, str(REPO / "fsdp_offload" / "recipes"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert out.returncode == 0 and "twice ok" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert (tmp_path / "0" / "metrics.jsonl").exists() and (tmp_path / "1" / "metrics.jsonl").exists()


def test_wheel_installs_and_trains_through_its_console_command(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(REPO)],
                   check=True, capture_output=True, text=True, timeout=300)  # fmt: skip
    [wheel] = (tmp_path / "dist").glob("fsdp_offload-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)  # fmt: skip
    # torch, hydra and the rest come from this interpreter's site-packages, put on the path without
    # processing its .pth files (which hold the editable install of this checkout)
    paths = os.pathsep.join(dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
    env = {**os.environ, "PYTHONPATH": paths, "OMP_NUM_THREADS": "1"}
    where = subprocess.run([str(bin_dir / "python"), "-c", "import fsdp_offload; print(fsdp_offload.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout.strip()  # fmt: skip
    assert where.startswith(str(env_dir)), f"fsdp_offload came from {where}, not the installed wheel"
    out = subprocess.run([str(bin_dir / "fsdp-offload-train"), "train.steps=3", "train.progress=false", "offload.kernel=torch",
                          f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    plan = subprocess.run([str(bin_dir / "fsdp-offload-plan"), "offload.kernel=torch", "machine.cpu_mparams_per_s=100",
                           "offload.calibration_gb=0.01"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    assert "largest preset that fits this recipe and machine:" in plan.stdout
