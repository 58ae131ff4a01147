"""What fits where, before anything is built: the planner.

    python -m fsdp_offload.plan model=1b offload=disk                   # this machine
    python -m fsdp_offload.plan model=70b offload=multipath offload.host_budget_gb=auto \\
        machine.ranks_per_node=8 machine.gpu_gib=80 machine.host_gib=1000    # an 8-GPU node

Takes the same Hydra recipes as train.py (an offload recipe: OffloadAdamW's state is what it places),
plus `machine.*` (MachineConfig: this machine unless stated; with train.device=auto, a stated
machine.gpu_gib > 0 is a CUDA run), and says, for each rank: where its FP32 state goes (GPU-resident
subgroups, host cache slots, each tier), the host memory beside it (grad staging, page-locked; the
FP32 grad buffer), the GPU memory (low-precision params, the resident state, start-up and training
estimates), the bytes a step moves through each tier, and the predicted update time; then the largest
preset that fits the same recipe.

The placement is computed by the functions the optimizer runs (the subgroup layout, the host cache's
slots, the tier placement, the steady-state traffic), so it is the placement the run reports. The
update time is a model: the busiest tier's I/O (placement.expected_step_seconds, from the tiers'
bandwidths in the calibration profile, measured when it lacks them, each shared by the node's ranks)
against the CPU update (the fused
kernel timed here on one subgroup, or `machine.cpu_mparams_per_s`), whichever is longer, plus the
first subgroup's read that nothing hides (and grad_path="tier_fp32"'s FP32 grads, written and read
back one at a time). A plan that does not fit raises `PlanError` naming the level that is short and
by how much; train.py runs the same check before it builds the model.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field

import torch
from hydra.errors import HydraException

from .calibrate import TierSpeed
from .config import GIB, OffloadConfig, format_bytes, in_unit, is_number, is_whole
from .grads import TierFP32Grads
from .memory import auto_host_budget, available_host_bytes
from .models import MODEL_PRESETS, LlamaArgs, Transformer, num_params
from .placement import expected_step_seconds, make_placement, placement_measures, steady_traffic, tier_speeds
from .recipe import read_config
from .storage import TierError
from .store import check_gpu_share, gpu_subgroup_bytes, host_cache_slots, last_that_fit, moved_staging_itemsize
from .subgroups import SubgroupLayout
from .threads import cpu_threads_per_rank, use_cpu_threads


class PlanError(ValueError):
    """The state does not fit: the message names the level, the shortfall and what to change."""


@dataclass
class MachineConfig:
    """The machine a plan is for; a None field is read from the machine the planner runs on."""

    ranks_per_node: int = 1
    nodes: int = 1
    gpu_gib: float | None = None  # GPU memory per rank; None: this GPU's (0: no GPU, the CPU trains)
    host_gib: float | None = None  # host memory available to the node's ranks; None: MemAvailable here
    cpu_mparams_per_s: float | None = None  # one rank's CPU update speed; None: the kernel timed here
    gpu_update_gbps: float = 2000.0  # bytes/s the GPU update moves (28 bytes a param), in GB/s

    def __post_init__(self) -> None:
        for name in ("ranks_per_node", "nodes"):
            if not (is_whole(getattr(self, name)) and getattr(self, name) >= 1):
                raise ValueError(f"machine.{name}={getattr(self, name)!r} must be a whole number >= 1")
        for name in ("gpu_gib", "host_gib"):
            value = getattr(self, name)
            if value is not None and not (is_number(value) and value >= 0):
                raise ValueError(f"machine.{name}={value!r} must be a finite number >= 0 (null: this machine's)")
        if self.cpu_mparams_per_s is not None and not (is_number(self.cpu_mparams_per_s) and self.cpu_mparams_per_s > 0):
            raise ValueError(f"machine.cpu_mparams_per_s={self.cpu_mparams_per_s!r} must be a positive number (null: timed here)")
        if not (is_number(self.gpu_update_gbps) and self.gpu_update_gbps > 0):
            raise ValueError(f"machine.gpu_update_gbps={self.gpu_update_gbps!r} must be a positive number of GB/s (default 2000)")

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes


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
    io_s: float | None = None  # busiest tier's I/O per step (None: no tier speeds given)
    grad_io_s: float = 0.0  # grad_path=tier_fp32: the FP32 grads written and read back, one at a time
    cpu_s: float | None = None  # CPU update (None: no CPU speed given)
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

    @property
    def predicted_update_s(self) -> float | None:
        times = [r.update_s for r in self.ranks]
        return None if None in times else max(times)


@dataclass(frozen=True)
class ModelShapes:
    """What the plan needs of the model, read once from a meta-device build."""

    param_shapes: list[torch.Size]  # in model.parameters() order
    largest_module: int  # params of the largest init module (drawn whole in FP32 at start-up)

    @classmethod
    def of(cls, args: LlamaArgs) -> ModelShapes:
        with torch.device("meta"):
            model = Transformer(args)
        return cls([p.shape for p in model.parameters()],
                   max(sum(p.numel() for p in m.parameters()) for _, m in model.init_modules()))  # fmt: skip

    def local_numels(self, world: int, rank: int) -> list[int]:
        """This rank's element count of each param under FSDP2's Shard(0) (torch.chunk's cut of dim 0,
        as parallelize.local_shard takes it; the last ranks possibly empty)."""
        out = []
        for shape in self.param_shapes:
            chunks = torch.chunk(torch.empty(shape, device="meta"), world, dim=0)
            out.append(chunks[rank].numel() if rank < len(chunks) else 0)
        return out


def train_gpu_bytes(args: LlamaArgs, shapes: ModelShapes, local_params: int, seq_len: int, micro_batch: int, itemsize: int) -> int:
    """Estimated GPU peak of a step beside the resident state: the sharded low-precision params, two
    unsharded units (the one running and the one prefetched) with the grads of one, the checkpointed
    block inputs (or every block's activations without checkpointing) and the logits with their FP32
    loss and grad."""
    tokens = seq_len * micro_batch
    per_block = tokens * args.dim * itemsize * (1 if args.activation_checkpointing else 16)
    block_work = tokens * (4 * args.dim + 3 * args.ffn_dim) * itemsize * 2  # one block's forward recomputed in backward
    logits = tokens * args.vocab_size * (itemsize + 4 + 4)
    return local_params * itemsize + 3 * shapes.largest_module * itemsize + args.n_layers * per_block + block_work + logits


def cpu_update_rate(kernel_name: str, subgroup_numel: int, threads: int) -> float:
    """Params per second of one rank's CPU update, timed here: an OffloadAdamW step (grad staging,
    the kernel, the new params written back) over one subgroup's worth of params (at most 64M) held in
    host memory, best of three after a warm-up."""
    from .optimizer import OffloadAdamW

    n = min(subgroup_numel, 64 << 20)
    use_cpu_threads(threads)
    param = torch.nn.Parameter(torch.zeros(n))
    grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    opt = OffloadAdamW([param], lr=1e-4, offload=OffloadConfig(kernel=kernel_name, subgroup_numel=-(-n // 1024) * 1024))
    try:
        best = math.inf
        for step in range(4):
            param.grad = grad
            t0 = time.perf_counter()
            opt.step()
            if step:
                best = min(best, time.perf_counter() - t0)
    finally:
        opt.close()
    return n / best


def nearest_existing(spec_path: str) -> str:
    """`spec_path`, or its nearest parent that exists (a tier dir may be made later)."""
    path = os.path.abspath(os.path.expanduser(spec_path))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def free_bytes(spec_path: str) -> int:
    """Free space of the file system holding `spec_path` (its nearest existing parent)."""
    return shutil.disk_usage(nearest_existing(spec_path)).free


IN_MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")


def file_system(spec_path: str) -> tuple[int, bool]:
    """The file system holding `spec_path` (its nearest existing parent): its device id (tiers on one
    share its free space) and whether it keeps its files in memory (tmpfs, ramfs: host memory)."""
    path = os.path.realpath(nearest_existing(spec_path))
    mount, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, point, fstype = line.split()[:3]
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)  # "\040": a space
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(mount):  # the deepest mount, the last one mounted there
                mount, kind = point, fstype
    return os.stat(path).st_dev, kind in IN_MEMORY_FILE_SYSTEMS


# What mem_get_info counts as used beside torch's own allocations once a run has built its model: the
# CUDA context, cuBLAS's workspace and NCCL's buffers (1.22 GiB on an H100, torch 2.11, after an all-reduce).
CUDA_CONTEXT_BYTES = int(1.25 * GIB)


def plan_rank(
    args: LlamaArgs, shapes: ModelShapes, cfg: OffloadConfig, machine: MachineConfig, rank: int, *, gpu_bytes: int | None,
    host_budget: int | None,
    budget_name: str, speeds: list[TierSpeed] | None, placement_speeds: list[TierSpeed] | None, cpu_rate: float | None,
    seq_len: int, micro_batch: int,
) -> RankPlan:  # fmt: skip
    """One rank's plan (see the module's note); raises PlanError when its host level, or the GPU memory
    its resident state takes, is short."""
    itemsize = 2  # bf16 and fp16 alike
    layout = SubgroupLayout(shapes.local_numels(machine.world_size, rank), cfg.subgroup_numel)
    local = sum(layout.numels)
    startup = local * itemsize + 4 * shapes.largest_module
    train = train_gpu_bytes(args, shapes, local, seq_len, micro_batch, itemsize)
    grads_on_gpu = cfg.grad_path == "gpu_bf16"  # make_plan refuses it without a GPU
    # grad_path="gpu_bf16": every subgroup's staging part is in GPU memory from the start; otherwise
    # only a GPU-resident subgroup's, which goes along with its state
    gpu_staging = itemsize * sum(sg.padded for sg in layout.subgroups) if grads_on_gpu else 0
    moving = moved_staging_itemsize(cfg.grad_path, itemsize)
    if gpu_bytes is None or cfg.gpu_fraction == 0:  # CPU training, or no state on the GPU
        on_gpu = frozenset()
    elif cfg.gpu_fraction == "auto":  # what the run will size after its first step, from the training peak (estimated here)
        room = gpu_bytes - train - gpu_staging - int(cfg.gpu_headroom_gb * GIB)
        count, _ = last_that_fit(layout, list(range(len(layout))), room, moving)
        on_gpu = frozenset(range(len(layout) - count, len(layout)))
    else:  # checked as the optimizer checks it, against the memory free once the model is built
        try:
            on_gpu = check_gpu_share(layout, cfg.gpu_fraction, gpu_bytes - local * itemsize - CUDA_CONTEXT_BYTES)
        except ValueError as exc:
            raise PlanError(
                f"GPU memory, rank {rank}: {exc} (the GPU's {gpu_bytes / GIB:.1f} GiB less the params' "
                f"{local * itemsize / GIB:.1f} GiB and {CUDA_CONTEXT_BYTES / GIB:.2f} GiB of CUDA context and NCCL)"
            ) from None
    gpu_state = gpu_staging + sum(gpu_subgroup_bytes(layout, sg, moving) for sg in on_gpu)
    host_sgs = [sg for sg in range(len(layout)) if sg not in on_gpu]
    if grads_on_gpu:  # the host window that a CPU-updated subgroup's grads and params pass through
        staging = itemsize * max(sg.padded for sg in layout.subgroups) if host_sgs else 0
    else:
        staging = itemsize * sum(layout.subgroups[sg].padded for sg in host_sgs)
    # grad_path="tier_fp32": every subgroup's FP32 grads have a slot in its tier's file, and pass through one buffer
    grad_slots = TierFP32Grads.slot_bytes(layout) if cfg.grad_path == "tier_fp32" else [0] * len(layout)
    fp32_grads = max(grad_slots)
    try:
        slots = host_cache_slots(cfg, host_budget, budget_name, len(host_sgs), layout.slot_bytes, staging + fp32_grads)
    except ValueError as exc:
        raise PlanError(f"host memory, rank {rank}: {exc}") from None
    state_bytes = sum(sg.state_bytes for sg in layout.subgroups)
    plan = RankPlan(
        rank=rank, params=local, subgroups=len(layout), state_bytes=state_bytes, gpu_subgroups=len(on_gpu),
        gpu_state_bytes=gpu_state, cache_slots=slots, cache_bytes=slots * layout.slot_bytes, staging_bytes=staging,
        fp32_grad_bytes=fp32_grads, host_bytes=staging + fp32_grads + slots * layout.slot_bytes,
        gpu_params_bytes=local * itemsize, gpu_startup_bytes=startup + gpu_state, gpu_train_bytes=train + gpu_state,
    )  # fmt: skip
    streamed = len(host_sgs)
    sizes = [layout.subgroups[sg].state_bytes for sg in host_sgs]
    if cfg.tiers and (slots < streamed or fp32_grads):
        placement = make_placement(cfg, layout, slots, streamed, host_sgs, speeds=placement_speeds)
        tiers = [placement.tier_for(sg) for sg in host_sgs]
        placement.close()
        traffic = steady_traffic(streamed, slots, cfg.update_order, host_sgs)
        kinds = len(traffic.orders)
        # A tier holds what is not in host memory, and the prefetch window's reads: the copy of a subgroup
        # that came back into host memory and changed is discarded (SubgroupPipeline._discard_stored).
        at_once = (streamed - slots + cfg.prefetch + 1) * layout.slot_bytes if slots < streamed else 0
        for i, spec in enumerate(cfg.tiers):
            mine = [sg for sg in host_sgs if tiers[sg] == i]
            grads = sum(grad_slots[sg] for sg in mine)  # written before the update, read back for it, every step
            plan.tiers.append(TierPlan(
                spec, len(mine), min(sum(sizes[sg] for sg in mine), at_once) + grads,
                sum(sizes[sg] for k in range(kinds) for sg in traffic.reads[k] if tiers[sg] == i) / kinds + grads,
                sum(sizes[sg] for k in range(kinds) for sg in traffic.writes[k] if tiers[sg] == i) / kinds + grads,
                free_bytes(cfg.tier_specs[i].dir),
            ))  # fmt: skip
        if speeds is not None:
            plan.io_s = expected_step_seconds(tiers, speeds, sizes, traffic)
            first = min(traffic.reads[0], default=None)
            first_read = 0.0 if first is None else speeds[tiers[first]].seconds("read", sizes[first])
            # one subgroup's at a time, each waited for (TierFP32Grads): nothing hides them
            plan.grad_io_s = sum(speeds[tiers[sg]].seconds("write", grad_slots[sg]) + speeds[tiers[sg]].seconds("read", grad_slots[sg])
                                 for sg in host_sgs if grad_slots[sg])  # fmt: skip
    else:  # the host cache holds every subgroup off the GPU: no tier is ever written
        plan.tiers = [TierPlan(spec, 0, 0, 0.0, 0.0, free_bytes(s.dir)) for spec, s in zip(cfg.tiers, cfg.tier_specs)]
        plan.io_s, first_read = 0.0, 0.0
    if cpu_rate is not None:
        plan.cpu_s = sum(layout.subgroups[sg].numel for sg in host_sgs) / cpu_rate
    plan.gpu_s = sum(layout.subgroups[sg].numel for sg in on_gpu) * 28 / (machine.gpu_update_gbps * 1e9)
    if plan.io_s is not None and plan.cpu_s is not None:
        plan.update_s = max(plan.io_s, plan.cpu_s) + first_read + plan.gpu_s + plan.grad_io_s
    return plan


def planned_gpu_bytes(cfg: OffloadConfig, machine: MachineConfig, device_type: str) -> int | None:
    """GPU memory per rank of a run on `device_type` (None: it trains on the CPU); raises ValueError for
    options that need a GPU the run does not have, as the optimizer would."""
    gpu = machine.gpu_gib
    if gpu is None:
        gpu = torch.cuda.mem_get_info()[1] / GIB if device_type == "cuda" and torch.cuda.is_available() else 0.0
    if device_type == "cuda" and gpu == 0:
        raise ValueError("train.device=cuda, but the machine planned for has no GPU: state its memory "
                         "(machine.gpu_gib=80), or plan for train.device=cpu")  # fmt: skip
    if device_type == "cuda":
        return int(gpu * GIB)
    if cfg.gpu_fraction != "auto" and cfg.gpu_fraction > 0:
        raise ValueError(f"offload.gpu_fraction={cfg.gpu_fraction} keeps state on the GPU, but the planned run trains "
                         "on the CPU: use 0, or plan for a GPU (machine.gpu_gib=80, train.device=cuda)")  # fmt: skip
    if cfg.grad_path == "gpu_bf16":
        raise ValueError("offload.grad_path='gpu_bf16' keeps the grads in GPU memory, but the planned run trains on the "
                         "CPU: use offload.grad_path='host_bf16', or plan for a GPU (machine.gpu_gib=80, train.device=cuda)")  # fmt: skip
    return None


def make_plan(model_name: str, args: LlamaArgs, cfg: OffloadConfig, machine: MachineConfig, seq_len: int, micro_batch: int,
              device_type: str, cpu_rate: float | None = None, speeds: list[TierSpeed] | None = None) -> Plan:  # fmt: skip
    """Plans every rank of a node that trains on `device_type` and checks that it fits: the GPU, the
    host (budget or memory), and each file system's free space (shared by the node's ranks and by the
    tiers on it). Raises PlanError naming the level that is short, ValueError for options the target
    cannot run. `cpu_rate` (params/s) and `speeds` (per tier, one rank's) give the predicted update
    time (None: not predicted); where the placement needs speeds and none are given, they are measured
    once (or read from the profile) for every rank's placement."""
    gpu_bytes = planned_gpu_bytes(cfg, machine, device_type)
    host = int(machine.host_gib * GIB) if machine.host_gib is not None else available_host_bytes()
    if cfg.host_budget_gb == "auto":
        host_budget = auto_host_budget(host, cfg.host_headroom_gb, machine.ranks_per_node)
        budget_name = f"offload.host_budget_gb=auto ({host_budget / GIB:.2f} GiB per rank)"
        if host_budget <= 0:
            raise PlanError(f"host memory: {budget_name}: nothing is left after host_headroom_gb={cfg.host_headroom_gb}")
    else:
        host_budget, budget_name = cfg.host_budget_bytes, f"offload.host_budget_gb={cfg.host_budget_gb}"
    if speeds is None and placement_measures(cfg):
        speeds = tier_speeds(cfg)  # once, for every rank's placement
    rank_speeds = speeds
    if speeds is not None and machine.ranks_per_node > 1:
        # The node's ranks all stream through the same tier dirs, at once (shared access) or in turns
        # (exclusive): either way a rank has 1/n of each tier's bandwidth over a step.
        n = machine.ranks_per_node
        rank_speeds = [TierSpeed(s.read_bps / n, s.write_bps / n, s.latency_s) for s in speeds]
    shapes = ModelShapes.of(args)
    ranks = [plan_rank(args, shapes, cfg, machine, r, gpu_bytes=gpu_bytes, host_budget=host_budget,
                       budget_name=budget_name, speeds=rank_speeds, placement_speeds=speeds, cpu_rate=cpu_rate,
                       seq_len=seq_len, micro_batch=micro_batch)
             for r in range(machine.ranks_per_node)]  # fmt: skip
    plan = Plan(model_name, num_params(args), machine.world_size, ranks, None if cpu_rate is None else cpu_rate / 1e6,
                gpu_bytes, host, speeds)  # fmt: skip
    check_fit(plan, cfg, machine)
    return plan


def measured_speeds(cfg: OffloadConfig, machine: MachineConfig, cpu_threads: int | None) -> tuple[float, list[TierSpeed] | None]:
    """The CPU update speed (machine.cpu_mparams_per_s, else timed here) and the tiers' speeds (profile,
    else measured), for a predicted update time."""
    if machine.cpu_mparams_per_s is not None:
        rate = machine.cpu_mparams_per_s * 1e6
    else:
        rate = cpu_update_rate(cfg.kernel, cfg.subgroup_numel, cpu_threads_per_rank(cpu_threads, machine.ranks_per_node))
    return rate, tier_speeds(cfg) if cfg.tiers else None


def check_fit(plan: Plan, cfg: OffloadConfig, machine: MachineConfig) -> None:
    need = [sum(r.tiers[i].bytes for r in plan.ranks) for i in range(len(cfg.tiers))]  # the node's, per tier
    systems = [file_system(spec.dir) for spec in cfg.tier_specs]
    # a tier in memory (tmpfs, ramfs: /dev/shm) keeps its files in host memory, beside the optimizer's
    in_memory = [i for i, (_, mem) in enumerate(systems) if mem and need[i]]
    tier_host = sum(need[i] for i in in_memory)
    # training on the CPU, the model's step (params, grads, activations) is in host memory too
    model_host = sum(r.gpu_train_bytes for r in plan.ranks) if plan.gpu_bytes is None else 0
    node_host = sum(r.host_bytes for r in plan.ranks) + tier_host + model_host
    unit = cfg.host_budget_unit
    if node_host > plan.host_bytes:
        files = (f", {in_unit(tier_host, unit)} of it the files of {' and '.join(cfg.tiers[i] for i in in_memory)} (in "
                 "memory)" if tier_host else "")  # fmt: skip
        model = f", {in_unit(model_host, unit)} of it the model's training step on the CPU" if model_host else ""
        if model_host >= plan.host_bytes:  # no budget or tier makes room for the step itself
            fix = "lower data.micro_batch or data.seq_len, or set model.activation_checkpointing=true"
        else:
            fix = "set offload.host_budget_gb (or 'auto') and a tier" + (", or move the in-memory tier to a disk" if tier_host else "")
        raise PlanError(
            f"host memory: the node's {machine.ranks_per_node} rank(s) keep {in_unit(node_host, unit)} "
            f"({format_bytes(node_host)}{files}{model}) but {in_unit(plan.host_bytes, unit)} is available: short by "
            f"{in_unit(node_host - plan.host_bytes, unit)}; {fix}"
        )
    if plan.gpu_bytes is not None:  # the training step's peak is an estimate: reported, never refused on
        for r in plan.ranks:
            if r.gpu_startup_bytes > plan.gpu_bytes:
                raise PlanError(
                    f"GPU memory, rank {r.rank}: the model and its resident state need {r.gpu_startup_bytes / GIB:.1f} "
                    f"GiB (params {r.gpu_params_bytes / GIB:.1f}, resident state {r.gpu_state_bytes / GIB:.1f}, the "
                    f"largest module drawn in FP32) of {plan.gpu_bytes / GIB:.1f} GiB: short by "
                    f"{(r.gpu_startup_bytes - plan.gpu_bytes) / GIB:.1f} GiB; lower offload.gpu_fraction, or shard "
                    "over more GPUs (machine.ranks_per_node)"
                )
    by_device: dict[int, list[int]] = {}  # tiers on one file system share its free space
    for i, (device, _) in enumerate(systems):
        by_device.setdefault(device, []).append(i)
    for tiers in by_device.values():
        total = sum(need[i] for i in tiers)
        free = plan.ranks[0].tiers[tiers[0]].free_bytes
        if total and free is not None and total > free:
            where = f"tier {cfg.tiers[tiers[0]]}" if len(tiers) == 1 else f"tiers {' and '.join(cfg.tiers[i] for i in tiers)}"
            raise PlanError(
                f"{where}: the node's ranks write up to {total / GIB:.1f} GiB there but its file system has "
                f"{free / GIB:.1f} GiB free: short by {(total - free) / GIB:.1f} GiB; free space, add a tier on "
                "another file system, or raise offload.host_budget_gb or offload.gpu_fraction"
            )


def preset_name(args: LlamaArgs) -> str:
    """The preset of `args`' shape (recipes may change checkpointing or the sequence length), else 'model'."""
    shape = lambda a: (a.dim, a.n_layers, a.n_heads, a.kv_heads, a.vocab_size, a.ffn_dim, a.tie_embeddings)  # noqa: E731
    return next((k for k, v in MODEL_PRESETS.items() if shape(v) == shape(args)), "model")


def largest_fitting(cfg: OffloadConfig, machine: MachineConfig, seq_len: int, micro_batch: int, device_type: str,
                    checkpointing: bool, speeds: list[TierSpeed] | None = None) -> str | None:  # fmt: skip
    """The largest preset whose plan fits with the same recipe and machine (None: not even the smallest),
    trying them by size up to the first that does not fit (every level's need grows with the size).
    `speeds`: the tiers' (None: measured once, where the placement needs them)."""
    if speeds is None and placement_measures(cfg):
        speeds = tier_speeds(cfg)
    best = None
    for name, args in sorted(MODEL_PRESETS.items(), key=lambda kv: num_params(kv[1])):
        args = dataclasses.replace(args, activation_checkpointing=checkpointing)
        try:
            make_plan(name, args, cfg, machine, seq_len, micro_batch, device_type, speeds=speeds)
        except PlanError:
            break
        best = name
    return best


def format_plan(plan: Plan, cfg: OffloadConfig) -> str:
    g = lambda n: f"{n / GIB:.1f}"  # noqa: E731
    # training on the CPU, the model's columns are host memory
    device = "GPU" if plan.gpu_bytes is not None else "model on the CPU"
    memory = f"GPU {g(plan.gpu_bytes)} GiB per rank" if plan.gpu_bytes is not None else "trains on the CPU"
    lines = [
        (f"{plan.model}: {plan.params / 1e9:.3f}B params over {plan.world_size} rank(s); CPU update "
         f"{plan.cpu_mparams_per_s:.0f} M params/s per rank; {memory}, host {g(plan.host_bytes)} GiB for the node"),
        "",
        f"rank  params  subgroups  state GiB | {device}: subgroups GiB  params GiB  start-up~ train~ | host: staging "
        "cache(slots) GiB | " + "".join(f"{t}: subgroups GiB (read/written GiB a step) | " for t in cfg.tiers)
        + "update s (io / cpu)",
    ]
    for r in plan.ranks:
        tiers = " | ".join(f"{t.subgroups} sg {g(t.bytes)} ({g(t.read_bytes_per_step)}/{g(t.written_bytes_per_step)})"
                           for t in r.tiers)  # fmt: skip
        lines.append(
            f"{r.rank:>4}  {r.params / 1e9:.3f}B  {r.subgroups:>9}  {g(r.state_bytes):>9} | {r.gpu_subgroups:>13} "
            f"{g(r.gpu_state_bytes):>4}  {g(r.gpu_params_bytes):>10}  {g(r.gpu_startup_bytes):>9} {g(r.gpu_train_bytes):>6}"
            f" | {g(r.staging_bytes):>13} {g(r.cache_bytes)}({r.cache_slots})"
            + (f" | {tiers}" if tiers else "") + f" | {r.update_s:.2f} ({r.io_s:.2f} / {r.cpu_s:.2f}"
            + (f", + FP32 grads {r.grad_io_s:.2f})" if r.grad_io_s else ")")
        )
    lines.append(f"predicted update phase: {plan.predicted_update_s:.2f} s a step (~: estimates)")
    return "\n".join(lines)


def plan_summary(r: RankPlan, cfg: OffloadConfig) -> str:
    """One rank's placement in a line (train.py logs it before building the model)."""
    tiers = ", ".join(f"{t.subgroups} on {t.spec}" for t in r.tiers)
    return (f"rank {r.rank}: {r.subgroups} subgroups ({r.state_bytes / GIB:.1f} GiB of FP32 state): {r.gpu_subgroups} on the GPU"
            + (" (to be sized after the first step)" if cfg.gpu_fraction == "auto" else "")
            + f", {r.cache_slots} host cache slots" + (f", {tiers}" if tiers else "")
            + f"; host memory {r.host_bytes / GIB:.1f} GiB (staging {r.staging_bytes / GIB:.1f})")  # fmt: skip


def compose_plan_config(overrides: list[str]):
    """The train.py config composed from `overrides` (machine.* ones apart) and the MachineConfig."""
    from hydra import compose, initialize_config_module

    from .config import register_tmpdir_resolver

    register_tmpdir_resolver()
    machine_kw = {}
    rest = []
    names = {f.name for f in dataclasses.fields(MachineConfig)}
    for o in overrides:
        if o.startswith("machine."):
            key, _, value = o[len("machine."):].partition("=")
            if key not in names:
                raise ValueError(f"{o}: unknown machine option; known: {sorted(names)}")
            whole = key in ("ranks_per_node", "nodes")
            try:
                machine_kw[key] = None if value in ("null", "None") else (int(value) if whole else float(value))
            except ValueError:
                raise ValueError(f"machine.{key}={value!r} must be a {'whole number' if whole else 'number'}"
                                 f"{' (null: measured on this machine)' if not whole else ''}, e.g. machine.{key}=8") from None  # fmt: skip
        else:
            rest.append(o)
    with initialize_config_module("fsdp_offload.recipes", version_base="1.3"):
        cfg = compose("train", overrides=rest)
    return cfg, MachineConfig(**machine_kw)


def target_device(train_device: str, machine: MachineConfig) -> str:
    """The device the planned run trains on: train.device, where 'auto' is the stated machine's choice
    (a GPU where machine.gpu_gib > 0, as train.py would find one there), else this machine's."""
    if train_device != "auto":
        return train_device
    if machine.gpu_gib is not None:
        return "cuda" if machine.gpu_gib > 0 else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def plan_from_config(cfg, machine: MachineConfig) -> tuple[Plan, OffloadConfig]:
    """The plan of a composed train.py config (its model, offload, data and train groups)."""
    train, args, data, recipe, _ = read_config(cfg)
    if recipe.optimizer != "offload":
        raise ValueError(
            f"offload.optimizer={recipe.optimizer!r} (offload=none: plain FSDP2 with torch AdamW, its 16 bytes a param "
            "on the device) is not what the planner plans: it places OffloadAdamW's state; choose an offload recipe "
            "(offload=host, disk or multipath)"
        )
    ocfg = recipe.config
    device = target_device(train.device, machine)
    planned_gpu_bytes(ocfg, machine, device)  # a GPU option without a GPU fails before anything is measured
    rate, speeds = measured_speeds(ocfg, machine, train.cpu_threads)
    return make_plan(preset_name(args), args, ocfg, machine, data.seq_len, data.micro_batch, device, rate, speeds), ocfg


def hydra_error_line(exc: HydraException) -> str:
    """Hydra's message on one line: its config search path left out, the options it lists joined."""
    text = str(exc).split("Config search path:")[0].replace(":\n\t", ": ").replace("\n\t", ", ")
    # "To append to your config use +key=value": every option of a group is in its recipe, so the key is misspelt
    lines = [line.strip().rstrip(".") for line in text.splitlines() if line.strip() and not line.startswith("To append")]
    if exc.__cause__ is not None:
        lines.append(f"{str(exc.__cause__).splitlines()[0]}; the options of a group are the keys of its recipe "
                     "(fsdp_offload/recipes/<group>/)")  # fmt: skip
    return "; ".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        cfg, machine = compose_plan_config(argv)
        plan, ocfg = plan_from_config(cfg, machine)
    except PlanError as exc:
        print(f"does not fit: {exc}", file=sys.stderr)
        return 2
    except HydraException as exc:  # a recipe or an option that is not there, an override that does not parse
        print(f"error: {hydra_error_line(exc)}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, TierError) as exc:  # a bad option, or a tier dir that is not there
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan, ocfg))
    device = "cuda" if plan.gpu_bytes else "cpu"
    best = largest_fitting(ocfg, machine, cfg.data.seq_len, cfg.data.micro_batch, device, cfg.model.activation_checkpointing,
                           plan.tier_speeds)  # fmt: skip
    print(f"largest preset that fits this recipe and machine: {best or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
