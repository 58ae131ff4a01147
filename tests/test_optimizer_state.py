"""OffloadAdamW through torch.distributed.checkpoint: streamed one subgroup at a time, checked before
anything changes, and a load that fails part-way never trained on. (Round trips into other tier dirs:
test_optimizer.py; two ranks, kill and resume: test_train.py; GPU-resident state: test_gpu_resident.py.)"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.optimizer_state import CheckedFileSystemWriter, OffloadOptimizerState, StreamingLoadPlanner, StreamingSavePlanner

from test_optimizer import SG, SHAPES, budget_for, grads_for, groups, make_params

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def build(tier_dir, subgroup_numel: int = SG, lr: float = 1e-3) -> tuple[OffloadAdamW, list[torch.nn.Parameter]]:
    tier_dir.mkdir(exist_ok=True)
    params = [torch.nn.Parameter(t) for t in make_params()]
    budget = budget_for(3) * subgroup_numel / SG  # 3 slots (and about the same staging) at any subgroup size
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{tier_dir}"], subgroup_numel=subgroup_numel, host_budget_gb=budget)
    return OffloadAdamW(groups(params), lr=lr, offload=cfg), params


def train(opt: OffloadAdamW, params, steps: range) -> None:
    for s in steps:
        for p, g in zip(params, grads_for(s)):
            p.grad = g
        opt.step()


def save(opt: OffloadAdamW, path) -> None:
    dcp.save({"optim": OffloadOptimizerState(opt)}, checkpoint_id=str(path), planner=StreamingSavePlanner())


def load(opt: OffloadAdamW, path) -> None:
    dcp.load({"optim": OffloadOptimizerState(opt)}, checkpoint_id=str(path), planner=StreamingLoadPlanner())


def saved(tmp_path, steps: int) -> tuple[OffloadAdamW, list[torch.nn.Parameter]]:
    """An optimizer trained `steps` steps on tier dir a/ and saved to ck/."""
    opt, params = build(tmp_path / "a")
    train(opt, params, range(steps))
    save(opt, tmp_path / "ck")
    return opt, params


def states(opt: OffloadAdamW) -> list[torch.Tensor]:
    sd = opt.state_dict()["state"]
    return [sd[i][k] for i in sorted(sd) for k in ("master_param", "exp_avg", "exp_avg_sq")]


def test_save_streams_one_subgroup_at_a_time_and_leaves_the_cache(tmp_path, monkeypatch):
    opt, params = build(tmp_path / "a")
    train(opt, params, range(3))
    resident, dirty = dict(opt.store.cache.slot_of), set(opt.store.cache.dirty)
    buffers: set[int] = set()
    read = opt.store.read

    def spy(sg: int, out: torch.Tensor) -> None:
        buffers.add(out.data_ptr())
        read(sg, out)

    monkeypatch.setattr(opt.store, "read", spy)
    save(opt, tmp_path / "ck")
    assert len(buffers) == 1  # one writer: every subgroup goes through the same buffer, never the whole state
    assert opt.store.cache.slot_of == resident and opt.store.cache.dirty == dirty  # the next step finds what it would have
    other, _ = build(tmp_path / "b")
    load(other, tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(states(opt), states(other)))
    opt.close()
    other.close()


def test_another_layout_is_refused_before_anything_changes(tmp_path):
    opt, params = saved(tmp_path, 2)
    opt.close()
    other, other_params = build(tmp_path / "b", subgroup_numel=2 * SG)
    before = states(other)
    with pytest.raises(CheckpointException, match=r"rank0: the checkpoint has 11 subgroups, this optimizer 6.*offload.subgroup_numel"):
        load(other, tmp_path / "ck")
    assert all(torch.equal(a, b) for a, b in zip(before, states(other)))
    train(other, other_params, range(1))  # still usable
    other.close()


def test_a_load_that_fails_part_way_refuses_to_step_until_a_good_one(tmp_path, monkeypatch):
    opt, params = saved(tmp_path, 3)
    other, other_params = build(tmp_path / "b", lr=0.5)
    write, calls = other.store.overwrite, []

    def failing(sg: int, state: torch.Tensor, then) -> None:
        calls.append(sg)
        if len(calls) == 4:
            raise OSError(5, "Input/output error")
        write(sg, state, then)

    monkeypatch.setattr(other.store, "overwrite", failing)
    with pytest.raises(CheckpointException, match="Input/output error"):
        load(other, tmp_path / "ck")
    with pytest.raises(RuntimeError, match="load a state again"):
        train(other, other_params, range(3, 4))
    monkeypatch.setattr(other.store, "overwrite", write)
    load(other, tmp_path / "ck")
    assert other.param_groups[0]["lr"] == 1e-2  # hyperparameters come back with the subgroups
    train(opt, params, range(3, 5))
    train(other, other_params, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(states(opt), states(other)))
    assert all(torch.equal(a.data, b.data) for a, b in zip(params, other_params))
    opt.close()
    other.close()


def test_a_truncated_checkpoint_is_reported(tmp_path):
    opt, params = saved(tmp_path, 2)
    (data,) = [f for f in os.listdir(tmp_path / "ck") if f.endswith(".distcp")]
    path = tmp_path / "ck" / data
    os.truncate(path, os.path.getsize(path) // 2)
    other, _ = build(tmp_path / "b")
    with pytest.raises(CheckpointException, match=r"checkpoint file __0_0.distcp at offset \d+ \(optim.rank0.subgroup_\d+\): subgroup \d+ holds \d+ bytes, \d+ expected: the checkpoint is truncated"):
        load(other, tmp_path / "ck")
    other.close()
    opt.close()


def test_without_the_streaming_planners_is_a_clear_error(tmp_path):
    opt, params = build(tmp_path / "a")
    train(opt, params, range(1))
    with pytest.raises(CheckpointException, match="planner=StreamingSavePlanner"):
        dcp.save({"optim": OffloadOptimizerState(opt)}, checkpoint_id=str(tmp_path / "ck"))
    with pytest.raises(TypeError, match="wraps an OffloadAdamW"):
        OffloadOptimizerState(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(SHAPES[0]))]))
    opt.close()


def test_a_corrupted_subgroup_is_refused_and_never_trained_on(tmp_path):
    opt, params = saved(tmp_path, 2)
    storage = FileSystemReader(str(tmp_path / "ck")).read_metadata().storage_data
    where = next(info for index, info in storage.items() if index.fqn == "optim.rank0.subgroup_000003")
    with open(tmp_path / "ck" / where.relative_path, "r+b") as f:
        f.seek(where.offset + 1000)
        f.write(b"\xff" * 64)
    other, other_params = build(tmp_path / "b")
    with pytest.raises(CheckpointException, match=r"subgroup_000003\): subgroup 3 is corrupted \(checksum mismatch in its \d+-byte chunk at offset 0\)"):
        load(other, tmp_path / "ck")
    with pytest.raises(RuntimeError, match="load a state again"):
        train(other, other_params, range(2, 3))
    opt.close()
    other.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the writer thread's own
def test_a_failed_writer_thread_fails_the_save(tmp_path, monkeypatch):
    """torch 2.13's FileSystemWriter drops the errors of its extra writer threads and would commit a
    checkpoint without their entries; CheckedFileSystemWriter fails the save instead."""
    opt, params = build(tmp_path / "a")
    train(opt, params, range(1))
    read = opt.store.read

    def failing_off_main(sg: int, out: torch.Tensor) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise OSError(5, "Input/output error")
        read(sg, out)

    monkeypatch.setattr(opt.store, "read", failing_off_main)
    writer = CheckedFileSystemWriter(str(tmp_path / "ck"), thread_count=3)
    with pytest.raises(CheckpointException, match=r"entries were not written \(a writer thread failed"):
        dcp.save({"optim": OffloadOptimizerState(opt)}, storage_writer=writer, planner=StreamingSavePlanner())
    assert not os.path.exists(tmp_path / "ck" / ".metadata")  # nothing committed
    opt.close()


def _ranks_with_one_mismatch(rank: int, world_size: int, root: str) -> None:
    """Each rank saves its own state; then rank 1 loads into another layout. Both ranks get the error
    before anything is read, and rank 0's optimizer (whose layout fits) is left as it was, usable."""
    from pathlib import Path

    root = Path(root)
    opt, params = build(root / f"tier{rank}")
    train(opt, params, range(2))
    save(opt, root / "ck")
    fresh, fresh_params = build(root / f"fresh{rank}", subgroup_numel=SG if rank == 0 else 2 * SG)
    before = states(fresh)
    with pytest.raises(CheckpointException, match=r"rank1: the checkpoint has 11 subgroups, this optimizer 6"):
        load(fresh, root / "ck")
    assert all(torch.equal(a, b) for a, b in zip(before, states(fresh)))
    train(fresh, fresh_params, range(1))  # not left refusing to step
    if rank == 0:
        again, again_params = build(root / "again0")
        dcp.load({"optim": OffloadOptimizerState(again)}, checkpoint_id=str(root / "ck"), planner=StreamingLoadPlanner(),
                 no_dist=True)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(states(opt), states(again)))  # rank 0's own subgroups
        again.close()
    for o in (opt, fresh):
        o.close()


def test_ranks_keep_their_own_state_and_a_mismatch_on_one_rank_changes_nothing(tmp_path):
    from dist_utils import run_ranks

    run_ranks(2, _ranks_with_one_mismatch, str(tmp_path))


def _all_but_two_cached(tier_dir, params: list[torch.nn.Parameter]) -> OffloadAdamW:
    """OffloadAdamW on `params` (a subgroup each) with the smallest budget whose host cache holds all but two
    (found on stand-ins: an optimizer casts the params it is built on)."""
    tier_dir.mkdir()
    for kib in range(600, 1400, 25):
        cfg = OffloadConfig(kernel="torch", subgroup_numel=4096, tiers=[f"posix:{tier_dir}"], host_budget_gb=f"{kib}KiB")
        try:
            trial = OffloadAdamW([torch.nn.Parameter(torch.zeros_like(p)) for p in params], lr=1e-3, offload=cfg)
        except ValueError:  # below the pipeline's minimum
            continue
        slots = len(trial.store.cache.slots)
        trial.close()
        if slots == len(params) - 2:
            return OffloadAdamW(params, lr=1e-3, offload=cfg)
    raise AssertionError("no budget cached all but two subgroups")


def test_a_load_into_a_fresh_optimizer_whose_cache_misses_two_subgroups(tmp_path):
    """The load's pass goes first to the two subgroups not in host memory, with every cached one ahead in its
    window: the one needed now takes the slot of the one needed last (helper-70 found it refused: "no host
    cache slot free"). The loaded state is the saved one, and the next step the same bits as the original's."""
    torch.manual_seed(0)
    first = [torch.nn.Parameter(torch.randn(4096)) for _ in range(15)]
    second = [torch.nn.Parameter(p.detach().clone()) for p in first]
    original = _all_but_two_cached(tmp_path / "a", first)
    for p in first:
        p.grad = torch.randn(4096, dtype=torch.bfloat16)
    original.step()
    saved = original.state_dict()
    loaded = _all_but_two_cached(tmp_path / "b", second)
    loaded.load_state_dict(saved)
    for a, b in zip(original.state_dict()["state"].values(), loaded.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in ("master_param", "exp_avg", "exp_avg_sq"))
    for p, q in zip(first, second):
        p.grad = q.grad = torch.randn(4096, dtype=torch.bfloat16)
    original.step()
    loaded.step()
    assert all(torch.equal(p, q) for p, q in zip(first, second))
    original.close()
    loaded.close()
