"""Options of the out-of-core optimizer, as a dataclass that Hydra recipes fill in, checked once.

Choices are plain strings checked against the tuples below (not `Literal` annotations: OmegaConf 2.3
refuses those in structured configs), and `__post_init__` checks every field, naming the option and
the fix, so a bad recipe fails before anything is built (`tier_lock_dir` and `bandwidth_profile`, paths
on this host, are checked when the optimizer opens them).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
import tempfile
from dataclasses import dataclass, field

from .job_errors import JobError
from .kernels import KERNEL_NAMES
from .order import UPDATE_ORDERS
from .storage import TierSpec
from .storage.spec import parse_tiers
from .storage.lock import access_slots
from .subgroups import check_subgroup_numel
from .units import GIB, SIZE_UNITS, parse_size, readable_size

NULL = "null (None in Python)"  # how an error names an unset option: recipes and the command line write null


def is_whole(value: object) -> bool:
    """An integer (numpy's too), and not a bool (True is an int to Python, never a count to a recipe)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite real number (numpy's too), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def path_option(value: object, option: str, *, null: str | None = None, what: str = "a path") -> str | None:
    """A path option as a str: a str, a pathlib.Path (or other os.PathLike) from Python, or the int
    that YAML makes of a dir named with digits; None where the option may be null (`null` says what it
    means); anything else an error naming the option."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if is_whole(value):
        return str(value)
    if isinstance(value, str) or (value is None and null is not None):
        return value
    raise ValueError(f"{option}={value!r} must be {what}" + (f", or null for {null}" if null is not None else ""))


PARAM_DTYPES = ("bfloat16", "float16")
GRAD_PATHS = ("auto", "host_bf16", "gpu_bf16", "tier_fp32")
PLACEMENTS = ("learned", "eq1", "fixed")
OVERLAPS = ("next_forward", "backward", "auto", "none")
GRAD_ACCUMULATIONS = ("auto", "gpu", "host")


@dataclass
class OffloadConfig:
    # Storage paths for FP32 state that does not fit the host cache, e.g. ["posix:/local/nvme"].
    tiers: list[str] = field(default_factory=list)
    # The host memory this rank's optimizer keeps, in GiB: the low-precision grad/param staging buffer
    # (2 bytes/param, page-locked; one subgroup's with grad_path="gpu_bf16"), the FP32 state cache and,
    # with grad_path="tier_fp32", its FP32 grad buffer. A number of GiB or a size ("6GiB", "512MiB",
    # "8GB"). None: keep all state in host memory. "auto": the node's host memory (train.py's
    # train.host_memory_gb where stated, else what is available: MemAvailable, or the memory cgroup's
    # room) less host_headroom_gb, divided among the node's ranks; the optimizer logs what it chose.
    host_budget_gb: float | str | None = None
    # host_budget_gb="auto" only: GiB of the node's host memory left to everything else.
    host_headroom_gb: float = 8.0
    # Elements per subgroup (one I/O unit); a multiple of 1024. 100Mi by default, as in DeepSpeed.
    subgroup_numel: int = 100 * (1 << 20)
    # Subgroups fetched ahead of the one being updated.
    prefetch: int = 2
    # "forward" (subgroups in memory first, then the ones to read, each in the order the forward needs
    # them), "alternating" (MLP-Offload: ascending on even steps, descending on odd) or "fixed" (always
    # ascending: the ablation baseline). See order.py.
    update_order: str = "forward"
    # "next_forward": step() starts the update on a worker thread and returns; each FSDP unit's next
    # forward waits only for the subgroups holding its params. "none": step() returns when every param
    # is updated (for debugging). Needs model= (without it there is no forward to hook: the step is
    # synchronous). "backward": as "next_forward", and each subgroup in memory is updated as soon as
    # backward has handed in all its grads (LuWu's overlap), so the update starts at backward's first
    # grad: no clipping, bf16, one backward per step (each grad is final when it arrives), and the
    # hyperparameters in effect when backward starts. "auto": "backward" where those hold, else
    # "next_forward"; it takes one backward per step() (train.py resolves it with train.micro_batches).
    overlap: str = "next_forward"
    # Low-precision dtype of the model's params and grads: "bfloat16" or "float16".
    param_dtype: str = "bfloat16"
    # Keep the FP32 masters off the GPU split (bf16 params only, kernels/split_masters.py): their low
    # halves alone, the model's bf16 params being their high halves, so a subgroup takes 10 bytes a param
    # in the host cache and on the tiers instead of 12, bit for bit. The update's kernel then joins and
    # splits them (more CPU work a param). "auto": where the host cache would not hold every subgroup off
    # the GPU whole; true; false.
    split_masters: bool | str = "auto"
    # AdamW kernel: "auto" (fused C++ if it builds, else torch), "fused" or "torch".
    kernel: str = "auto"
    # Share of subgroups (the last ones of the layout) whose FP32 state stays in GPU memory and is
    # updated there by the Triton kernel, as ZeRO-Offload++'s ratio: their grads never leave the GPU.
    # 0: all state off the GPU. Needs CUDA params and the GPU memory for it (checked at construction).
    # "auto": after the first step, as many subgroups as the GPU memory left free by that step's peak
    # holds, keeping gpu_headroom_gb free (logged, and in each step's metrics as subgroups_on_gpu).
    gpu_fraction: float | str = 0.0
    # GPU memory kept free above a step's peak, in GiB, by what sizes itself from the GPU's room: gpu_fraction="auto"
    # (above the first step's measured peak), grad_path and grad sums "auto", model.activation_checkpointing,
    # model.reshard_after_forward and model.sum_grads_unsharded "auto".
    gpu_headroom_gb: float = 4.0
    # "host_bf16": grads stay bf16 in host memory and are upcast in flight (MLP-Offload). "gpu_bf16": the
    # same, but the grads stay in GPU memory where backward made them, and each subgroup's come to the
    # host just before its update (2 bytes/param of GPU memory instead of host memory: the host budget
    # goes to the FP32 cache; needs CUDA params). "tier_fp32": upcast to FP32, written to the tiers and
    # read back for the update, as DeepSpeed does (ablation).
    # "auto" (staging.resolve_grad_path): "gpu_bf16" where it saves tier bytes (a fixed GPU share, a host
    # cache that would spill, room on the GPU), else "host_bf16".
    grad_path: str = "auto"
    # backward() calls per step() (gradient accumulation). With 1, each grad is staged to host memory as
    # backward makes it; with more, one param's grads are summed in FP32, in micro-batch order, where
    # grad_accumulation says (the recipes set it from train.micro_batches). A backward beyond it before
    # step(), or a grad handed to stage_grad() beyond it, is summed exactly all the same, in memory that
    # was not planned (logged once).
    micro_batches: int = 1
    # Where those FP32 sums live (grad_sums.py): "gpu" (4 bytes a param of GPU memory; nothing leaves the
    # GPU until step()), "host" (6 bytes a param of host memory; each later grad is added by a worker
    # thread while backward goes on) or "auto": "gpu" where CUDA params accumulate and the GPU has room
    # for the sums beside gpu_headroom_gb, else "host". The planner says which, and its memory.
    grad_accumulation: str = "auto"
    # Clip grads to this global L2 norm (across ranks) before any subgroup is updated; None: no clipping.
    max_grad_norm: float | None = None
    # fp16 only: the dynamic loss scale to start from and how many good steps double it.
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    # Which tier a subgroup goes to when it leaves the host cache (with 2+ tiers): "learned" (the split
    # that minimises the update phase, from learned read/write bandwidths and what the cache keeps),
    # "eq1" (the MLP-Offload paper's Eq. 1: shares in proportion to min(read, write) bandwidth) or
    # "fixed" (tier_ratios).
    placement: str = "learned"
    # placement="fixed" only: share of subgroups per tier (same length as tiers); None: equal shares.
    tier_ratios: list[float] | None = None
    # Processes of a node that may do I/O on one tier at a time: "exclusive" (one), "shared" (no limit)
    # or a number k. Held with file locks that the kernel drops when a process dies.
    tier_access: str | int = "exclusive"
    # Node-local dir for the tier lock files (a shared file system would make the locks span nodes).
    tier_lock_dir: str = "/dev/shm"
    # Seconds a rank waits for a tier's node lock before step() fails, naming the processes holding it
    # (it says who, once, after a tenth of this).
    tier_lock_timeout_s: float = 1800.0
    # JSON file of measured and learned bandwidths per host and tier: a run starts from the last run's
    # numbers and measures only tiers it lacks (the multipath recipe keeps one in ~/.cache/fsdp-offload).
    # A run also saves its CPU update's rate there, which the planner then predicts from on this host.
    # None: measure every run (2+ tiers only) and write nothing outside the tiers.
    bandwidth_profile: str | None = None
    # GiB per pass of the calibration microbenchmark, when the profile lacks a tier: written (once to
    # allocate), then 3 times each: written, read, and half read while half written; the medians
    # count (calibrate.measure_tier). At most half the tier's free space, and 256 transfers where they
    # are under 8 MiB (a small model's subgroups).
    calibration_gb: float = 1.0

    def __post_init__(self) -> None:
        choices = {"update_order": UPDATE_ORDERS, "param_dtype": PARAM_DTYPES, "kernel": KERNEL_NAMES,
                   "grad_path": GRAD_PATHS, "placement": PLACEMENTS, "overlap": OVERLAPS,
                   "grad_accumulation": GRAD_ACCUMULATIONS}  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"offload.{name}={getattr(self, name)!r}: choose one of {allowed}")
        self.check_types()
        if not (self.split_masters == "auto" or isinstance(self.split_masters, bool)):
            raise ValueError(f"offload.split_masters={self.split_masters!r}: choose 'auto', true or false (True or False in Python)")
        if self.split_masters is True and self.param_dtype != "bfloat16":
            raise ValueError(f"offload.split_masters=true keeps the masters' high halves in bf16 params, but offload.param_dtype="
                             f"{self.param_dtype!r}: use bfloat16, or split_masters='auto'")  # fmt: skip
        self.tiers = list(self.tiers)
        self._tier_specs = parse_tiers(self.tiers)  # a bad spec, or two in one dir, fails here, naming itself
        self.host_budget  # read once here: a bad size fails now, naming the option
        if not self.host_headroom_gb >= 0:
            raise ValueError(f"offload.host_headroom_gb={self.host_headroom_gb} must be >= 0")
        check_subgroup_numel(self.subgroup_numel, "offload.subgroup_numel")
        if not is_whole(self.micro_batches) or self.micro_batches < 1:
            raise ValueError(f"offload.micro_batches={self.micro_batches!r} must be a whole number >= 1 (backward calls per step)")
        if self.grad_accumulation == "gpu" and self.micro_batches == 1:
            raise ValueError(
                "offload.grad_accumulation='gpu' sums several micro-batches' grads, but offload.micro_batches=1: set "
                "micro_batches to the backward calls per step (train.micro_batches with the recipes), or use 'auto'"
            )
        if not is_whole(self.prefetch) or self.prefetch < 0:
            raise ValueError(f"offload.prefetch={self.prefetch!r} must be >= 0, a whole number of subgroups read ahead (e.g. 2)")
        if self.gpu_fraction != "auto" and not (is_number(self.gpu_fraction) and 0.0 <= self.gpu_fraction <= 1.0):
            raise ValueError(f"offload.gpu_fraction={self.gpu_fraction!r} must be a number between 0 and 1, or 'auto'")
        if not self.gpu_headroom_gb >= 0:
            raise ValueError(f"offload.gpu_headroom_gb={self.gpu_headroom_gb} must be >= 0")
        if self.grad_path == "tier_fp32" and not self.tiers:
            raise ValueError("offload.grad_path='tier_fp32' writes grads to a tier: give offload.tiers too")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"offload.max_grad_norm={self.max_grad_norm} must be a positive number, or {NULL} for no clipping")
        if not (self.loss_scale_init > 0 and self.loss_scale_growth_interval >= 1):
            raise ValueError(
                f"offload.loss_scale_init={self.loss_scale_init} must be > 0 and "
                f"offload.loss_scale_growth_interval={self.loss_scale_growth_interval} >= 1"
            )
        if self.overlap == "backward" and self.backward_overlap_conflict() is not None:
            raise ValueError(self.backward_overlap_conflict())
        if self.tier_ratios is not None:
            if self.placement != "fixed":
                raise ValueError(
                    f"offload.tier_ratios={self.tier_ratios} only applies to placement='fixed', not {self.placement!r}: "
                    "drop tier_ratios or set offload.placement='fixed'"
                )
            if len(self.tier_ratios) != len(self.tiers) or any(r < 0 for r in self.tier_ratios) or sum(self.tier_ratios) <= 0:
                raise ValueError(
                    f"offload.tier_ratios={self.tier_ratios}: give one non-negative share per tier "
                    f"({len(self.tiers)} tiers), with a positive sum"
                )
        access_slots(self.tier_access)  # raises naming the option
        if not self.tier_lock_timeout_s > 0:
            raise ValueError(f"offload.tier_lock_timeout_s={self.tier_lock_timeout_s} must be a positive number of seconds")
        if not self.calibration_gb > 0:
            raise ValueError(f"offload.calibration_gb={self.calibration_gb} must be positive (1 measures each tier with 1 GiB)")

    def check_types(self) -> None:
        """Each option is of its kind before any range is checked, so that a string or a null where a
        number belongs is an error naming the option, not a failed comparison."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in ("host_headroom_gb", "gpu_headroom_gb", "loss_scale_init", "tier_lock_timeout_s", "calibration_gb"):
            value = getattr(self, name)
            if not (is_number(value) or (name == "tier_lock_timeout_s" and value == math.inf)):  # inf: wait for ever
                raise ValueError(f"offload.{name}={value!r} must be a number (default {defaults[name]})")
        if not is_whole(self.loss_scale_growth_interval):
            raise ValueError(f"offload.loss_scale_growth_interval={self.loss_scale_growth_interval!r} must be a whole number of steps")
        if self.max_grad_norm is not None and not is_number(self.max_grad_norm):
            raise ValueError(f"offload.max_grad_norm={self.max_grad_norm!r} must be a positive number, or {NULL} for no clipping")
        if isinstance(self.tiers, str) or not isinstance(self.tiers, Sequence) or not all(isinstance(t, str) for t in self.tiers):
            example = f"[{self.tiers}]" if isinstance(self.tiers, str) else "['posix:/local/nvme']"
            raise ValueError(f"offload.tiers={self.tiers!r} must be a list of tier specs, e.g. offload.tiers={example} ([] for none)")
        if self.tier_ratios is not None:
            if isinstance(self.tier_ratios, str) or not isinstance(self.tier_ratios, Iterable):
                raise ValueError(f"offload.tier_ratios={self.tier_ratios!r} must be a list of numbers, one share per tier, or {NULL}")
            self.tier_ratios = list(self.tier_ratios)
            if not all(is_number(r) for r in self.tier_ratios):
                raise ValueError(f"offload.tier_ratios={self.tier_ratios!r} must be a list of numbers, one share per tier, or {NULL}")
        self.tier_lock_dir = path_option(self.tier_lock_dir, "offload.tier_lock_dir")
        self.bandwidth_profile = path_option(self.bandwidth_profile, "offload.bandwidth_profile", null="no profile")

    def backward_overlap_conflict(self) -> str | None:
        """Why overlap="backward" cannot run with these options, as an error message; None if it can."""
        why = (
            "offload.overlap='backward' updates a subgroup as soon as its grads are in, but {what} needs every "
            "grad of the step before any subgroup may be updated: {fix}, or use offload.overlap='next_forward'"
        )
        if self.micro_batches > 1:
            return why.format(what=f"accumulating over micro_batches={self.micro_batches} backwards", fix="use 1")
        if self.max_grad_norm is not None:
            return why.format(what=f"clipping (max_grad_norm={self.max_grad_norm}) scales every grad by a factor of "
                              "the global norm, which", fix=f"set offload.max_grad_norm={NULL}")  # fmt: skip
        if self.param_dtype == "float16":
            return why.format(what="float16's loss scaling skips the whole step if any grad overflowed, which",
                              fix="use offload.param_dtype='bfloat16'")  # fmt: skip
        if self.grad_path == "tier_fp32":
            return why.format(what=f"grad_path={self.grad_path!r} writes every grad to a tier first, which",
                              fix="use offload.grad_path='host_bf16'")  # fmt: skip
        if self.update_order != "forward":
            return (f"offload.overlap='backward' updates the subgroups in memory in the order backward hands in their "
                    f"grads, which update_order={self.update_order!r} would contradict: use offload.update_order='forward'")  # fmt: skip
        return None

    def resolved_overlap(self, hooked: bool = True, model_on_cpu: bool = False) -> str:
        """`overlap` as an optimizer runs it: "auto" made "backward" where the step allows it (one backward
        per step and no option that needs every grad first: see backward_overlap_conflict), else
        "next_forward"; and "none" for a model that trains on the CPU, whose forward and backward need
        the cores the update would take beside them. `hooked`: the optimizer has an FSDP2 model's grad
        hooks, which "backward" starts from (without them "auto" is "next_forward", and "backward" is
        refused)."""
        overlap = self.overlap
        if overlap == "auto" and model_on_cpu:
            overlap = "none"
        elif overlap == "auto":
            overlap = "backward" if hooked and self.backward_overlap_conflict() is None else "next_forward"
        if overlap == "backward" and not hooked:
            raise ValueError(
                "offload.overlap='backward' starts the update from the grad hooks of an FSDP2 model: pass "
                "model=model, or use offload.overlap='next_forward'"
            )
        return overlap

    @property
    def places_by_bandwidth(self) -> bool:
        """Whether the placement is a bandwidth rule, which starts from the tiers' speeds (2+ tiers and
        placement "learned" or "eq1")."""
        return len(self.tiers) >= 2 and self.placement != "fixed"

    @property
    def tier_specs(self) -> tuple[TierSpec, ...]:
        """`tiers`, parsed once (again only if `tiers` was changed since)."""
        if [spec.text for spec in self._tier_specs] != list(self.tiers):
            self._tier_specs = parse_tiers(self.tiers)
        return self._tier_specs

    @property
    def host_budget(self) -> HostBudget:
        """`host_budget_gb`, read: the one reading of it (the planner, train.py and the optimizer size
        "auto" with HostBudget.for_rank)."""
        return HostBudget.read(self.host_budget_gb, self.host_headroom_gb)


@dataclass(frozen=True)
class HostBudget:
    """offload.host_budget_gb read: a size in bytes, no limit, or "auto" (the node's host memory, stated or
    available, less `headroom_gb`, shared by its ranks: `for_rank`)."""

    option: str  # how errors name it: "offload.host_budget_gb=6GiB"
    nbytes: int | None  # a given size; None: no limit, or "auto" before it is sized
    auto: bool
    unit: str  # the unit it was written in (GiB for a number or "auto"): errors answer in it
    headroom_gb: float

    @classmethod
    def read(cls, host_budget_gb: float | str | None, headroom_gb: float) -> HostBudget:
        option = f"offload.host_budget_gb={host_budget_gb}"
        if host_budget_gb is None or host_budget_gb == "auto":
            return cls(option, None, host_budget_gb == "auto", "GiB", headroom_gb)
        try:
            size, unit = parse_size(host_budget_gb)
        except (ValueError, OverflowError):  # (an int past a float's range)
            raise ValueError(
                f"offload.host_budget_gb={host_budget_gb!r}: give GiB (12), a size ('6GiB', '512MiB', "
                f"'8GB'; units {', '.join(SIZE_UNITS)}), 'auto', or {NULL} to keep all state in host memory"
            ) from None
        if not (size >= 0 and math.isfinite(size * SIZE_UNITS[unit])):
            raise ValueError(f"{option} must be a finite size >= 0, or {NULL} to keep all state in host memory")
        return cls(option, int(size * SIZE_UNITS[unit]), False, unit, headroom_gb)

    def for_rank(self, available: int, local_ranks: int) -> int | None:
        """This rank's budget in bytes (None: no limit): "auto" is the node's host memory (`available`
        bytes: stated or available) less the headroom, shared by the node's `local_ranks`."""
        return int((available - self.headroom_gb * GIB) / local_ranks) if self.auto else self.nbytes

    def named(self, nbytes: int | None, how: str = "") -> tuple[int | None, str]:
        """`nbytes` (what for_rank gave, or the least any rank got) with how errors name it; `how` says
        how "auto" came to it. Refuses an "auto" that leaves the optimizer nothing."""
        if not self.auto:
            return nbytes, self.option
        name = f"offload.host_budget_gb=auto ({readable_size(nbytes) if nbytes > 0 else 'nothing'} per rank{how})"
        if nbytes <= 0:  # (the least any rank got: the same on every rank, said once)
            raise JobError(
                f"{name}: no host memory is left for the optimizer; lower offload.host_headroom_gb or give "
                "offload.host_budget_gb in GiB"
            )
        return nbytes, name


def offload_config(offload: OffloadConfig | Mapping | None) -> OffloadConfig:
    """`offload=` as given: an OffloadConfig, a mapping of its options (a Hydra/YAML section), or None."""
    if offload is None:
        return OffloadConfig()
    if isinstance(offload, OffloadConfig):
        return offload
    if isinstance(offload, Mapping):
        return dataclass_from(OffloadConfig, offload, f"offload={dict(offload)!r}")
    raise TypeError(f"offload= takes an OffloadConfig or a dict of its options, not {type(offload).__name__}")


def dataclass_from(cls, raw: Mapping, option: str):
    """Dataclass `cls` from the mapping `raw` of its options; an unknown key is an error naming
    `option` and the known ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"{option}: unknown option(s) {unknown}; known: {sorted(names)}")
    return cls(**raw)


def _tmpdir() -> str:
    """One scratch dir per user and node: every rank's tier files there are unique (and removed when
    its optimizer closes), and one dir keeps node-level exclusive access to the disk under one lock."""
    path = os.path.join(tempfile.gettempdir(), f"fsdp-offload-scratch-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def register_recipe_resolvers() -> None:
    """The recipes' own resolvers: `${tmpdir:}`, the node's scratch dir for this user (see _tmpdir), and
    `${run_stamp:}`, the job's start and launcher as Hydra's run dir names it (node.run_stamp)."""
    from omegaconf import OmegaConf

    from .node import run_stamp

    OmegaConf.register_new_resolver("tmpdir", _tmpdir, replace=True)
    OmegaConf.register_new_resolver("run_stamp", run_stamp, replace=True, use_cache=True)  # one dir a process
