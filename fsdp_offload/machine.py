"""The machine a plan is for: what it is stated to be (MachineConfig), and what is read or timed on the
machine the planner runs on where it is not stated: GPU memory, host memory (MemAvailable, or less
where this process's memory cgroup allows less: memory.available_host_bytes), each tier's file system
(free space, whether it keeps its files in memory), the CPU update's speed and the tiers' speeds.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

import torch

from .calibrate import TierSpeed
from .config import OffloadConfig, is_number, is_whole
from .gpu_share import needs_gpu
from .job_errors import JobError
from .learned_rate import CpuRate, learned_rate_for, unlearned_note
from .memory import node_host_bytes
from .threads import cpu_threads_per_rank
from .tier_speeds import starting_speeds
from .units import GIB
from .update_rate import node_update_rate, timed_beside_load


@dataclass
class MachineConfig:
    """The machine a plan is for; a None field is read from the machine the planner runs on."""

    ranks_per_node: int = 1
    nodes: int = 1
    gpu_gib: float | None = None  # GPU memory per rank; None: this GPU's (0: no GPU, the CPU trains)
    host_gib: float | None = None  # host memory available to the node's ranks; None: MemAvailable here
    cpu_mparams_per_s: float | None = None  # one rank's CPU update speed; None: learned here by an earlier run, else timed here
    gpu_update_gbps: float = 2000.0  # bytes/s the GPU update moves (28 bytes a param), in GB/s
    # The planned machine's tiers, one entry per offload.tiers (None: the given dirs on this machine,
    # timed and read here). Speeds in GB/s; free space in GiB, each tier's own (no two share it).
    tier_read_gbps: list[float] | None = None
    tier_write_gbps: list[float] | None = None
    tier_free_gib: list[float] | None = None

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
        for name in TIER_FIELDS:  # free space may be 0; a speed must be more
            values, free = getattr(self, name), name == "tier_free_gib"
            if values is not None and not all(is_number(v) and (v >= 0 if free else v > 0) for v in values):
                raise ValueError(f"machine.{name}={values!r} must be a list of {'numbers >= 0' if free else 'positive numbers'}, "
                                 "one per offload.tiers (null: this machine's dirs)")  # fmt: skip
        if (self.tier_read_gbps is None) != (self.tier_write_gbps is None):
            raise ValueError("machine.tier_read_gbps and machine.tier_write_gbps are stated together (the planned machine's "
                             "tiers), or neither (timed here)")  # fmt: skip
        if not (is_number(self.gpu_update_gbps) and self.gpu_update_gbps > 0):
            raise ValueError(f"machine.gpu_update_gbps={self.gpu_update_gbps!r} must be a positive number of GB/s (default 2000)")

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    def check_tiers(self, tiers: list[str]) -> None:
        """Refuses stated tier lists that are not one entry per offload.tiers."""
        for name in TIER_FIELDS:
            values = getattr(self, name)
            if values is not None and len(values) != len(tiers):
                raise ValueError(f"machine.{name} has {len(values)} entries for the {len(tiers)} offload.tiers {tiers}: "
                                 "give one per tier, in order")  # fmt: skip

    def tier_free_bytes(self, i: int, spec_path: str) -> int:
        """Free space for tier `i` (its dir `spec_path`): stated, else its file system's here."""
        return int(self.tier_free_gib[i] * GIB) if self.tier_free_gib is not None else free_bytes(spec_path)

    def tier_file_system(self, i: int, spec_path: str) -> tuple[int, bool]:
        """Tier `i`'s file system (file_system): where its free space is stated, its own (a negative id),
        and in memory as the dir is here (/dev/shm is a tmpfs on any Linux)."""
        device, in_memory = file_system(spec_path)
        return (-1 - i, in_memory) if self.tier_free_gib is not None else (device, in_memory)


TIER_FIELDS = ("tier_read_gbps", "tier_write_gbps", "tier_free_gib")


def tier_room_subgroups(machine: MachineConfig, specs: list, ranks: int, slot_bytes: int) -> list[int]:
    """The subgroups of `slot_bytes` each tier (TierSpec) has room for, for one of the node's `ranks`:
    its file system's free space, shared by those ranks and by the tiers on it (stated, else read here)."""
    systems = [machine.tier_file_system(i, spec.dir)[0] for i, spec in enumerate(specs)]
    free = [machine.tier_free_bytes(i, spec.dir) for i, spec in enumerate(specs)]
    return [free[i] // systems.count(systems[i]) // ranks // max(slot_bytes, 1) for i in range(len(specs))]


def planned_gpu_bytes(cfg: OffloadConfig, machine: MachineConfig, device_type: str) -> int | None:
    """GPU memory per rank of a run on `device_type` (None: it trains on the CPU); raises a JobError (every
    rank alike) for options that need a GPU the run does not have, as the optimizer would."""
    gpu = machine.gpu_gib
    if gpu is None:
        gpu = torch.cuda.mem_get_info()[1] / GIB if device_type == "cuda" and torch.cuda.is_available() else 0.0
    if device_type == "cuda" and gpu == 0:
        raise JobError("train.device=cuda, but the machine planned for has no GPU: state its memory "
                       "(machine.gpu_gib=80), or plan for train.device=cpu")  # fmt: skip
    if device_type == "cuda":
        return int(gpu * GIB)
    if needs_gpu(cfg.gpu_fraction):
        raise JobError(f"offload.gpu_fraction={cfg.gpu_fraction} keeps state on the GPU, but the planned run trains "
                       "on the CPU: use 0, or plan for a GPU (machine.gpu_gib=80, train.device=cuda)")  # fmt: skip
    if cfg.grad_path == "gpu_bf16":
        raise JobError("offload.grad_path='gpu_bf16' keeps the grads in GPU memory, but the planned run trains on the "
                       "CPU: use offload.grad_path='host_bf16', or plan for a GPU (machine.gpu_gib=80, train.device=cuda)")  # fmt: skip
    return None


def planned_host_bytes(machine: MachineConfig) -> int:
    """Host memory of the node's ranks: machine.host_gib if stated, else what this machine has available
    now (MemAvailable, or the memory cgroup's limit less its usage where that is less). Where memory is
    added to a machine as it is used (MemTotal grows), this is a floor: state machine.host_gib (train.py:
    train.host_memory_gb)."""
    return node_host_bytes(None if machine.host_gib is None else round(machine.host_gib * GIB))


# What mem_get_info counts as used beside torch's own allocations once a run has built its model: the
# CUDA context, cuBLAS's workspace and NCCL's buffers (1.22 GiB on an H100, torch 2.11, after an all-reduce).
CUDA_CONTEXT_BYTES = int(1.25 * GIB)


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


def tiers_sharing_a_file_system(specs: list) -> list[list[str]]:
    """The tiers (TierSpec) that lie on one file system here, in groups of two or more: a second path
    only where it is another device (each tier is measured alone, so their bandwidths seem to add)."""
    groups: dict[int, list[str]] = {}
    for spec in specs:
        groups.setdefault(file_system(spec.dir)[0], []).append(spec.text)
    return [g for g in groups.values() if len(g) > 1]


SHARED_FILE_SYSTEM_NOTE = ("are on one file system: they share its bandwidth, where the placement (each tier measured alone) "
                           "counts it for each; a second path needs another device")  # fmt: skip


QUIET_TRIES = 3  # timings of the CPU rate, at most, while the rest of the node keeps it busy


def timed_rate(cfg: OffloadConfig, ranks: int, threads: int, split: bool = False) -> CpuRate:
    """The kernel timed here as the node's ranks run it. Where the rest of the node took a core or more
    meanwhile (update_rate.OtherLoad), which slows the kernel, it is timed again, up to QUIET_TRIES times in
    all, and the reading beside the least load kept (on nvidia-h200-x4, a timing beside 1.8 cores of steal
    predicted 1.18x the measured update, session 30); the detail says where even that one was busy."""
    readings = []
    for _ in range(QUIET_TRIES):
        readings.append(timed_beside_load(lambda: node_update_rate(cfg.kernel, cfg.subgroup_numel, threads, ranks, split)))
        if readings[-1][1] is None or not readings[-1][1].busy:
            break
    rate, load = min(readings, key=lambda reading: 0.0 if reading[1] is None else reading[1].cores)
    notes = [load.warning() if load is not None else "", unlearned_note(cfg, ranks, threads, split)]
    return CpuRate(rate, "timed", "; ".join(n for n in notes if n))


def split_step_rate(cfg: OffloadConfig, machine: MachineConfig, cpu_threads: int | None) -> CpuRate:
    """Each rank's CPU update speed on split masters (a plan that splits them predicts its kernel from it), found
    as cpu_rate finds the whole step's: machine.cpu_mparams_per_s, which states one rate for both; else
    the split step's learned here; else the split step timed here."""
    if machine.cpu_mparams_per_s is not None:
        return CpuRate(machine.cpu_mparams_per_s * 1e6, "given")
    ranks = machine.ranks_per_node
    threads = cpu_threads_per_rank(cpu_threads, ranks)
    return learned_rate_for(cfg, ranks, threads, split=True) or timed_rate(cfg, ranks, threads, split=True)


def cpu_rate(cfg: OffloadConfig, machine: MachineConfig, cpu_threads: int | None) -> CpuRate:
    """Each rank's CPU update speed, for a predicted update time: machine.cpu_mparams_per_s; else learned
    from an earlier run's steps on this host, in offload.bandwidth_profile, for the grads `cfg`'s kernel
    takes; else timed here as the node's ranks run it, side by side (update_rate.node_update_rate)."""
    if machine.cpu_mparams_per_s is not None:
        return CpuRate(machine.cpu_mparams_per_s * 1e6, "given")
    ranks = machine.ranks_per_node
    threads = cpu_threads_per_rank(cpu_threads, ranks)
    return learned_rate_for(cfg, ranks, threads) or timed_rate(cfg, ranks, threads)


def tier_speeds(cfg: OffloadConfig, machine: MachineConfig) -> list[TierSpeed] | None:
    """The tiers' speeds: the planned machine's where stated, else the profile's, else measured here."""
    if machine.tier_read_gbps is not None:
        return [TierSpeed(r * 1e9, w * 1e9, 0.0) for r, w in zip(machine.tier_read_gbps, machine.tier_write_gbps)]
    return starting_speeds(cfg, needed=bool(cfg.tiers)).speeds  # any tier's, for the prediction