"""A node's plan as data: each rank's (its FP32 state on each level, the host and GPU memory beside it,
the bytes a step moves through each tier, the predicted update) and the node's; and the error of a plan
that does not fit. node_plan.py makes them, plan_fit.py checks them, plan.py says them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .calibrate import TierSpeed
from .config import OffloadConfig
from .gpu_share import handed_count
from .job_errors import JobError
from .levels import MemoryPlan
from .update_costs import UpdateCosts


class PlanError(JobError):
    """The state does not fit: names the level, the shortfall and the fix; said once a job (every rank plans the node alike)."""


@dataclass
class TierPlan:
    spec: str
    subgroups: int  # subgroups the placement puts here
    bytes: int  # the file space this rank needs on the tier at most (state not in host memory, FP32 grads)
    read_bytes_per_step: float
    written_bytes_per_step: float
    free_bytes: int | None  # free space of the tier's file system (None: not found here)


@dataclass
class RankPlan:
    rank: int
    params: int  # local (this rank's shard)
    subgroups: int
    state_bytes: int  # FP32 masters + moments, all levels
    gpu_subgroups: int
    gpu_state_bytes: int  # FP32 state in GPU memory, with its staging (and every subgroup's, grad_path=gpu_bf16)
    cache_slots: int
    cache_bytes: int
    staging_bytes: int  # low-precision grad/param staging in host memory (page-locked on GPU machines)
    fp32_grad_bytes: int  # grad_path=tier_fp32's buffer
    host_bytes: int  # all the optimizer keeps in host memory
    tiers: list[TierPlan] = field(default_factory=list)
    gpu_params_bytes: int = 0  # the model's low-precision params, this rank's shard
    gpu_startup_bytes: int = 0  # estimated GPU peak while the model is built (streamed start-up)
    gpu_train_bytes: int = 0  # estimated GPU peak of a training step
    grad_accumulation: str = "host"  # where the FP32 sums of several micro-batches live ("gpu" | "host")
    grad_path: str = "host_bf16"  # where the low-precision grads wait for their update (resolved)
    grad_sums_gpu_bytes: int = 0  # those sums in GPU memory (in gpu_train_bytes)
    grad_sums_host_bytes: int = 0  # those sums and their landing buffer in host memory (in host_bytes)
    split_masters: bool = False  # subgroups off the GPU held split (10 bytes a param, not 12)
    host_budget_bytes: int | None = None  # the budget it was planned under (None: no limit)
    budget_name: str = ""  # how errors name that budget

    def memory_plan(self, cfg: OffloadConfig) -> MemoryPlan:
        """What this rank's optimizer builds: the plan's host budget, grad sums, grad path and, for
        gpu_fraction="auto", GPU share (a fixed fraction is checked again against the GPU's free memory)."""
        return MemoryPlan(self.host_budget_bytes, self.budget_name, self.grad_accumulation,
                          handed_count(cfg.gpu_fraction, self.gpu_subgroups), self.grad_path, self.split_masters)  # fmt: skip
    io_s: float | None = None  # busiest tier's I/O per step (None: no tier speeds given)
    grad_io_s: float = 0.0  # grad_path=tier_fp32: the FP32 grads written and read back, one at a time
    cpu_s: float | None = None  # CPU kernel: params / rate (None: no CPU speed given)
    walk_s: float = 0.0  # the update thread's beside the kernel: each subgroup's, each tier read's and write's
    step_s: float = 0.0  # once a step: the grad norm and its all-reduce
    gpu_s: float = 0.0  # GPU update of the resident subgroups
    update_s: float | None = None  # predicted update phase (None: not predicted)


@dataclass
class Plan:
    model: str
    params: int
    world_size: int
    ranks: list[RankPlan]
    cpu_mparams_per_s: float | None
    gpu_bytes: int | None
    host_bytes: int
    tier_speeds: list[TierSpeed] | None = None  # each tier's, as measured or profiled: the node's ranks share them (None: not needed)
    cpu_rate_source: str | None = None  # where cpu_mparams_per_s came from: "given", "learned" or "timed" (learned_rate.CpuRate)
    cpu_rate_detail: str = ""  # learned_rate.CpuRate.detail
    update_costs: UpdateCosts | None = None  # the fixed costs in the prediction (None: none, as for a stated CPU rate)
    activation_checkpointing: bool = False  # the model's, as planned
    reshard_after_forward: bool = True  # the model's, as planned
    sum_grads_unsharded: bool = False  # the model's, as planned (the optimizer then planned for one grad a step)
    step_memory_why: str = ""  # why the three above (step_memory.plan_step_memory)
    split_cpu_mparams_per_s: float | None = None  # the kernel's on split masters (None: those ranks at cpu_mparams_per_s)
    split_cpu_rate_source: str | None = None  # where it came from, as cpu_rate_source
    split_cpu_rate_detail: str = ""  # as cpu_rate_detail

    @property
    def splits(self) -> bool:
        """Whether any rank holds its masters split off the GPU (its kernel: the split step's)."""
        return any(r.split_masters for r in self.ranks)

    @property
    def predicted_update_s(self) -> float | None:
        times = [r.update_s for r in self.ranks]
        return None if None in times else max(times)
