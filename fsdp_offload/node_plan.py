"""What fits where, before anything is built: the plan of a node's ranks (see fsdp_offload.plan's note).

The placement is computed by the functions the optimizer runs (the subgroup layout, the host cache's
slots, the tier placement, the steady-state traffic), so it is the placement the run reports. The
update time is a model: the busiest tier's I/O (bandwidth.expected_step_seconds, from the tiers'
speeds, each shared by the node's ranks) against the update thread's work, whichever is longer: the CPU
kernel (params / rate) and, beside it, a fixed cost per subgroup and per tier read or write
(update_costs); plus the grad norm once a step, the first subgroup's read that nothing hides (and
grad_path="tier_fp32"'s FP32 grads, written and read back one at a time). A plan that does not fit
raises `PlanError` naming the level that is short and by how much; train.py runs the same check before
it builds the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .bandwidth import expected_step_seconds, spills, steady_traffic
from .cache import host_cache_slots, resolve_split_masters
from .calibrate import TierSpeed
from .config import OffloadConfig
from .grads import TierFP32Grads
from .machine import CUDA_CONTEXT_BYTES, MachineConfig, planned_gpu_bytes, planned_host_bytes, tier_room_subgroups
from .models import LlamaArgs, Transformer, num_params
from .models.llama import STEP_CHOICES
from .placement import planned_split
from .plan_fit import check_fit
from .plans import Plan, PlanError, RankPlan, TierPlan
from .gpu_share import gpu_subgroup_bytes, moved_staging_itemsize, planned_share
from .grad_sums import grad_accumulation_memory, resolve_grad_accumulation
from .host_windows import windows_bytes
from .staging import resolve_grad_path
from .subgroups import SubgroupLayout
from .tier_speeds import starting_speeds
from .units import GIB
from .update_costs import UpdateCosts


@dataclass(frozen=True)
class ModelShapes:
    """What the plan needs of the model, read once from a meta-device build."""

    param_shapes: list[torch.Size]  # in model.parameters() order
    largest_module: int  # params of the largest init module (drawn whole in FP32 at start-up)

    @classmethod
    def of(cls, args: LlamaArgs) -> ModelShapes:
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(args, activation_checkpointing=False, reshard_after_forward=True, sum_grads_unsharded=False))  # the shapes alone
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
    unsharded units (the one running and the one prefetched; every unit where they are not resharded
    after forward) with the grads of one, the checkpointed block inputs (or every block's activations
    without checkpointing), the logits with their FP32 loss and grad, and the unsharded FP32 grad sums
    where the step keeps them."""
    tokens = seq_len * micro_batch
    # unchecked, a block keeps ~12 dim- and 4 ffn-wide values a token (the 1.35B: 4.1 GiB more, as measured in session 26)
    per_block = tokens * itemsize * (args.dim if args.activation_checkpointing else 12 * args.dim + 4 * args.ffn_dim)
    block_work = tokens * (4 * args.dim + 3 * args.ffn_dim) * itemsize * 2  # one block's forward recomputed in backward
    logits = tokens * args.vocab_size * (itemsize + 4 + 4)
    # gathered params: two units at a time, or every unit from its forward to its backward (not resharded)
    gathered = 2 * shapes.largest_module if args.reshard_after_forward else sum(math.prod(s) for s in shapes.param_shapes)
    # the micro-batches' grads summed unsharded in FP32, every unit's from the first backward to the last, and the
    # FP32 reduce-scatter input of the unit reducing them
    summed = sum(math.prod(s) for s in shapes.param_shapes) + shapes.largest_module
    sums = 4 * summed if args.sum_grads_unsharded is True else 0
    return local_params * itemsize + (gathered + shapes.largest_module) * itemsize + args.n_layers * per_block + block_work + logits + sums


def optimizer_config(cfg: OffloadConfig, args: LlamaArgs) -> OffloadConfig:
    """The optimizer's config for a step resolved as `args`: where FSDP2 sums the micro-batches unsharded
    (`model.sum_grads_unsharded`), the optimizer takes one grad a step, as from one micro-batch."""
    return dataclasses.replace(cfg, micro_batches=1) if args.sum_grads_unsharded is True else cfg


def plan_rank(args: LlamaArgs, shapes: ModelShapes, cfg: OffloadConfig, machine: MachineConfig, rank: int, **kw) -> RankPlan:
    """One rank's plan (see the module's note); raises PlanError when its host level, or the GPU memory
    its resident state takes, is short. grad_path="auto" is planned with the grads in host memory, and
    again with them on the GPU where staging.resolve_grad_path says that saves tier bytes: the host
    plan spills (or its staging leaves the budget short), and the GPU plan keeps more subgroups in host
    memory (or alone fits) with its estimated peak in the GPU's room."""
    if cfg.grad_path != "auto":
        return _plan_rank(args, shapes, cfg, machine, rank, grad_path=cfg.grad_path, **kw)
    try:
        host, short = _plan_rank(args, shapes, cfg, machine, rank, grad_path="host_bf16", **kw), None
    except PlanError as exc:  # the budget may hold the cache's minimum once the grads are off it
        host, short = None, exc
    gpu_bytes = kw["gpu_bytes"]
    if gpu_bytes is not None:  # the GPU plan beside it, and staging.resolve_grad_path picks one of the two
        try:
            gpu = _plan_rank(args, shapes, cfg, machine, rank, grad_path="gpu_bf16", **kw)
        except PlanError:
            gpu = None
        spills_ = host is not None and bool(cfg.tiers) and spills(host.cache_slots, host.subgroups - host.gpu_subgroups)
        # where the host plan fits, only if this keeps more in host memory (the grads' room on the GPU
        # may move the sums off it, whose host buffers then take more than the grads gave back)
        better = gpu is not None and (short is not None or gpu.cache_slots > host.cache_slots)
        if better and resolve_grad_path("auto", "cuda", cfg.gpu_fraction != "auto", spills_, short is not None,
                                        gpu_bytes - int(cfg.gpu_headroom_gb * GIB), gpu.gpu_train_bytes) == "gpu_bf16":  # fmt: skip
            return gpu
    if short is not None:
        raise short
    return host


def _plan_rank(
    args: LlamaArgs, shapes: ModelShapes, cfg: OffloadConfig, machine: MachineConfig, rank: int, *, grad_path: str,
    world_size: int, gpu_bytes: int | None, host_budget: int | None,
    budget_name: str, speeds: list[TierSpeed] | None, placement_speeds: list[TierSpeed] | None, cpu_rate: float | None,
    split_cpu_rate: float | None, seq_len: int, micro_batch: int, costs: UpdateCosts,
) -> RankPlan:  # fmt: skip
    """One rank's plan with the low-precision grads at `grad_path` (resolved); its kernel at `split_cpu_rate`
    where it splits the masters and that rate is known, else at `cpu_rate` (make_plan says which)."""
    itemsize = 2  # bf16 and fp16 alike
    layout = SubgroupLayout(shapes.local_numels(world_size, rank), cfg.subgroup_numel)  # whole, until the cache is sized
    local = sum(layout.numels)
    startup = local * itemsize + 4 * shapes.largest_module
    train = train_gpu_bytes(args, shapes, local, seq_len, micro_batch, itemsize)
    grads_on_gpu = grad_path == "gpu_bf16"  # make_plan refuses it without a GPU
    # gpu_bf16: every subgroup's staging part on the GPU from the start; else only a GPU-resident subgroup's, with its state
    gpu_staging = itemsize * sum(sg.padded for sg in layout.subgroups) if grads_on_gpu else 0
    moving = moved_staging_itemsize(grad_path, itemsize)
    # Where several micro-batches' grads are summed comes first: on the GPU (where the step leaves room
    # for them) they cost nothing on backward's path; the GPU's share of the state takes what is left.
    sums_on_gpu_need = grad_accumulation_memory(layout, "gpu", cfg.micro_batches, list(range(len(layout))))[0]
    room = None if gpu_bytes is None else gpu_bytes - train - gpu_staging - int(cfg.gpu_headroom_gb * GIB)
    try:
        accumulation = resolve_grad_accumulation(cfg.grad_accumulation, cfg.micro_batches, "cpu" if gpu_bytes is None else "cuda",
                                                 room, sums_on_gpu_need)  # fmt: skip
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    # "auto" is placed at start-up (train.py hands the count in), beside the training peak estimated here and
    # the sums on the GPU; with the sums on the host, a GPU-resident subgroup's own FP32 sums live beside its state
    auto_room = None if room is None else room - (sums_on_gpu_need if accumulation == "gpu" else 0)
    beside = 4 if accumulation == "host" and cfg.micro_batches > 1 else 0
    free = None if gpu_bytes is None else gpu_bytes - local * itemsize - CUDA_CONTEXT_BYTES  # a fixed fraction's check, as the optimizer's
    try:
        on_gpu = planned_share(cfg.gpu_fraction, layout, free, auto_room, moving + beside)
    except ValueError as exc:
        raise PlanError(
            f"GPU memory, rank {rank}: {exc} (the GPU's {gpu_bytes / GIB:.1f} GiB less the params' "
            f"{local * itemsize / GIB:.1f} GiB and {CUDA_CONTEXT_BYTES / GIB:.2f} GiB of CUDA context and NCCL)"
        ) from None
    gpu_state = gpu_staging + sum(gpu_subgroup_bytes(layout, sg, moving) for sg in on_gpu)
    host_sgs = [sg for sg in range(len(layout)) if sg not in on_gpu]
    # grad_path="tier_fp32": every subgroup's FP32 grads have a slot in its tier's file, and pass through one buffer
    grad_slots = TierFP32Grads.slot_bytes(layout) if grad_path == "tier_fp32" else [0] * len(layout)
    fp32_grads = max(grad_slots)
    sums_gpu, sums_host = grad_accumulation_memory(layout, accumulation, cfg.micro_batches, host_sgs)
    host_grads = itemsize * sum(layout.subgroups[sg].padded for sg in host_sgs)
    try:  # split masters where the cache holds fewer subgroups whole (as levels.build_levels decides it)
        whole = host_cache_slots(host_budget, budget_name, cfg.host_budget.unit, len(host_sgs), layout.slot_bytes,
                                 host_grads + fp32_grads + sums_host, cfg.prefetch, len(cfg.tiers))  # fmt: skip
    except ValueError:
        whole = None
    layout = layout.with_split(resolve_split_masters(cfg.split_masters, cfg.param_dtype, whole, len(host_sgs), layout.split_saves))
    # grad_path="gpu_bf16": the two host windows that CPU-updated subgroups' grads and params pass through
    staging = (windows_bytes(layout, itemsize) if host_sgs else 0) if grads_on_gpu else host_grads
    if layout.split_masters and gpu_bytes is not None and host_sgs:  # and the two the model's params come down through
        staging += windows_bytes(layout, itemsize)
    try:
        slots = host_cache_slots(host_budget, budget_name, cfg.host_budget.unit, len(host_sgs), layout.slot_bytes,
                                 staging + fp32_grads + sums_host, cfg.prefetch, len(cfg.tiers))  # fmt: skip
    except ValueError as exc:
        raise PlanError(f"host memory, rank {rank}: {exc}") from None
    state_bytes = sum(sg.state_bytes for sg in layout.subgroups)
    plan = RankPlan(
        rank=rank, params=local, subgroups=len(layout), state_bytes=state_bytes, gpu_subgroups=len(on_gpu),
        gpu_state_bytes=gpu_state, cache_slots=slots, cache_bytes=slots * layout.slot_bytes, staging_bytes=staging,
        fp32_grad_bytes=fp32_grads, host_bytes=staging + fp32_grads + sums_host + slots * layout.slot_bytes,
        gpu_params_bytes=local * itemsize, gpu_startup_bytes=startup + gpu_state, gpu_train_bytes=train + gpu_state + sums_gpu,
        grad_accumulation=accumulation, grad_path=grad_path, grad_sums_gpu_bytes=sums_gpu, grad_sums_host_bytes=sums_host,
        split_masters=layout.split_masters, host_budget_bytes=host_budget, budget_name=budget_name,
    )  # fmt: skip
    streamed, transfers = len(host_sgs), 0.0
    sizes = [layout.subgroups[sg].stored_bytes for sg in host_sgs]
    if cfg.tiers and (spills(slots, streamed) or fp32_grads):
        traffic = steady_traffic(streamed, slots, cfg.update_order, host_sgs)
        room = tier_room_subgroups(machine, list(cfg.tier_specs), machine.ranks_per_node, layout.slot_bytes)
        tier_of = planned_split(cfg, sizes, traffic, placement_speeds, room)  # (host_sgs: the first `streamed`)
        kinds = len(traffic.orders)
        transfers = sum(len(r) + len(w) for r, w in zip(traffic.reads, traffic.writes)) / kinds  # a step's, on average
        # A tier holds what is not in host memory, and the prefetch window's reads: the copy of a subgroup
        # that came back into host memory and changed is discarded (SubgroupPipeline._discard_stored).
        at_once = (streamed - slots + cfg.prefetch + 1) * layout.slot_bytes if spills(slots, streamed) else 0
        for i, spec in enumerate(cfg.tiers):
            mine = [sg for sg in host_sgs if tier_of[sg] == i]
            grads = sum(grad_slots[sg] for sg in mine)  # written before the update, read back for it, every step
            plan.tiers.append(TierPlan(
                spec, len(mine), min(sum(sizes[sg] for sg in mine), at_once) + grads,
                sum(sizes[sg] for k in range(kinds) for sg in traffic.reads[k] if tier_of[sg] == i) / kinds + grads,
                sum(sizes[sg] for k in range(kinds) for sg in traffic.writes[k] if tier_of[sg] == i) / kinds + grads,
                machine.tier_free_bytes(i, cfg.tier_specs[i].dir),
            ))  # fmt: skip
        if speeds is not None:
            plan.io_s = expected_step_seconds(tier_of, speeds, sizes, traffic)
            first = min(traffic.reads[0], default=None)
            first_read = 0.0 if first is None else speeds[tier_of[first]].seconds("read", sizes[first])
            # one subgroup's at a time, each waited for (TierFP32Grads): nothing hides them
            plan.grad_io_s = sum(speeds[tier_of[sg]].seconds("write", grad_slots[sg]) + speeds[tier_of[sg]].seconds("read", grad_slots[sg])
                                 for sg in host_sgs if grad_slots[sg])  # fmt: skip
    else:  # the host cache holds every subgroup off the GPU: no tier is ever written
        plan.tiers = [TierPlan(spec, 0, 0, 0.0, 0.0, machine.tier_free_bytes(i, s.dir)) for i, (spec, s) in enumerate(zip(cfg.tiers, cfg.tier_specs))]
        plan.io_s, first_read = 0.0, 0.0
    rate = split_cpu_rate if layout.split_masters and split_cpu_rate is not None else cpu_rate
    if rate is not None:
        plan.cpu_s = sum(layout.subgroups[sg].numel for sg in host_sgs) / rate
    plan.walk_s, plan.step_s = costs.walk_seconds(streamed, transfers), costs.step_s
    plan.gpu_s = sum(layout.subgroups[sg].numel for sg in on_gpu) * 28 / (machine.gpu_update_gbps * 1e9)
    if plan.io_s is not None and plan.cpu_s is not None:  # the kernel and the walk are one thread's, the I/O the tiers'
        plan.update_s = plan.step_s + max(plan.io_s, plan.cpu_s + plan.walk_s) + first_read + plan.gpu_s + plan.grad_io_s
    return plan


def plan_speeds(cfg: OffloadConfig, given: list[TierSpeed] | None) -> list[TierSpeed] | None:
    """The tiers' speeds a plan uses (starting_speeds decides): `given` (they predict the update), else the profile's or measured."""
    return starting_speeds(cfg, given=given, needed=given is not None or cfg.places_by_bandwidth).speeds


def make_plan(model_name: str, args: LlamaArgs, cfg: OffloadConfig, machine: MachineConfig, seq_len: int, micro_batch: int,
              device_type: str, cpu_rate: float | None = None, speeds: list[TierSpeed] | None = None,
              host_budget: tuple[int | None, str] | None = None, costs: UpdateCosts | None = None,
              node_ranks: Sequence[int] | None = None, world_size: int | None = None,
              split_cpu_rate: float | None = None) -> Plan:  # fmt: skip
    """Plans every rank of a node that trains on `device_type` and checks that it fits: the GPU, the host
    (budget or memory), and each file system's free space (shared by the node's ranks and by the tiers on
    it). Raises PlanError naming the level that is short, ValueError for options the target cannot run.
    `cpu_rate` (params/s) and `speeds` (per tier, the node's) give the predicted update time (None: not
    predicted), `split_cpu_rate` the kernel's on split masters (None: at `cpu_rate`, which the plan says),
    `costs` its fixed costs (None: none); where the placement needs speeds and none are given,
    plan_speeds gets them once for every rank's placement. `args` checkpoint, reshard and sum the grads
    unsharded or not ('auto': step_memory.plan_step_memory; with the sums the optimizer is planned for one
    grad a step, `optimizer_config`). `node_ranks`: the node's ranks in the job of `world_size` ranks, each
    planned for its own shard (None: the first node's of machine.world_size; nodes may hold unlike counts)."""
    world, node = world_size or machine.world_size, list(range(machine.ranks_per_node) if node_ranks is None else node_ranks)
    if len(node) != machine.ranks_per_node or not all(0 <= r < world for r in node):
        raise ValueError(f"node_ranks={node} must be machine.ranks_per_node={machine.ranks_per_node} ranks of the job's {world}")
    for name in STEP_CHOICES:
        if getattr(args, name) == "auto":  # planned every way there
            raise ValueError(f"model.{name}='auto' is planned by fsdp_offload.step_memory.plan_step_memory")
    cfg = optimizer_config(cfg, args)
    gpu_bytes = planned_gpu_bytes(cfg, machine, device_type)
    host = planned_host_bytes(machine)
    if host_budget is not None:  # measured on the node (train.py: memory.resolve_host_budget), in bytes and named
        host_budget, budget_name = host_budget
    else:  # this machine's, as planned
        budget = cfg.host_budget
        try:
            host_budget, budget_name = budget.named(budget.for_rank(host, machine.ranks_per_node))
        except ValueError as exc:
            raise PlanError(f"host memory: {exc}") from None
    speeds = plan_speeds(cfg, speeds)  # once, for every rank's placement
    rank_speeds = speeds
    if speeds is not None and machine.ranks_per_node > 1:
        # The node's ranks all stream through the same tier dirs, at once (shared access) or in turns
        # (exclusive): either way a rank has 1/n of each tier's bandwidth over a step.
        n = machine.ranks_per_node
        rank_speeds = [TierSpeed(s.read_bps / n, s.write_bps / n, s.latency_s) for s in speeds]
    shapes = ModelShapes.of(args)
    ranks = [plan_rank(args, shapes, cfg, machine, r, world_size=world, gpu_bytes=gpu_bytes, host_budget=host_budget,
                       budget_name=budget_name, speeds=rank_speeds, placement_speeds=speeds, cpu_rate=cpu_rate,
                       split_cpu_rate=split_cpu_rate, seq_len=seq_len, micro_batch=micro_batch, costs=costs or UpdateCosts())
             for r in node]  # fmt: skip
    plan = Plan(model_name, num_params(args), world, ranks, None if cpu_rate is None else cpu_rate / 1e6,
                gpu_bytes, host, speeds, update_costs=costs, activation_checkpointing=args.activation_checkpointing,
                reshard_after_forward=args.reshard_after_forward, sum_grads_unsharded=args.sum_grads_unsharded,
                split_cpu_mparams_per_s=None if split_cpu_rate is None else split_cpu_rate / 1e6)  # fmt: skip
    check_fit(plan, cfg, machine)
    return plan
