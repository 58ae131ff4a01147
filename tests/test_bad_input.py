"""Bad input across the public API: each is refused at once with a message that names the option (or
path) and says what to give instead, and nothing on disk changes (no tier file, no lock, no profile).
The planner's and the report's commands have theirs here too; train.py's CLI and the recipes in
test_train.py (test_bad_input_is_one_clear_line) and test_recipes.py; checkpoints in test_train.py and
test_checkpoint_trust.py."""

from __future__ import annotations

import math
import os

import pytest
import torch

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload import plan as plan_module
from fsdp_offload.checkpoint import CheckpointConfig
from fsdp_offload.grads import NonFiniteGradError
from fsdp_offload.models import LlamaArgs
from fsdp_offload.recipe import TrainConfig
from fsdp_offload.storage import TierError

pytestmark = pytest.mark.bad_input  # scripts/bad_input_sweep.py runs and counts every test so marked


def params(n: int = 50_000) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))]


def on_disk(root) -> list[str]:
    return sorted(str(p) for p in root.rglob("*"))


TIER = "posix:{tmp}"
CASES = [  # (what, how to build it with the tier dir `tmp`, what the message must say)
    ("budget below 0", lambda tmp: OffloadConfig(host_budget_gb=-1), "host_budget_gb=-1 must be a finite size >= 0"),
    ("budget in unknown units", lambda tmp: OffloadConfig(host_budget_gb="6 parsecs"), "'6GiB', '512MiB'"),
    ("budget under the minimum", lambda tmp: OffloadAdamW(params(100_000), offload=OffloadConfig(
        tiers=[TIER.format(tmp=tmp)], subgroup_numel=16384, host_budget_gb="100KiB")), "below the pipeline's minimum of 676 KiB"),
    ("subgroup size", lambda tmp: OffloadConfig(subgroup_numel=1000), "multiple of 1024"),
    ("prefetch", lambda tmp: OffloadConfig(prefetch=-1), "offload.prefetch=-1 must be >= 0"),
    ("gpu fraction", lambda tmp: OffloadConfig(gpu_fraction=1.5), "between 0 and 1, or 'auto'"),
    ("gpu share on CPU params", lambda tmp: OffloadAdamW(params(), offload=OffloadConfig(gpu_fraction=0.5)), "params are on cpu: use 0"),
    ("tier scheme", lambda tmp: OffloadConfig(tiers=["nvme:/x"]), "known schemes are ['kvikio', 'posix', 'throttle']"),
    ("tier dir missing", lambda tmp: OffloadAdamW(params(), offload=OffloadConfig(tiers=["posix:/nonexistent/x"], host_budget_gb=0.002)),
     "tier dir /nonexistent/x does not exist; create it or pick another path"),
    ("tier threads", lambda tmp: OffloadConfig(tiers=[TIER.format(tmp=tmp) + "?threads=zero"]), "threads='zero' is not a whole number"),
    ("tier request size", lambda tmp: OffloadConfig(tiers=[TIER.format(tmp=tmp) + "?request_mb=0.001"]), "multiple of 4096"),
    ("tier ratios", lambda tmp: OffloadConfig(tiers=[TIER.format(tmp=tmp)], placement="fixed", tier_ratios=[1, 2]), "one non-negative share per tier"),
    ("tier access", lambda tmp: OffloadConfig(tier_access="sometimes"), "choose 'exclusive', 'shared' or a number"),
    ("lock dir missing", lambda tmp: OffloadAdamW(params(), offload=OffloadConfig(tiers=[TIER.format(tmp=tmp)], subgroup_numel=16384,
     host_budget_gb=0.002, tier_lock_dir="/nonexistent/locks")), "offload.tier_lock_dir='/nonexistent/locks'"),
    ("bandwidth profile unwritable", lambda tmp: OffloadAdamW(params(), offload=OffloadConfig(
        tiers=[TIER.format(tmp=tmp), "posix:/dev/shm"], subgroup_numel=16384, host_budget_gb=0.002,
        bandwidth_profile="/proc/x/y.json", calibration_gb=0.001)), "point it to a writable file or set it to null (None in Python)"),
    ("calibration size", lambda tmp: OffloadConfig(calibration_gb=0), "calibration_gb=0 must be positive"),
    ("update order", lambda tmp: OffloadConfig(update_order="random"), "choose one of ('forward', 'alternating', 'fixed')"),
    ("overlap", lambda tmp: OffloadConfig(overlap="sideways"), "choose one of ('next_forward', 'backward', 'auto', 'none')"),
    ("backward overlap with clipping", lambda tmp: OffloadConfig(overlap="backward", max_grad_norm=1.0), "set offload.max_grad_norm=null (None in Python)"),
    ("param dtype", lambda tmp: OffloadConfig(param_dtype="float8"), "choose one of ('bfloat16', 'float16')"),
    ("kernel", lambda tmp: OffloadConfig(kernel="cuda"), "choose one of ('auto', 'fused', 'torch')"),
    ("grad path", lambda tmp: OffloadConfig(grad_path="gpu"), "choose one of ('auto', 'host_bf16', 'gpu_bf16', 'tier_fp32')"),
    ("grads on the GPU with CPU params", lambda tmp: OffloadAdamW(params(), offload=OffloadConfig(grad_path="gpu_bf16")),
     "keeps the grads in GPU memory, but the params are on cpu: use offload.grad_path='host_bf16' (or 'auto')"),
    ("clip norm", lambda tmp: OffloadConfig(max_grad_norm=-1), "must be a positive number, or null (None in Python) for no clipping"),
    ("clip norm NaN", lambda tmp: OffloadConfig(max_grad_norm=math.nan), "must be a positive number"),
    ("host headroom", lambda tmp: OffloadConfig(host_headroom_gb=-1), "host_headroom_gb=-1 must be >= 0"),
    ("loss scale", lambda tmp: OffloadConfig(param_dtype="float16", loss_scale_init=0), "loss_scale_init=0 must be > 0"),
    ("lr", lambda tmp: OffloadAdamW(params(), lr=-1), "invalid lr -1"),
    ("lr NaN", lambda tmp: OffloadAdamW(params(), lr=math.nan), "invalid lr nan"),
    ("betas", lambda tmp: OffloadAdamW(params(), betas=(1.0, 0.9)), "give two numbers in [0, 1)"),
    ("eps", lambda tmp: OffloadAdamW(params(), eps=-1e-8), "invalid eps"),
    ("weight decay", lambda tmp: OffloadAdamW(params(), weight_decay=-0.1), "invalid weight_decay -0.1"),
    ("a group's lr", lambda tmp: OffloadAdamW([{"params": params(), "lr": -1.0}]), "param group 0: invalid lr -1.0"),
    ("amsgrad", lambda tmp: OffloadAdamW(params(), amsgrad=True), "does not support amsgrad=True"),
    ("a param in two groups", lambda tmp: (lambda p: OffloadAdamW([{"params": p}, {"params": p}]))(params()), "more than one parameter group"),
    ("no params", lambda tmp: OffloadAdamW([]), "empty parameter list"),
    ("an integer param", lambda tmp: OffloadAdamW([torch.nn.Parameter(torch.ones(5, dtype=torch.int64), requires_grad=False)]), "torch.int64"),
    ("prefetch not a number", lambda tmp: OffloadConfig(prefetch="abc"), "offload.prefetch='abc' must be >= 0, a whole number"),
    ("no steps", lambda tmp: TrainConfig(steps=0), "train.steps=0 must be a whole number >= 1"),
    ("steps not a number", lambda tmp: TrainConfig(steps="abc"), "train.steps='abc' must be a whole number >= 1"),
    ("no micro-batches", lambda tmp: TrainConfig(micro_batches=0), "train.micro_batches=0 must be a whole number >= 1"),
    ("log every 0 steps", lambda tmp: TrainConfig(log_every=0), "train.log_every=0 must be a whole number >= 1"),
    ("metrics file a path", lambda tmp: TrainConfig(metrics_file="logs/m.jsonl"),
     "train.metrics_file='logs/m.jsonl' must be a file name in the run's output dir"),
    ("metrics file empty", lambda tmp: TrainConfig(metrics_file=""), "to write elsewhere, set train.out_dir"),
    ("metrics file the plan's", lambda tmp: TrainConfig(metrics_file="placement.json"),
     "train.metrics_file='placement.json' is the name of the run's plan in the same dir: pick another file name"),
    ("metrics file Hydra's log", lambda tmp: TrainConfig(metrics_file="train.log"), "is the name of the run's log"),
    ("one beta", lambda tmp: TrainConfig(betas=[0.9]), "train.betas=[0.9] must be two numbers in [0, 1)"),
    ("a beta of 1", lambda tmp: TrainConfig(betas=(0.9, 1.0)), "train.betas=(0.9, 1.0) must be two numbers in [0, 1)"),
    ("no heads", lambda tmp: LlamaArgs(n_heads=0), "model.n_heads=0 must be a whole number >= 1"),
    ("heads not dividing dim", lambda tmp: LlamaArgs(dim=64, n_heads=5), "model.dim=64 is not divisible by model.n_heads=5"),
    ("one beta, to the optimizer", lambda tmp: OffloadAdamW(params(), betas=(0.9,)), "invalid betas (0.9,): give two numbers"),
    ("three betas", lambda tmp: OffloadAdamW(params(), betas=[0.9, 0.95, 0.99]), "give two numbers in [0, 1)"),
    ("lr not a number", lambda tmp: OffloadAdamW(params(), lr="fast"), "invalid lr 'fast': must be a number >= 0"),
    ("the module for its params", lambda tmp: OffloadAdamW(torch.nn.Linear(4, 4)), "OffloadAdamW(model.parameters(), model=model"),
    ("one tier as a string", lambda tmp: OffloadConfig(tiers="posix:/mnt/nvme"), "e.g. offload.tiers=[posix:/mnt/nvme]"),
    ("tiers null", lambda tmp: OffloadConfig(tiers=None), "offload.tiers=None must be a list of tier specs"),
    ("clip norm a word", lambda tmp: OffloadConfig(max_grad_norm="None"), "max_grad_norm='None' must be a positive number, or null"),
    ("a number option null", lambda tmp: OffloadConfig(tier_lock_timeout_s=None), "tier_lock_timeout_s=None must be a number"),
    ("tier ratios not numbers", lambda tmp: OffloadConfig(tiers=[TIER.format(tmp=tmp)], placement="fixed", tier_ratios=["a"]),
     "tier_ratios=['a'] must be a list of numbers"),
    ("budget infinite", lambda tmp: OffloadConfig(host_budget_gb=math.inf), "host_budget_gb=inf must be a finite size"),
    ("budget a bool", lambda tmp: OffloadConfig(host_budget_gb=True), "offload.host_budget_gb=True: give GiB"),
    ("gpu fraction a bool", lambda tmp: OffloadConfig(gpu_fraction=True), "between 0 and 1, or 'auto'"),
    ("growth interval a fraction", lambda tmp: OffloadConfig(loss_scale_growth_interval=2.5), "must be a whole number of steps"),
    ("bandwidth profile a dir", lambda tmp: OffloadAdamW(params(), offload=OffloadConfig(
        tiers=[TIER.format(tmp=tmp), "posix:/dev/shm"], subgroup_numel=16384, host_budget_gb=0.002, bandwidth_profile=str(tmp),
        calibration_gb=0.001)), "is a directory: give the path of a JSON file"),
    ("checkpoint every, negative", lambda tmp: CheckpointConfig(dir=str(tmp / "ck"), every=-1), "checkpoint.every=-1 must be >= 0"),
    ("checkpoint every, a word", lambda tmp: CheckpointConfig(every="abc"), "checkpoint.every='abc' must be a whole number"),
    ("checkpoint every, no dir", lambda tmp: CheckpointConfig(every=2), "saves into checkpoint.dir, which is not set"),
    ("machine ranks null", lambda tmp: plan_module.MachineConfig(ranks_per_node=None), "machine.ranks_per_node=None must be a whole number >= 1"),
    ("machine host infinite", lambda tmp: plan_module.MachineConfig(host_gib=math.inf), "machine.host_gib=inf must be a finite number"),
    ("machine GPU update 0", lambda tmp: plan_module.MachineConfig(gpu_update_gbps=0), "gpu_update_gbps=0 must be a positive number"),
    ("machine CPU rate 0", lambda tmp: plan_module.MachineConfig(cpu_mparams_per_s=0), "cpu_mparams_per_s=0 must be a positive number"),
]  # fmt: skip


@pytest.mark.parametrize("what, build, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_the_option_and_nothing_changes(tmp_path, what, build, message):
    before = on_disk(tmp_path)
    with pytest.raises((ValueError, TypeError, OSError, TierError)) as info:
        built = build(tmp_path)
        if hasattr(built, "close"):
            built.close()
    assert message in str(info.value), f"{what}: {info.value}"
    assert on_disk(tmp_path) == before, f"{what} left files behind"


def test_the_sweep_covers_thirty_kinds():
    assert len(CASES) >= 30


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_grads_are_refused_before_any_update(tmp_path, bad):
    p = params()
    opt = OffloadAdamW(p, offload=OffloadConfig(max_grad_norm=1.0, kernel="torch", subgroup_numel=16384,
                                                tiers=[TIER.format(tmp=tmp_path)], host_budget_gb=0.0015))  # fmt: skip
    grad = torch.randn(p[0].numel())
    p[0].grad = grad.bfloat16()
    opt.step()
    before = opt.state_dict()["state"][0]
    grad[7] = bad
    p[0].grad = grad.bfloat16()
    with pytest.raises(NonFiniteGradError, match=rf"global grad norm is {bad}.*Nothing was updated; call zero_grad\(\)"):
        opt.step()
    after = opt.state_dict()["state"][0]
    assert all(torch.equal(before[k], after[k]) for k in ("master_param", "exp_avg", "exp_avg_sq")) and after["step"] == before["step"]
    opt.zero_grad()  # drops the bad grads: the next batch trains on
    p[0].grad = torch.randn(p[0].numel()).bfloat16()
    opt.step()
    assert int(opt.state_dict()["state"][0]["step"]) == int(before["step"]) + 1
    assert os.listdir(tmp_path)  # its tier dir, in use
    opt.close()


def test_no_symlink_is_followed(tmp_path):
    """A link planted where the product keeps its files (a tier's private dir, a lock file, the bandwidth
    profile) is refused, naming it, instead of being written or read through."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    tier_dir = tmp_path / "tier"
    tier_dir.mkdir()
    (tier_dir / f"fsdp-offload-{os.getuid()}").symlink_to(target)
    with pytest.raises(TierError, match=r"not a 0700 directory owned by uid \d+ \(a symlink"):
        OffloadAdamW(params(), offload=OffloadConfig(tiers=[f"posix:{tier_dir}"], subgroup_numel=16384, host_budget_gb=0.002))

    profile = tmp_path / "profile.json"
    profile.symlink_to(target / "x.json")
    (target / "x.json").write_text("{}")
    from fsdp_offload.bandwidth_profile import BandwidthProfile

    with pytest.raises(TierError, match="is a symbolic link, which is never followed"):
        prof = BandwidthProfile(str(profile))
        with prof.locked():
            prof.load()
    assert (target / "x.json").read_text() == "{}"

    locks = tmp_path / "locks"
    locks.mkdir(mode=0o700)
    lock_tier = tmp_path / "locked"
    lock_tier.mkdir()
    opt = OffloadAdamW(params(), offload=OffloadConfig(tiers=[f"posix:{lock_tier}"], subgroup_numel=16384, host_budget_gb=0.002,
                                                       tier_lock_dir=str(locks)))  # fmt: skip
    lock_files = [p for p in locks.rglob("*.lock")]
    opt.close()
    assert lock_files, "the exclusive tier made no lock file"
    for f in lock_files:  # the same names, now links to a file that must not be touched
        f.parent.mkdir(mode=0o700, exist_ok=True)  # (the last lock's close took the dir away with the files)
        f.unlink(missing_ok=True)
        f.symlink_to(target / "x.json")
    with pytest.raises(TierError, match="cannot open tier lock file"):
        OffloadAdamW(params(), offload=OffloadConfig(tiers=[f"posix:{lock_tier}"], subgroup_numel=16384, host_budget_gb=0.002,
                                                     tier_lock_dir=str(locks)))  # fmt: skip
    assert (target / "x.json").read_text() == "{}"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.log_every=0"], "train.log_every=0 must be a whole number >= 1"),
        (["train.micro_batches=0"], "train.micro_batches=0 must be a whole number >= 1"),
        (["train.steps=abc"], "train.steps='abc' must be a whole number >= 1"),
        (["train.betas=[0.9]"], "train.betas=[0.9] must be two numbers in [0, 1)"),
        (["offload.prefetch=abc"], "offload.prefetch='abc' must be >= 0"),
        (["model.n_heads=0"], "model.n_heads=0 must be a whole number >= 1"),
        (["model=nope"], "Could not find 'model/nope'; Available options in 'model': 100b, 120b"),
        (["offload.nope=1"], "Could not override 'offload.nope'; Key 'nope' is not in struct"),
        (["train.steps=[1"], "no viable alternative at input '[1'"),
        (["machine.ranks_per_node=abc"], "machine.ranks_per_node='abc' must be a whole number"),
        (["offload=none"], "is not what the planner plans: it places OffloadAdamW's state; choose an offload recipe"),
        (["offload.gpu_fraction=0.2", "machine.gpu_gib=0"], "offload.gpu_fraction=0.2 keeps state on the GPU, but the planned run trains on the CPU"),
        (["offload.grad_path=gpu_bf16", "train.device=cpu"], "keeps the grads in GPU memory, but the planned run trains on the CPU"),
        (["train.device=cuda", "machine.gpu_gib=0"], "train.device=cuda, but the machine planned for has no GPU"),
    ],
)  # fmt: skip
def test_the_planner_refuses_bad_options_in_one_line(overrides, message, capsys):
    assert plan_module.main(overrides) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_the_report_skips_files_and_refuses_a_missing_run_in_one_line(tmp_path, capsys):
    report = pytest.importorskip("fsdp_offload.report")
    sweep = tmp_path / "multirun"  # as Hydra leaves a sweep: job dirs 0, 1, ... and multirun.yaml
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "metrics.jsonl").write_text('{"step": 0, "step_s": 1.0}\n{"step": 1, "step_s": 0.5}\n')
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    assert report.main([str(sweep / "0"), str(sweep / "multirun.yaml"), "--out", str(tmp_path / "figures")]) == 0
    assert (tmp_path / "figures" / "summary.json").is_file()
    capsys.readouterr()
    assert report.main([str(sweep / "1"), "--out", str(tmp_path / "figures")]) == 2
    err = capsys.readouterr().err
    assert "multirun/1/metrics.jsonl does not exist: give the run dir" in err and err.count("\n") == 1, err


def test_what_python_and_hydra_pass_for_a_valid_option_is_taken(tmp_path):
    """Paths as pathlib.Path, numpy numbers, a dir named with digits (YAML's int), an endless lock wait,
    betas as Hydra's ListConfig or a tensor: accepted, as torch and the earlier checks took them."""
    np = pytest.importorskip("numpy")
    from omegaconf import OmegaConf

    cfg = OffloadConfig(tier_lock_dir=tmp_path, bandwidth_profile=tmp_path / "p.json", host_headroom_gb=np.float32(4),
                        max_grad_norm=np.float32(1.0), loss_scale_growth_interval=np.int64(10), tier_lock_timeout_s=math.inf,
                        tiers=(f"posix:{tmp_path}",), placement="fixed", tier_ratios=np.array([1.0]))  # fmt: skip
    assert (cfg.tier_lock_dir, cfg.bandwidth_profile, cfg.tier_ratios) == (str(tmp_path), str(tmp_path / "p.json"), [1.0])
    assert CheckpointConfig(dir=tmp_path / "ck", every=np.int64(2)).dir == str(tmp_path / "ck")
    assert CheckpointConfig(dir=2024).dir == "2024" and TrainConfig(out_dir=2024).out_dir == "2024"
    for betas in (OmegaConf.create([0.9, 0.95]), torch.tensor([0.9, 0.95]), np.array([0.9, 0.95])):
        OffloadAdamW(params(), betas=betas, offload=OffloadConfig(kernel="torch")).close()
