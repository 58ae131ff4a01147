"""The fault campaign's modes (scripts/fault_campaign.py, campaign_runs.py, run_faults.py): the GPU
mode differs from the CPU one only in how ranks are placed (train.device, hence the backend, one GPU per
rank, the tier scheme), which is checked here against train.py's own choice; the time budget cuts
trials and says so; the whole-run trials run on gloo ranks; a record fills the doc's sections."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import campaign_doc  # noqa: E402
from campaign_runs import Launch, Runs  # noqa: E402
from fault_campaign import Budget, guarded, interleave  # noqa: E402


def campaign(tmp_path: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / "fault_campaign.py"), "--dir", str(tmp_path), "--out", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def the_record(tmp_path: Path) -> dict:
    return json.loads(next((tmp_path / "out").glob("fault_campaign_*.json")).read_text())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_launch_places_ranks_as_train_py_does(tmp_path, monkeypatch, device):
    """The campaign's backend is the one train.py's init_distributed (run_setup.py) picks for that train.device, and
    each run names the device, the rank count and the tier scheme."""
    import torch.distributed as dist

    from fsdp_offload import run_setup

    launch = Launch(device, 4, "kvikio" if device == "cuda" else "posix")
    cmd = Runs(tmp_path, launch, 6, 2, 60, 29999).command(tmp_path / "run")
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4" and f"train.device={device}" in cmd
    assert f"offload.tiers=['{launch.tier_scheme}:{tmp_path / 'run' / 'tier'}']" in cmd
    assert ("CUBLAS_WORKSPACE_CONFIG" in launch.env()) == (device == "cuda")
    picked = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: picked.setdefault("backend", backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: picked.setdefault("gpu", index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: picked.get("gpu", 0))
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)
    run_setup.init_distributed(device)
    assert picked["backend"] == launch.backend == {"cpu": "gloo", "cuda": "nccl"}[device]
    assert picked.get("gpu") == (3 if device == "cuda" else None)  # rank r on GPU r


def test_what_this_machine_cannot_run_is_refused_in_one_line(tmp_path):
    out = campaign(tmp_path, "--device", "cuda", "--kill-trials", "1")  # conftest hides any GPU from a CPU test
    assert out.returncode == 2 and "error: --device cuda: no CUDA device is visible here" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    try:
        ctypes.CDLL("libcuda.so.1")
        kvikio_runs = importlib.util.find_spec("kvikio") is not None
    except OSError:
        kvikio_runs = False
    if not kvikio_runs:
        out = campaign(tmp_path, "--tier-scheme", "kvikio", "--trials", "1")
        assert out.returncode == 2 and "error: --tier-scheme kvikio: " in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "out").exists()


def test_trials_are_interleaved_and_the_budget_cuts_them():
    order = interleave({"tier": 4, "kill": 2, "run": 1})
    assert sorted(order) == [("kill", 0), ("kill", 1), ("run", 0), ("tier", 0), ("tier", 1), ("tier", 2), ("tier", 3)]
    assert order[:3] == [("tier", 0), ("kill", 0), ("tier", 1)] and order.index(("run", 0)) < order.index(("kill", 1))
    assert Budget(None).fits("kill", 1e9)
    budget = Budget(100.0)
    assert budget.fits("run", 90) and not budget.fits("run", 101)
    budget.took["run"] += [60.0, 20.0]  # the mean of what ran (40 s) replaces the prior
    assert budget.fits("run", 1000) and not Budget(100.0).fits("run", 1000)


def test_a_trial_the_campaign_cannot_judge_is_recorded_as_its_error():
    row = guarded(lambda: {}["step_00000006"], {"trial": 3, "nproc": 2})
    assert row["outcome"] == "campaign_error" and row["trial"] == 3 and "KeyError: 'step_00000006'" in row["errors"][0]
    assert "test_campaign.py:" in row["errors"][0]
    assert "campaign error" in campaign_doc.run_table({"kill_during_save": {"campaign_error": 1}})


def test_a_budget_that_runs_out_is_said_in_the_record(tmp_path):
    out = campaign(tmp_path, "--trials", "400", "--steps", "3", "--budget-s", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    record = the_record(tmp_path)
    ran, cut = record["ran"]["tier"], record["cut_for_time"]["tier"]
    assert 0 < ran < 400 and ran + cut == 400 and record["trials"] == ran and record["asked"]["tier"] == 400
    assert record["campaign"]["train_device"] == "cpu" and record["bad"] == 0
    assert f"({ran} of 400 asked" in campaign_doc._tier_line(record)


def test_whole_runs_are_killed_resumed_and_refused_on_gloo_ranks(tmp_path):
    """A short CPU campaign: one kill/resume trial and one damaged trainer state, 2 gloo ranks."""
    out = campaign(tmp_path, "--trials", "0", "--kill-trials", "1", "--kills-per-trial", "1", "--run-trials", "1",
                   "--run-cases", "damaged_trainer_state", "--budget-s", "500", "--seed", "2")  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    record = the_record(tmp_path)
    where = record["campaign"]
    assert (where["train_device"], where["backend"], where["nproc"], where["tier_scheme"]) == ("cpu", "gloo", [2], "posix")
    assert record["commit"] and record["asked"] == {"tier": 0, "kill": 1, "run": 1} and record["ran"] == {"tier": 0, "kill": 1, "run": 1}
    (kill,) = record["kill_trials_detail"]
    assert kill["outcome"] in ("resumed_bit_exact", "missed") and kill["nproc"] == 2, kill
    assert record["run_outcomes"] == {"damaged_trainer_state": {"refused_named": 1}}, record["run_trials_detail"]
    assert record["references"]["2"]["repeat_bit_exact"] is None  # rerun only on a GPU
    assert record["bad"] == 0 and not record["kept_logs"]
    assert not list(tmp_path.glob("fault-campaign-*")), "the campaign left its dirs behind"


SECTIONS = "\n".join(f"<!-- {name}: begin -->\nold {name}\n<!-- {name}: end -->" for name in ("fault_campaign", "run_faults", "gpu_campaign"))


def test_a_gpu_record_fills_its_own_section(tmp_path):
    record = {"commit": "0123456789abcdef", "device": "nvidia-h100-x4", "wall_s": 401.0, "trials": 2, "faults_injected": 3,
              "faults_recovered": 3, "outcomes": {"update/eio_read": {"exact": 1}, "update/bitflip": {"detected": 1}},
              "table": campaign_doc.tier_table({"update/eio_read": {"exact": 1}, "update/bitflip": {"detected": 1}}),
              "campaign": {"train_device": "cuda", "backend": "nccl", "nproc": [2, 4], "tier_scheme": "kvikio", "gpus": ["NVIDIA H100"],
                           "kvikio": "25.08"},
              "references": {"2": {"run_s": 9.0, "repeat_bit_exact": True}, "4": {"run_s": 11.0, "repeat_bit_exact": True}},
              "asked": {"tier": 5, "kill": 4, "run": 2}, "ran": {"tier": 2, "kill": 4, "run": 2},
              "kill_trials": 4, "kills": 7, "kill_outcomes": {"2 ranks": {"resumed_bit_exact": 2}, "4 ranks": {"resumed_bit_exact": 2}},
              "run_trials": 2, "run_bad": 0, "run_outcomes": {"two_writers": {"refused_named": 1}, "full_run_dir": {"skipped": 1}},
              "run_trials_detail": [{"case": "full_run_dir", "outcome": "skipped", "why": "mount failed: permission denied"}]}  # fmt: skip
    path, doc = tmp_path / "fault_campaign_nvidia-h100-x4_x.json", tmp_path / "doc.md"
    path.write_text(json.dumps(record))
    doc.write_text(SECTIONS)
    out = campaign(tmp_path, "--doc-from", str(path), "--doc", str(doc))
    assert out.returncode == 0, out.stderr
    text = doc.read_text()
    assert "old fault_campaign" in text and "old run_faults" in text and "old gpu_campaign" not in text
    for said in ("commit 0123456", "2/4 ranks on nccl", "tier `kvikio:`", "KvikIO 25.08", "4 kill/resume trials with 7 SIGKILLs",
                 "4 resumed bit for bit", "2 tier trials (2 of 5 asked", "full_run_dir: mount failed: permission denied",
                 "| 4 ranks | 2 | 2 |", "| two_writers | 1 | 0 | 1 |"):  # fmt: skip
        assert said in text, said
