"""What this node is to a rank: how many of the job's ranks share it, its place among them, when torchrun
started the job here, the job's id, and this process's cgroups (the limits a launcher or a container
set on memory and CPUs)."""

from __future__ import annotations

import os
import socket
import time
import uuid

import torch.distributed as dist


# This process's cgroups and where their hierarchies are mounted (tests point them at fake ones).
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_dirs(v1_controller: str) -> list[str]:
    """This process's cgroup dirs, its own first, then its ancestors up to the hierarchy's root: of
    `v1_controller`'s hierarchy under cgroup v1, of the unified one under v2 (from PROC_CGROUP)."""
    try:
        with open(PROC_CGROUP) as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return []
    for _, controllers, path in entries:
        if v1_controller in controllers.split(","):
            root = os.path.join(CGROUP_ROOT, v1_controller)
            break
    else:
        path = next((path for hid, controllers, path in entries if hid == "0" and not controllers), None)
        if path is None:
            return []
        root = CGROUP_ROOT
    parts = [p for p in path.split("/") if p]
    dirs = [os.path.join(root, *parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if os.path.isdir(d)]  # a container shows only its own part of the path


_job_node_ranks: int | None = None  # the job's ranks on this node, once node_ranks has counted them
_job_node_place: tuple[int, int] | None = None  # (the job's world size, this rank's place among them)


def node_ranks(group: dist.ProcessGroup | None = None) -> int:
    """The ranks on this node. With `group` (a collective: every rank of it calls), those of `group`, by
    host name: launchers other than torchrun (srun, mp.spawn) set no LOCAL_WORLD_SIZE. Without one (before
    init_process_group, or where one rank alone asks: a tier's file, a calibration): the job's count if a
    call with a group spanning the job has counted it, else $LOCAL_WORLD_SIZE, else 1."""
    return node_position(group)[0]


def node_position(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """The ranks on this node (as node_ranks counts them; with a `group` of part of the job, no fewer than
    the job's there) and this rank's place among them, 0 first: with `group` (a collective) its place
    among the node's ranks of `group`, whichever way the launcher numbered them (srun
    --distribution=cyclic spreads a node's ranks apart); without one, $LOCAL_RANK, else 0."""
    global _job_node_ranks, _job_node_place
    if group is None:
        if dist.is_initialized() and dist.get_world_size() == 1:
            return 1, 0  # (whatever an earlier job in this process counted)
        return _job_node_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    peers = node_peers(group)
    if dist.get_world_size(group) == dist.get_world_size():
        _job_node_ranks, _job_node_place = len(peers), (dist.get_world_size(), peers.index(dist.get_rank(group)))
        return len(peers), peers.index(dist.get_rank(group))
    # a group of part of the job (a pipeline stage's, a replica's): the node's other ranks share its memory too
    counted = _job_node_place is not None and _job_node_place[0] == dist.get_world_size()  # (this job's, not an earlier one's)
    job_here = _job_node_ranks if counted else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # (srun sets none: count first)
    return max(len(peers), job_here), peers.index(dist.get_rank(group))


def first_on_node() -> bool:
    """Whether this process is its node's first rank, found without a collective (for what each of a
    node's ranks reads alike, a file say, to be said once a node): $LOCAL_RANK == 0 (torchrun), else,
    where a launcher set none (srun), the first by host name if node_position has counted the job's
    ranks (train.py does at once; the job's rank 0 alone would leave every other node's file unsaid),
    else the job's rank 0; a process with no group of others is."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        return int(local) == 0
    if _job_node_place is not None and _job_node_place[0] == dist.get_world_size():  # (not an earlier job's)
        return _job_node_place[1] == 0
    return dist.get_rank() == 0


def node_peers(group: dist.ProcessGroup) -> list[int]:
    """The ranks of `group` (group ranks, ascending) on this node, by host name. A collective."""
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return [r for r, host in enumerate(hosts) if host == socket.gethostname()]


def job_id(group: dist.ProcessGroup | None) -> str:
    """One id for the job, the same on every rank of `group` (a collective): rank 0's, new each job.
    Without a group (params that are not DTensors), the id torchrun gave the node's ranks with the time
    it started them, which they share without a collective; a new one outside torchrun."""
    if group is None:
        run = os.environ.get("TORCHELASTIC_RUN_ID")
        return f"{run}-{run_stamp()}" if run else uuid.uuid4().hex
    mine = [uuid.uuid4().hex]
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(mine, src=dist.get_global_rank(group, 0), group=group)
    return mine[0]


def run_stamp() -> str:
    """Hydra's run dir under outputs/, `<date>/<time>-<pid>` (`${run_stamp:}` in the recipes): under torchrun
    the time its agent on this node started and the agent's pid, the parent of every rank of the job here,
    so the ranks share one dir where each one's own clock would give a rank that started a second later a
    dir of its own (its .hydra/ and log apart); elsewhere, or without Linux's /proc, the time now and this
    process's pid. The pid keeps two jobs started in one second apart (a refused one would rewrite the
    other's .hydra/config.yaml)."""
    started, pid = time.time(), os.getpid()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker that torchrun's agent started
        try:
            with open(f"/proc/{os.getppid()}/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: its start, in clock ticks after boot
            with open("/proc/stat") as f:
                boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
            started, pid = boot + ticks / os.sysconf("SC_CLK_TCK"), os.getppid()
        except (OSError, ValueError, IndexError, StopIteration):
            pass
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(started)) + f"-{pid}"


def says_once() -> bool:
    """Whether this rank says what every rank would (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0
