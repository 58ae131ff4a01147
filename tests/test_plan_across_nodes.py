"""A job of several nodes (or several jobs on one): each node plans its own ranks' shards (the last
ranks' are smaller), a plan short on one node alone is said once and ends every rank (no rank left
waiting in a collective), the files a killed run left in a tier dir do not count against the next
run's free space, and a budget error every rank meets alike is one line."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_fsdp import ARGS, SG
from test_storage_faults import dead_pid, leftover, tier_dir

from fsdp_offload import OffloadConfig
from fsdp_offload.job_errors import JobError, raise_on_every_rank
from fsdp_offload.machine import MachineConfig
from fsdp_offload.models import MODEL_PRESETS
from fsdp_offload.node_plan import ModelShapes, make_plan
from fsdp_offload.plans import PlanError
from fsdp_offload.step_memory import plan_step_memory, same_on_every_rank
from fsdp_offload.storage.private_files import remove_dead_files


def cpu_plan(node_ranks: list[int] | None, world: int, ranks_per_node: int = 2):
    cfg = OffloadConfig(subgroup_numel=SG, kernel="torch")
    machine = MachineConfig(ranks_per_node=ranks_per_node, host_gib=64)
    return make_plan("test", ARGS, cfg, machine, 32, 2, "cpu", node_ranks=node_ranks, world_size=world)


def test_each_node_plans_the_shards_of_its_own_ranks():
    shapes = ModelShapes.of(ARGS)
    first, last = cpu_plan(None, 6), cpu_plan([4, 5], 6)  # the first and the third node of 2 ranks each
    assert [r.rank for r in first.ranks] == [0, 1] and [r.rank for r in last.ranks] == [4, 5]
    assert first.world_size == last.world_size == 6
    for plan in (first, last):
        assert [r.params for r in plan.ranks] == [sum(shapes.local_numels(6, r.rank)) for r in plan.ranks]
    assert last.ranks[1].params < first.ranks[1].params  # torch.chunk leaves the job's last rank the least
    # a node of 3 ranks beside one of 2 (a launcher's uneven split): the job's world, not ranks x nodes
    uneven = cpu_plan([3, 4], 5)
    assert [r.params for r in uneven.ranks] == [sum(shapes.local_numels(5, r)) for r in (3, 4)]


def test_node_ranks_that_are_not_the_node_s_are_refused():
    with pytest.raises(ValueError, match=r"node_ranks=\[4\] must be machine.ranks_per_node=2 ranks of the job's 6"):
        cpu_plan([4], 6)
    with pytest.raises(ValueError, match=r"node_ranks=\[6, 7\] must be .* of the job's 6"):
        cpu_plan([6, 7], 6)


def _short_on_one_rank(rank: int, world: int) -> None:
    args = dataclasses.replace(MODEL_PRESETS["tiny"], activation_checkpointing="auto", reshard_after_forward="auto")
    cfg = OffloadConfig(subgroup_numel=SG, kernel="torch")

    def make(a):
        if rank == 1:  # this node's disk is short; rank 0's fits
            raise PlanError("tier posix:/x: short by 1 GiB; free space")
        return make_plan("tiny", a, cfg, MachineConfig(host_gib=64), 32, 2, "cpu")

    agree = lambda choice: same_on_every_rank(choice, dist.group.WORLD, torch.device("cpu"))  # noqa: E731
    settle = lambda short: raise_on_every_rank(None if short is None else str(short), dist.group.WORLD)  # noqa: E731
    with pytest.raises(JobError, match=r"^tier posix:/x: short by 1 GiB; free space \(on ranks 1\)$"):
        plan_step_memory(args, make, 4.0, agree, settle)
    plan, _ = plan_step_memory(args, lambda a: make_plan("tiny", a, cfg, MachineConfig(host_gib=64), 32, 2, "cpu"), 4.0, agree, settle)
    assert plan.ranks  # where every rank's fits, the ranks go on to agree on the step


def test_a_plan_short_on_one_rank_alone_ends_every_rank_naming_it():
    run_ranks(2, _short_on_one_rank)


def test_one_process_gets_its_own_plan_error():
    args = dataclasses.replace(MODEL_PRESETS["tiny"], activation_checkpointing="auto")

    def short(a):
        raise PlanError("host memory: short by 1 GiB")

    asked = []
    with pytest.raises(PlanError, match="short by 1 GiB"):
        plan_step_memory(args, short, 4.0, agree=lambda choice: asked.append(choice) or True)
    assert asked == []  # refused before any agreement is asked for


def test_files_a_killed_run_left_are_removed_before_the_plan(tmp_path):
    d = tier_dir(tmp_path)
    stale = leftover(d, "rank0", dead_pid())
    live = leftover(d, "rank1", os.getpid())  # this process's: in use
    other_host = leftover(d, "rank2", dead_pid(), host="another_host")  # never judged from here
    assert remove_dead_files(str(tmp_path), "posix:" + str(tmp_path)) == [stale]
    assert sorted(os.listdir(d)) == sorted(os.path.basename(p) for p in (live, other_host))
    assert remove_dead_files(str(tmp_path / "none"), "posix:none") == []  # no dir of ours there: nothing to do


def test_an_auto_budget_that_leaves_nothing_is_one_error_for_the_job():
    budget = OffloadConfig(host_budget_gb="auto").host_budget
    with pytest.raises(JobError, match="no host memory is left for the optimizer"):
        budget.named(0)


def _part_of_the_job(rank: int, world: int) -> None:
    from fsdp_offload import node

    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun sets it: the job's 4 ranks share this node
    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # (every rank makes every group)
    mine = stages[rank // 2]
    assert node.node_position(mine) == (4, rank % 2)  # the node's 4 ranks share its memory, not the group's 2
    assert node.node_ranks(dist.group.WORLD) == 4


def test_a_group_of_part_of_the_job_counts_the_node_s_ranks_of_the_job():
    """Pipeline stages (or replicas) each with its FSDP group: an "auto" host budget or a rank's threads
    divide the node among all its ranks, not among the group's alone (each would take twice its share)."""
    run_ranks(4, _part_of_the_job)
