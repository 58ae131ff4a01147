"""Whether a node's plan fits, level by level (the host memory, the GPU, each file system's free
space), and the error that names the level that is short, by how much, and the fix."""

from __future__ import annotations

from .config import OffloadConfig
from .machine import MachineConfig
from .models import LlamaArgs
from .plans import Plan, PlanError
from .units import in_unit, readable_size


def check_fit(plan: Plan, cfg: OffloadConfig, machine: MachineConfig) -> None:
    need = [sum(r.tiers[i].bytes for r in plan.ranks) for i in range(len(cfg.tiers))]  # the node's, per tier
    systems = [machine.tier_file_system(i, spec.dir) for i, spec in enumerate(cfg.tier_specs)]
    # a tier in memory (tmpfs, ramfs: /dev/shm) keeps its files in host memory, beside the optimizer's
    in_memory = [i for i, (_, mem) in enumerate(systems) if mem and need[i]]
    tier_host = sum(need[i] for i in in_memory)
    # training on the CPU, the model's step (params, grads, activations) is in host memory too
    model_host = sum(r.gpu_train_bytes for r in plan.ranks) if plan.gpu_bytes is None else 0
    node_host = sum(r.host_bytes for r in plan.ranks) + tier_host + model_host
    unit = cfg.host_budget.unit
    if node_host > plan.host_bytes:
        files = (f", {in_unit(tier_host, unit)} of it the files of {' and '.join(cfg.tiers[i] for i in in_memory)} (in "
                 "memory)" if tier_host else "")  # fmt: skip
        model = f", {in_unit(model_host, unit)} of it the model's training step on the CPU" if model_host else ""
        checkpointing = f", or {frugal_step_fix(plan)}" if frugal_step_fix(plan) and model_host else ""
        if model_host >= plan.host_bytes:  # no budget or tier makes room for the step itself
            fix = "lower data.micro_batch or data.seq_len" + checkpointing
        else:  # a stated budget the node's ranks cannot all take is lowered; no budget or "auto" needs one and a tier
            budget = "lower offload.host_budget_gb" if cfg.host_budget.nbytes else "set offload.host_budget_gb (or 'auto') and a tier"
            fix = budget + (", or move the in-memory tier to a disk" if tier_host else "") + checkpointing
        # the node's memory is stated by train.host_memory_gb (the plan command: machine.host_gib), else read here
        stated = machine.host_gib is not None
        grows = "" if stated else " (where memory is added as it is used, state the node's: train.host_memory_gb)"
        raise PlanError(
            f"host memory: the node's {machine.ranks_per_node} rank(s) keep {in_unit(node_host, unit)} "
            f"({int(node_host)} bytes{files}{model}) but {in_unit(plan.host_bytes, unit)} is "
            f"{'stated (train.host_memory_gb; the plan command: machine.host_gib)' if stated else 'available'}: short by "
            f"{in_unit(node_host - plan.host_bytes, unit)}; {fix}{grows}"
        )
    if plan.gpu_bytes is not None:  # the training step's peak is an estimate: reported, never refused on
        for r in plan.ranks:
            if r.gpu_startup_bytes > plan.gpu_bytes:
                raise PlanError(
                    f"GPU memory, rank {r.rank}: the model and its resident state need {readable_size(r.gpu_startup_bytes)} "
                    f"(params {readable_size(r.gpu_params_bytes)}, resident state {readable_size(r.gpu_state_bytes)}, the "
                    f"largest module drawn in FP32) of {readable_size(plan.gpu_bytes)}: short by "
                    f"{readable_size(r.gpu_startup_bytes - plan.gpu_bytes)}; lower offload.gpu_fraction, or shard "
                    "over more GPUs (machine.ranks_per_node)"
                )
    by_device: dict[int, list[int]] = {}  # tiers on one file system share its free space
    for i, (device, _) in enumerate(systems):
        by_device.setdefault(device, []).append(i)
    for same_fs in by_device.values():
        total = sum(need[i] for i in same_fs)
        free = plan.ranks[0].tiers[same_fs[0]].free_bytes
        if total and free is not None and total > free:
            where = f"tier {cfg.tiers[same_fs[0]]}" if len(same_fs) == 1 else f"tiers {' and '.join(cfg.tiers[i] for i in same_fs)}"
            # only the levels there are and that are not already as large as the machine allows
            raise_ = [o for o, can in (("offload.host_budget_gb", not cfg.host_budget.auto),
                                       ("offload.gpu_fraction", plan.gpu_bytes is not None and cfg.gpu_fraction != "auto")) if can]  # fmt: skip
            fixes = ["free space", "add a tier on another file system",
                     f"raise {' or '.join(raise_)} (or 'auto')" if raise_ else "train a smaller model or on more GPUs"]  # fmt: skip
            raise PlanError(
                f"{where}: the node's ranks write up to {readable_size(total)} there but its file system has "
                f"{readable_size(free)} free: short by {readable_size(total - free)}; {', '.join(fixes[:-1])}, or {fixes[-1]}"
            )


def frugal_step_fix(plan: Plan | LlamaArgs) -> str:
    """Where a plan (or the args it is made from) keeps a step's activations, gathered units or unsharded
    grad sums on its device as stated, the options that let the entry keep them only where they fit ("":
    it keeps none)."""
    kept = [f"model.{name}" for name, frugal in (("activation_checkpointing", plan.activation_checkpointing),
                                                ("reshard_after_forward", plan.reshard_after_forward),
                                                ("sum_grads_unsharded", plan.sum_grads_unsharded is not True)) if not frugal]  # fmt: skip
    return f"set {' and '.join(kept)} to auto" if kept else ""

