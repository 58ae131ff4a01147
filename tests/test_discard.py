"""A tier whose file system has no room for every subgroup frees the stale copy of a subgroup that
changed in host memory (a punched hole), so it holds only what is not in host memory; the results are
bit for bit those of a tier with room, and a freed slot reads as never written, never as stale bytes."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_optimizer import SG, budget_for, grads_for, groups, make_params

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.cache import aligned_host_buffer
from fsdp_offload.storage import TierError, chunked, make_tier

MIB = 1 << 20


@pytest.fixture
def no_room(monkeypatch, tmp_path):
    """Every file system reports no free space (nothing is written to fill it for real); skips where
    tmp_path's file system cannot punch holes at all."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 8192)
    if not chunked.punch_hole(str(probe), 0, 4096):
        pytest.skip(f"the file system of {tmp_path} cannot punch holes (fallocate EOPNOTSUPP)")
    probe.unlink()
    monkeypatch.setattr(chunked.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, 0))


def allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def written_tier(root: str):
    tier = make_tier(f"posix:{root}")
    tier.attach("test", [MIB, MIB])
    buf = aligned_host_buffer(MIB).fill_(7)
    tier.write(0, buf).result()
    tier.write(1, buf).result()
    return tier, buf


def test_discard_frees_the_slot_when_short_of_space(tmp_path, no_room):
    tier, buf = written_tier(str(tmp_path))
    before = allocated(tier.path)
    tier.discard(0)
    assert allocated(tier.path) <= before - MIB  # the slot's blocks went back to the file system
    with pytest.raises(TierError, match="subgroup 0 was never written"):
        tier.read(0, buf)
    out = aligned_host_buffer(MIB)
    tier.read(1, out).result()
    assert torch.equal(out, buf)
    tier.close()


def test_discard_keeps_the_space_where_there_is_room(tmp_path):
    tier, buf = written_tier(str(tmp_path))
    before = allocated(tier.path)
    tier.discard(0)
    assert allocated(tier.path) == before  # a hole would cost the next write its block allocation
    with pytest.raises(TierError, match="subgroup 0 was never written"):
        tier.read(0, buf)
    tier.close()


def train(tier_dir: str, steps: int = 5) -> tuple[list[torch.Tensor], OffloadAdamW]:
    params = [torch.nn.Parameter(t) for t in make_params()]
    os.makedirs(tier_dir, exist_ok=True)
    cfg = OffloadConfig(tiers=[f"posix:{tier_dir}"], host_budget_gb=budget_for(4), subgroup_numel=SG, prefetch=1, kernel="torch")
    opt = OffloadAdamW(groups(params), offload=cfg)
    for step in range(steps):
        for p, g in zip(params, grads_for(step)):
            p.grad = g
        opt.step()
    return params, opt


def test_training_with_stale_copies_freed_is_exact_and_holds_only_what_is_not_cached(tmp_path, no_room, monkeypatch):
    monkeypatch.undo()  # room for everything first
    roomy, roomy_opt = train(str(tmp_path / "roomy"))
    monkeypatch.setattr(chunked.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, 0))
    tight, tight_opt = train(str(tmp_path / "tight"))
    [tier] = tight_opt.store.tiers
    slot = tight_opt.layout.slot_bytes
    stored = len(tight_opt.layout) - tight_opt.store.cache.num_slots
    assert allocated(tier.path) <= (stored + 1) * slot  # what is not in host memory, and no more than one extra
    assert allocated(roomy_opt.store.tiers[0].path) > allocated(tier.path)
    for a, b in zip(roomy, tight):
        assert torch.equal(a, b)
    ra, rb = roomy_opt.state_dict()["state"], tight_opt.state_dict()["state"]  # reads every subgroup back
    for i in ra:
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ra[i][key], rb[i][key]), (i, key)
    roomy_opt.close()
    tight_opt.close()
