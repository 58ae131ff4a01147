"""The composed Hydra config (`fsdp_offload/recipes/`) as checked dataclasses: what `train.py` runs
and what the planner plans, read by one function so that both see the same run."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from .checkpoint import CheckpointConfig
from .config import OffloadConfig, dataclass_from, is_number, is_whole, path_option
from .data import DataConfig
from .job_errors import job_wide
from .models import LlamaArgs
from .units import SIZE_UNITS, parse_size


# What else a run keeps in its dir, by name (train.py's plan and TensorBoard dir, Hydra's record and
# log): a metrics file of one of these names would take it over, and a fresh run moves it aside as rows.
RUN_DIR_NAMES = {"placement.json": "plan", "tensorboard": "TensorBoard dir", ".hydra": "Hydra record",
                 "train.log": "log", ".lock": "lock (one run writes the dir at a time)"}  # fmt: skip


@dataclass
class TrainConfig:
    steps: int = 50
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = 5
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    micro_batches: int = 1  # gradient accumulation
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    cpu_threads: int | None = None  # threads of the CPU update; null: the node's physical cores / local ranks
    log_every: int = 1
    metrics_file: str = "metrics.jsonl"  # under the run's output dir; one file per rank
    out_dir: str | None = None  # the run's output dir; null: Hydra's run dir (rank 0's, for every rank)
    tensorboard: bool = False  # also write rank 0's rows for TensorBoard under <run dir>/tensorboard
    progress: bool = True
    kill_at_step: int | None = None  # fault injection: SIGKILL this process after that step's checkpoint
    profile_step: int | None = None  # this step (from 0) run under torch.profiler: a trace per rank in the run dir
    collective_timeout_s: float = 1800  # a collective that waits longer fails (gloo/NCCL name it); ends a hung job
    watchdog_s: float | None = 60  # a rank silent this long is named in the log by the others; null or 0: no watchdog
    compile: bool = False  # torch.compile each block's computation (models.compile_blocks); the first step compiles
    # The host memory of the node's ranks, in GiB or a size ('500GB'); null: what the machine has available at
    # start (MemAvailable, or the memory cgroup's limit less its use). State it where memory is added as it is used.
    host_memory_gb: float | str | None = None

    def __post_init__(self) -> None:  # a bad recipe fails here, before a process group or a model exists
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device={self.device!r}: choose auto, cpu or cuda")
        counts = {"steps": 1, "micro_batches": 1, "log_every": 1, "warmup_steps": 0, "cpu_threads": 1, "kill_at_step": 0,
                  "profile_step": 0}  # fmt: skip
        for name, least in counts.items():
            value = getattr(self, name)
            if value is None and name in ("cpu_threads", "kill_at_step", "profile_step"):  # null: not set
                continue
            if not (is_whole(value) and value >= least):
                raise ValueError(f"train.{name}={value!r} must be a whole number >= {least}")
        if not is_whole(self.seed):
            raise ValueError(f"train.seed={self.seed!r} must be a whole number")
        for name in ("lr", "weight_decay", "min_lr_ratio"):
            value = getattr(self, name)
            if not (is_number(value) and value >= 0):
                raise ValueError(f"train.{name}={value!r} must be a number >= 0")
        if self.profile_step is not None and self.profile_step >= self.steps:
            raise ValueError(f"train.profile_step={self.profile_step} is not a step of this run: steps count from 0, to "
                             f"train.steps - 1 = {self.steps - 1}")  # fmt: skip
        if self.min_lr_ratio > 1:
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio}: the cosine decays to lr * min_lr_ratio, which must "
                             "be in [0, 1] (1: a constant lr after warm-up)")  # fmt: skip
        if not (is_number(self.collective_timeout_s) and self.collective_timeout_s > 0):
            raise ValueError(f"train.collective_timeout_s={self.collective_timeout_s!r} must be a number of seconds > 0")
        if self.watchdog_s is not None and not (is_number(self.watchdog_s) and self.watchdog_s >= 0):
            raise ValueError(f"train.watchdog_s={self.watchdog_s!r} must be a number of seconds >= 0 (0 or null: no watchdog)")
        if not isinstance(self.compile, bool):
            raise ValueError(f"train.compile={self.compile!r}: choose true (torch.compile each block) or false")
        if not (isinstance(self.betas, (list, tuple)) and len(self.betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in self.betas)):
            raise ValueError(f"train.betas={self.betas!r} must be two numbers in [0, 1), e.g. train.betas=[0.9,0.95]")
        self.betas = tuple(self.betas)
        read_host_memory(self.host_memory_gb)  # (checked here, read by the property)
        self.out_dir = path_option(self.out_dir, "train.out_dir", null="Hydra's run dir")
        self.metrics_file = path_option(self.metrics_file, "train.metrics_file", what="a file name")
        name = self.metrics_file
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            # each rank writes rank<N>.<name> beside rank 0's <name> in the run dir: a path would put them elsewhere
            raise ValueError(f"train.metrics_file={name!r} must be a file name in the run's output dir, such as "
                             "metrics.jsonl; to write elsewhere, set train.out_dir")  # fmt: skip
        if name in RUN_DIR_NAMES:
            raise ValueError(f"train.metrics_file={name!r} is the name of the run's {RUN_DIR_NAMES[name]} in the same dir: "
                             "pick another file name, such as metrics.jsonl")  # fmt: skip

    @property
    def host_memory_bytes(self) -> int | None:
        """train.host_memory_gb in bytes (None: not stated: the machine's available memory at start)."""
        return read_host_memory(self.host_memory_gb)


def read_host_memory(host_memory_gb: float | str | None) -> int | None:
    """train.host_memory_gb in bytes (None: not stated); ValueError naming the option where it is no size."""
    if host_memory_gb is None:
        return None
    try:
        size, unit = parse_size(host_memory_gb)
    except (ValueError, OverflowError):  # (an int past a float's range)
        size, unit = math.nan, "GiB"
    if not (math.isfinite(size * SIZE_UNITS[unit]) and size * SIZE_UNITS[unit] >= 1):
        raise ValueError(f"train.host_memory_gb={host_memory_gb!r} must be GiB (500) or a size ('500GB', '512GiB'; units "
                         f"{', '.join(SIZE_UNITS)}) > 0, or null for what the machine has available at start")  # fmt: skip
    return int(size * SIZE_UNITS[unit])


@dataclass
class OffloadRecipe:
    optimizer: str = "offload"  # offload (OffloadAdamW) | torch (plain FSDP2 + torch AdamW)
    config: OffloadConfig = field(default_factory=OffloadConfig)


def to_dataclass(cls, node: DictConfig | dict, option: str):
    """Builds dataclass `cls` from a config node; an unknown key is an error naming the option."""
    return dataclass_from(cls, OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node, option)


SECTIONS = ("model", "offload", "data", "train", "checkpoint")  # the composed config's top-level keys


def check_sections(cfg: DictConfig) -> None:
    """A top-level key of the composed config that no section reads is an error: Hydra's answer to a
    misspelt option (`modle=1b`) is to suggest appending it (`+modle=1b`), which would then be ignored."""
    for key in cfg.keys():
        if key not in SECTIONS and key != "hydra":  # (a config composed with return_hydra_config=True has Hydra's own)
            close = difflib.get_close_matches(str(key), SECTIONS, n=1)
            hint = f"did you mean {close[0]}?" if close else f"the sections are {', '.join(SECTIONS)}"
            raise ValueError(f"{key}: not an option of the recipes, and nothing would read it; {hint}")


@job_wide
def read_config(cfg: DictConfig) -> tuple[TrainConfig, LlamaArgs, DataConfig, OffloadRecipe, CheckpointConfig]:
    """The composed config as its dataclasses, checked (train.py and the planner read it the same way)."""
    check_sections(cfg)
    tcfg = to_dataclass(TrainConfig, cfg.train, "train")
    margs = to_dataclass(LlamaArgs, cfg.model, "model")
    dcfg = to_dataclass(DataConfig, cfg.data, "data")
    ocfg = OmegaConf.to_container(cfg.offload, resolve=True)
    optimizer = ocfg.pop("optimizer", "offload")
    if optimizer == "offload" and ocfg.get("micro_batches", 1) != tcfg.micro_batches:
        raise ValueError(
            f"offload.micro_batches={ocfg.get('micro_batches', 1)} but train.micro_batches={tcfg.micro_batches}: the "
            "optimizer plans its grad sums for the backwards train.py runs per step; drop offload.micro_batches (the "
            "recipes set it from train.micro_batches)"
        )
    if optimizer == "offload" and tcfg.micro_batches > 1 and margs.sum_grads_unsharded is not True and ocfg.get("overlap") == "backward":
        raise ValueError(
            f"offload.overlap='backward' updates each subgroup as its grad comes in, one grad a step, and "
            f"train.micro_batches={tcfg.micro_batches}: set model.sum_grads_unsharded=true (FSDP2 sums the micro-batches, "
            "one grad a step), or use offload.overlap='next_forward'"
        )
    if optimizer == "offload" and tcfg.micro_batches > 1 and margs.sum_grads_unsharded is not False:
        if ocfg.get("grad_accumulation", "auto") != "auto":
            raise ValueError(
                f"offload.grad_accumulation={ocfg['grad_accumulation']!r} places the optimizer's sums of the step's "
                f"{tcfg.micro_batches} micro-batches, and model.sum_grads_unsharded={'true' if margs.sum_grads_unsharded is True else 'auto'} "
                "leaves (or may leave) the summing to FSDP2: set model.sum_grads_unsharded=false to keep the optimizer's "
                "sums, or drop offload.grad_accumulation"
            )
        if margs.sum_grads_unsharded is True:  # the optimizer takes one grad a step (node_plan.optimizer_config), from here on
            ocfg["micro_batches"] = 1
    recipe = OffloadRecipe(optimizer, to_dataclass(OffloadConfig, ocfg, "offload"))
    if recipe.optimizer not in ("offload", "torch"):
        raise ValueError(f"offload.optimizer={recipe.optimizer!r}: choose offload or torch")
    ckcfg = to_dataclass(CheckpointConfig, cfg.checkpoint, "checkpoint")
    if dcfg.seq_len > margs.max_seq_len:
        raise ValueError(
            f"data.seq_len={dcfg.seq_len} is above model.max_seq_len={margs.max_seq_len}: the model is not built for such "
            f"sequences (and attention's memory grows with their square); lower data.seq_len, or raise model.max_seq_len "
            "if the model is meant to take them"
        )
    return tcfg, margs, dcfg, recipe, ckcfg
