"""Split masters (kernels/split_masters.py) through the optimizer: with bf16 params a subgroup off the GPU
is held as its masters' low halves (10 bytes a param), and every master comes back bit for bit: through
the host cache, the tiers, state dicts and checkpoints, and the values where the rounding is hardest."""

from __future__ import annotations

import os

import pytest
import torch

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.kernels.split_masters import join_masters, split_masters
from fsdp_offload.subgroups import SubgroupLayout

SG = 4096
N = 11 * SG - 1000  # 11 subgroups, the last one short
STAGING = 2 * 11 * SG


def budget(slots: int) -> float:
    return (STAGING + slots * 10 * SG) / 2**30


def planted_masters(seed: int = 0) -> torch.Tensor:
    """Random FP32 masters with the hard cases planted: ties (low half 0x8000) both ways, +-0, +-inf,
    the largest finite values (they round to inf), denormals, and values a bf16 holds exactly."""
    g = torch.Generator().manual_seed(seed)
    masters = torch.randn(N, generator=g)
    bits = masters.view(torch.int32)
    bits[:2000] = (bits[:2000] & ~0xFFFF) | 0x8000  # ties: half of them round up (odd high half)
    special = [0.0, -0.0, float("inf"), float("-inf"), 3.4028234663852886e38, -3.4028234663852886e38, 1e-45, -1e-45,
               1e-40, 1.0, 1.00390625, -2.5]  # fmt: skip
    masters[2000 : 2000 + len(special)] = torch.tensor(special)
    return masters


def test_layout_holds_a_split_subgroup_in_10_bytes_a_param():
    split, whole = SubgroupLayout([N], SG, True), SubgroupLayout([N], SG, False)
    assert split.slot_bytes == 10 * SG and whole.slot_bytes == 12 * SG
    assert [sg.state_bytes for sg in split.subgroups] == [sg.state_bytes for sg in whole.subgroups]  # FP32 outside
    small = SubgroupLayout([1024], 1024, True).subgroups[0]  # low halves padded to 4 KiB: no saving at 1024
    assert small.stored_bytes == small.state_bytes == 12 * 1024
    state = torch.zeros(split.slot_bytes, dtype=torch.uint8)
    low, m, v = split.subgroups[0].stored_parts(state)
    assert low.dtype == torch.int16 and low.numel() == m.numel() == v.numel() == SG
    assert v.data_ptr() + 4 * SG == state.data_ptr() + split.slot_bytes  # the parts fill the slot, in order


def test_split_then_join_gives_every_master_back():
    masters = planted_masters()
    v = torch.rand(N)
    low = torch.empty(N, dtype=torch.int16)
    moments = v.clone()
    lowp = split_masters(masters, low, moments)
    assert torch.equal(lowp.view(torch.int16), masters.to(torch.bfloat16).view(torch.int16))
    assert (moments.view(torch.int32) < 0).any()  # some rounded up
    out = torch.empty(N)
    join_masters(low, lowp, moments, out)
    assert torch.equal(out.view(torch.int32), masters.view(torch.int32))
    assert torch.equal(moments, v)  # the rounding bits cleared: exp_avg_sq is itself again
    nan = torch.tensor([float("nan")] * 4)
    low4, v4, out4 = torch.empty(4, dtype=torch.int16), torch.zeros(4), torch.empty(4)
    join_masters(low4, split_masters(nan, low4, v4), v4, out4)
    assert out4.isnan().all()


@pytest.mark.parametrize("where", ["cache", "tier"])
def test_planted_masters_survive_steps_state_dicts_and_a_fresh_optimizer(tmp_path, where):
    """lr=0 keeps the planted masters (but -0, which the update's + 0 makes +0, as torch's does): after
    steps through the cache or the tier, a state dict and a load into a fresh optimizer, each master is
    torch AdamW's bits, and the model holds its bf16."""
    masters = planted_masters()
    kw = dict(kernel="torch", subgroup_numel=SG, split_masters=True)
    if where == "tier":
        os.makedirs(tmp_path / "a")
        os.makedirs(tmp_path / "b")
        kw.update(tiers=[f"posix:{tmp_path}/a"], host_budget_gb=budget(3), prefetch=1)
    p, r = torch.nn.Parameter(masters.clone()), torch.nn.Parameter(masters.clone())
    opt = OffloadAdamW([p], lr=0.0, weight_decay=0.1, offload=OffloadConfig(**kw))
    ref = torch.optim.AdamW([r], lr=0.0, weight_decay=0.1, foreach=False)
    for step in range(3):
        p.grad = torch.randn(N, generator=torch.Generator().manual_seed(step)).bfloat16()
        r.grad = p.grad.float()
        opt.step()
        ref.step()
    masters = r.data
    assert ((masters.view(torch.int32) & 0xFFFF) == 0x8000).sum() >= 2000  # the ties are still ties
    if where == "tier":
        assert opt.last_metrics.subgroups_read > 0
    state = opt.state_dict()
    got = state["state"][0]["master_param"]
    assert torch.equal(got.view(torch.int32), masters.view(torch.int32))
    assert torch.equal(p.data.view(torch.int16), masters.to(torch.bfloat16).view(torch.int16))
    if where == "tier":
        kw["tiers"] = [f"posix:{tmp_path}/b"]
    q = torch.nn.Parameter(torch.zeros(N))
    fresh = OffloadAdamW([q], lr=0.0, offload=OffloadConfig(**kw))
    fresh.load_state_dict(state)
    again = fresh.state_dict()["state"][0]
    for key in ("master_param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(again[key].view(torch.int32), state["state"][0][key].view(torch.int32)), key
    assert torch.equal(q.data.view(torch.int16), masters.to(torch.bfloat16).view(torch.int16))
    opt.close()
    fresh.close()


def test_a_tier_file_holds_10_bytes_a_param(tmp_path):
    p = torch.nn.Parameter(torch.randn(N))
    opt = OffloadAdamW([p], offload=OffloadConfig(kernel="torch", subgroup_numel=SG, tiers=[f"posix:{tmp_path}"],
                                                  host_budget_gb=budget(3), prefetch=1))  # fmt: skip
    for step in range(2):
        p.grad = torch.randn(N).bfloat16()
        opt.step()
    written = sum(opt.last_metrics.bytes_written.values())
    assert written > 0 and written % (10 * SG) == 0  # each write a whole split subgroup
    opt.close()


@pytest.mark.parametrize("split", [True, False])
def test_a_state_with_negative_exp_avg_sq_is_refused_before_anything_changes(split):
    """Its sign bit would carry a rounding bit when split, and torch's sqrt of it is NaN: refused either
    way, before the load begins, so the optimizer steps on as it was."""
    p = torch.nn.Parameter(torch.randn(N))
    opt = OffloadAdamW([p], offload=OffloadConfig(kernel="torch", subgroup_numel=SG, split_masters=split))
    p.grad = torch.randn(N).bfloat16()
    opt.step()
    state = opt.state_dict()
    bad = {**state, "state": {0: {**state["state"][0], "exp_avg_sq": state["state"][0]["exp_avg_sq"].clone()}}}
    bad["state"][0]["exp_avg_sq"][5] = -1.0
    with pytest.raises(ValueError, match=r"state_dict param 0 \(0\) exp_avg_sq holds negative values"):
        opt.load_state_dict(bad)
    p.grad = torch.randn(N).bfloat16()
    opt.step()  # not left half-loaded
    assert opt.state_dict()["state"][0]["step"] == 2
    opt.close()


def test_auto_splits_where_the_cache_would_not_hold_every_subgroup_whole(tmp_path):
    """split_masters='auto': whole where the budget holds all 11 subgroups whole (the update's cheaper
    kernel), split where it does not (6 slots of 12 bytes a param: 7 of 10); fp16 params stay whole, and
    split_masters=true with them is refused naming the fix."""

    def layout(**kw):
        opt = OffloadAdamW([torch.nn.Parameter(torch.randn(N))], offload=OffloadConfig(kernel="torch", subgroup_numel=SG, **kw))
        opt.close()
        return opt.layout.split_masters, opt.store.cache.num_slots

    tier = dict(tiers=[f"posix:{tmp_path}"], prefetch=1)
    assert layout() == (False, 11)  # no budget: every subgroup in host memory
    assert layout(host_budget_gb=(STAGING + 11 * 12 * SG) / 2**30, **tier) == (False, 11)
    assert layout(host_budget_gb=(STAGING + 6 * 12 * SG) / 2**30, **tier) == (True, 7)
    assert layout(host_budget_gb=(STAGING + 6 * 12 * SG) / 2**30, split_masters=False, **tier) == (False, 6)
    assert layout(split_masters=True) == (True, 11)
    assert layout(param_dtype="float16", loss_scale_init=1.0, host_budget_gb=(STAGING + 6 * 12 * SG) / 2**30, **tier) == (False, 6)
    with pytest.raises(ValueError, match=r"offload.split_masters=true keeps the masters' high halves in bf16 params.*use bfloat16"):
        OffloadConfig(split_masters=True, param_dtype="float16")
    for bad in ("yes", "true", 1):  # (1 == True in Python: refused, not taken as true)
        with pytest.raises(ValueError, match=r"offload.split_masters=.*: choose 'auto', true or false \(True or False in Python\)"):
            OffloadConfig(split_masters=bad)


def test_a_param_written_behind_the_optimizer_is_taken_at_bf16_precision(tmp_path):
    """`p.data.zero_()` after the optimizer is built (model.load_state_dict is the way): the split masters
    take the written value, within one bf16 unit of it, never a master of garbage (a high half of 0 less
    the rounding bit would be a NaN)."""
    p = torch.nn.Parameter(torch.randn(N))
    opt = OffloadAdamW([p], lr=0.0, offload=OffloadConfig(kernel="torch", subgroup_numel=SG, tiers=[f"posix:{tmp_path}"],
                                                          host_budget_gb=budget(3), prefetch=1))  # fmt: skip
    assert opt.layout.split_masters
    p.grad = torch.randn(N).bfloat16()
    opt.step()
    p.data.zero_()
    masters = opt.state_dict()["state"][0]["master_param"]
    assert masters.isfinite().all() and masters.abs().max() < 1e-37
    p.grad = torch.randn(N).bfloat16()
    opt.step()  # lr=0: the step keeps them
    assert opt.state_dict()["state"][0]["master_param"].abs().max() < 1e-37 and not p.data.any()
    opt.close()


def test_auto_keeps_whole_what_splitting_would_not_shrink():
    """Subgroups of 1024 params take 12 KiB split too (their low halves fill a 4 KiB page): auto keeps
    them whole, whatever the cache holds; fp16 params are never split."""
    from fsdp_offload.cache import resolve_split_masters

    assert not SubgroupLayout([4096], 1024).split_saves and SubgroupLayout([4096], 2048).split_saves
    assert not resolve_split_masters("auto", "bfloat16", 1, 4, saves=False)
    assert resolve_split_masters("auto", "bfloat16", 1, 4, saves=True)
    assert resolve_split_masters("auto", "bfloat16", None, 4, saves=True)  # short of the minimum whole
    assert not resolve_split_masters("auto", "bfloat16", 4, 4, saves=True)
    assert not resolve_split_masters("auto", "float16", 1, 4, saves=True)
    assert resolve_split_masters(True, "bfloat16", 4, 4, saves=False)


def test_the_plan_command_says_where_masters_are_split(tmp_path, capsys):
    from fsdp_offload.plan import main

    common = [f"offload.tiers=[posix:{tmp_path}]", "train.device=cpu", "machine.host_gib=64", "machine.cpu_mparams_per_s=500"]
    assert main([*common, "offload.split_masters=true"]) == 0
    assert "split masters on every rank: the subgroups off the GPU held as their masters' low halves" in capsys.readouterr().out
    assert main([*common, "offload.split_masters=false"]) == 0
    assert "split masters" not in capsys.readouterr().out


def test_a_split_plan_predicts_its_kernel_at_the_split_steps_rate(tmp_path, capsys, monkeypatch):
    """The split step does more a param than the whole one: a plan that splits the masters predicts its kernel
    at the rate an earlier run's split steps had here (else the split step timed), and says which."""
    from fsdp_offload import update_costs as update_costs_module
    from fsdp_offload.plan import compose_plan_config, main, plan_from_config
    from fsdp_offload.update_costs import UpdateCosts
    from test_update_rate_learned import learn

    monkeypatch.setattr(update_costs_module, "time_update_costs", lambda *a, **kw: UpdateCosts())
    path, threads, numel = str(tmp_path / "p.json"), torch.get_num_threads(), 16384  # (the default recipe's, tiny_disk)
    learn(path, 1e9, threads=threads, numel=numel)
    learn(path, 0.25e9, threads=threads, numel=numel, kernel="torch-split", run="run-b")
    common = [f"offload.tiers=[posix:{tmp_path}]", "train.device=cpu", "machine.host_gib=64", "offload.kernel=torch",
              f"offload.bandwidth_profile={path}", f"train.cpu_threads={threads}"]  # fmt: skip
    assert main([*common, "offload.split_masters=true"]) == 0
    assert "CPU update 1000 M params/s per rank (250 on split masters, learned)" in capsys.readouterr().out
    plan, _ = plan_from_config(*compose_plan_config([*common, "offload.split_masters=true"]))
    assert plan.ranks[0].cpu_s == pytest.approx(plan.params / 0.25e9)  # every param updated on the CPU, split
    assert main([*common, "offload.split_masters=false"]) == 0
    assert "on split masters" not in capsys.readouterr().out
    assert main([*common, "offload.split_masters=true", "machine.cpu_mparams_per_s=500"]) == 0  # one stated rate for both
    assert "CPU update 500 M params/s per rank (500 on split masters, given)" in capsys.readouterr().out
    # the fixed costs go beside the rate the kernel is predicted at: a learned one already holds a call's cost
    beside = []
    monkeypatch.setattr(update_costs_module, "time_update_costs", lambda *a, **kw: beside.append(a[6]) or UpdateCosts())
    only_split = str(tmp_path / "q.json")
    learn(only_split, 0.25e9, threads=threads, numel=numel, kernel="torch-split")
    assert main([*common, "offload.split_masters=true", f"offload.bandwidth_profile={only_split}"]) == 0
    out = capsys.readouterr().out
    assert "(250 on split masters, learned)" in out and "CPU update rate: timed" in out and beside == [None], beside
