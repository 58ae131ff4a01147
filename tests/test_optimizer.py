"""OffloadAdamW on plain tensors: bit-exact with torch.optim.AdamW wherever the state lives.

The pure-torch kernel is the bit-exact one; the fused kernel has its own bound (test_kernels.py).
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.optim import lr_scheduler
from torch.optim.lr_scheduler import LRScheduler
from dist_utils import optimizer_tensors

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.optimizer_state import OffloadOptimizerState, StreamingLoadPlanner, StreamingSavePlanner
from fsdp_offload.storage import CorruptSubgroupError, TierError
from fsdp_offload.storage import posix as posix_mod

SHAPES = [(300, 37), (513,), (1000, 29), (7,), (2500,)]  # 43_120 elements: no multiple of 4096
SG = 4096  # subgroup elements: 11 subgroups, params span subgroup borders
SLOT = 10 * SG  # a subgroup's bf16 state held split (2 + 4 + 4 bytes a param)
FP16_SLOT = 12 * SG  # with fp16 params the masters are whole
STAGING = 2 * (10 * SG + 3072)  # bf16 staging bytes: 43_120 elements = 10 full subgroups + one of 2160 padded to 3072


def gib(nbytes: int) -> float:
    return nbytes / 2**30


def budget_for(slots: int) -> float:
    return gib(STAGING + slots * SLOT)


def make_params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def grads_for(step: int, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def groups(params: list[torch.Tensor]) -> list[dict]:
    """Two param groups with different lr and weight decay."""
    return [
        {"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
        {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0},
    ]


def step_lr(opt: torch.optim.Optimizer) -> LRScheduler:
    return lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def run_pair(cfg: OffloadConfig, steps: int = 6, scheduler: Callable[[torch.optim.Optimizer], LRScheduler] | None = None):
    init = make_params()
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = torch.optim.AdamW(groups(ref), foreach=False)
    opt = OffloadAdamW(groups(mine), offload=cfg)
    scheds = [scheduler(o) for o in (ref_opt, opt)] if scheduler else []
    for s in range(steps):
        for p, r, g in zip(mine, ref, grads_for(s)):
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
        for sch in scheds:
            sch.step()
    return opt, ref_opt, mine, ref


def assert_same_as_reference(opt, ref_opt, mine, ref) -> None:
    sd = opt.state_dict()["state"]
    for i, r in enumerate(ref):
        st = ref_opt.state[r]
        assert torch.equal(sd[i]["master_param"], r.data), f"param {i} master differs"
        assert torch.equal(sd[i]["exp_avg"], st["exp_avg"]), f"param {i} exp_avg differs"
        assert torch.equal(sd[i]["exp_avg_sq"], st["exp_avg_sq"]), f"param {i} exp_avg_sq differs"
        assert int(sd[i]["step"]) == int(st["step"])
        # opt.state[p] answers as torch's: the step at once, the moments read from the store on access
        mine_st = opt.state[mine[i]]
        assert set(mine_st) == {"step", "master_param", "exp_avg", "exp_avg_sq"} and int(mine_st["step"]) == int(st["step"])
        assert torch.equal(mine_st["exp_avg_sq"], st["exp_avg_sq"]) and torch.equal(mine_st["master_param"], r.data)
        assert mine[i].dtype == torch.bfloat16
        assert torch.equal(mine[i].data, r.data.to(torch.bfloat16)), f"param {i} bf16 copy differs"


@pytest.mark.parametrize(
    "where",
    ["all_in_cache", "all_on_disk", "mixed", "fixed_order", "fp32_grads_on_tier"],
)
def test_bit_exact_with_torch_adamw(tmp_path, where):
    cfg = {
        "all_in_cache": OffloadConfig(kernel="torch", subgroup_numel=SG),
        "all_on_disk": OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, prefetch=1, host_budget_gb=budget_for(2)),
        "mixed": OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, prefetch=2, host_budget_gb=budget_for(6)),
        "fixed_order": OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, update_order="fixed", host_budget_gb=budget_for(4)),
        "fp32_grads_on_tier": OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, grad_path="tier_fp32", host_budget_gb=budget_for(4)),
    }[where]
    opt, ref_opt, mine, ref = run_pair(cfg, scheduler=step_lr)
    assert_same_as_reference(opt, ref_opt, mine, ref)
    if cfg.tiers:
        assert opt.last_metrics.bytes_read[cfg.tiers[0]] > 0  # state really went through the disk
    if cfg.grad_path == "tier_fp32":  # and so did every FP32 grad, both ways
        fp32_grads = 4 * sum(sg.padded for sg in opt.layout.subgroups)
        assert opt.last_metrics.bytes_written[cfg.tiers[0]] > fp32_grads
        assert opt.last_metrics.bytes_read[cfg.tiers[0]] > fp32_grads
    opt.close()


def test_fp16_grads(tmp_path):
    init = make_params()
    ref = torch.nn.Parameter(init[2].clone())
    mine = torch.nn.Parameter(init[2].clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, foreach=False)
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, param_dtype="float16", loss_scale_init=1.0, host_budget_gb=gib(2 * 8 * SG + 3 * FP16_SLOT))
    opt = OffloadAdamW([mine], lr=1e-3, offload=cfg)
    for s in range(5):
        g = grads_for(s, torch.float16)[2]
        opt.scale_loss(torch.ones(()))  # (the grads stand for a loss scaled by the scale, 1.0 here)
        mine.grad, ref.grad = g, g.float()
        opt.step()
        ref_opt.step()
    assert mine.dtype == torch.float16
    assert torch.equal(opt.state_dict()["state"][0]["master_param"], ref.data)
    opt.close()


def test_fp16_grads_of_a_loss_not_scaled_are_refused_where_not_all_zero():
    """The step divides fp16 grads by the loss scale: grads of a plain loss.backward() would be divided silently."""
    mine = torch.nn.Parameter(make_params()[2].clone())
    opt = OffloadAdamW([mine], lr=1e-3, offload=OffloadConfig(kernel="torch", subgroup_numel=SG, param_dtype="float16"))
    mine.grad = torch.zeros_like(mine)  # as torch's state-dict API steps to build the state: let be
    opt.step()
    mine.grad = grads_for(0, torch.float16)[2]
    with pytest.raises(RuntimeError, match=r"did not scale.*loss scale \(now 65536\).*opt\.scale_loss\(loss\)\.backward\(\)"):
        opt.step()
    opt.zero_grad()
    opt.scale_loss(torch.ones(()))  # the next step's loss scaled: its grads are taken
    mine.grad = grads_for(1, torch.float16)[2]
    opt.param_groups[0]["amsgrad"] = True  # refused once the norm is taken: the retry takes the same grads
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
    del opt.param_groups[0]["amsgrad"]
    opt.step()
    assert opt.last_grad_norm is not None
    opt.zero_grad()
    opt.scale_loss(torch.ones(()))  # two micro-batches, one of them scaled
    for g in grads_for(2, torch.float16)[2], grads_for(3, torch.float16)[2]:
        opt.stage_grad(0, g)
    with pytest.raises(RuntimeError, match=r"come from 2 backwards and opt\.scale_loss\(\) scaled 1 losses"):
        opt.step()
    opt.close()


def test_alternating_order_reads_only_what_the_cache_misses(tmp_path):
    m, c = 11, 5
    reads = {}
    for order in ("alternating", "fixed"):
        cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, prefetch=2, update_order=order, host_budget_gb=budget_for(c))
        opt, *_ = run_pair(cfg, steps=1)
        per_step = []
        for s in range(1, 5):
            for p, g in zip(opt._params, grads_for(s)):
                p.grad = g
            opt.step()
            per_step.append((opt.last_metrics.subgroups_read, opt.last_metrics.subgroups_written, opt.last_metrics.cache_hits))
        reads[order] = per_step
        opt.close()
    assert reads["alternating"] == [(m - c, m - c, c)] * 4  # M - C subgroups moved each way, not M
    assert reads["fixed"] == [(m, m, 0)] * 4


def test_writes_and_reads_start_while_the_cached_subgroups_are_updated(tmp_path):
    m, c = 11, 8
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, prefetch=1, host_budget_gb=budget_for(c))
    opt, *_ = run_pair(cfg, steps=1)
    pipe = opt.store.pipeline
    visits, first_io_at = [0], []
    touch, write = pipe.cache.touch, pipe.tiers[0].write

    def counting_touch(sg):
        visits[0] += 1
        touch(sg)

    def noting_write(key, buf):
        first_io_at.append(visits[0])
        return write(key, buf)

    pipe.cache.touch, pipe.tiers[0].write = counting_touch, noting_write
    for p, g in zip(opt._params, grads_for(1)):
        p.grad = g
    opt.step()
    hits = opt.last_metrics.cache_hits
    opt.close()
    assert hits >= c - 1 and opt.last_metrics.subgroups_read == m - hits
    # the first cached subgroup updated is the first victim: its write (and the read behind it) starts
    # then, not when the update reaches the first subgroup to read, `hits` visits in
    assert first_io_at[0] == 1, first_io_at


def save_and_load(opt: OffloadAdamW, fresh: OffloadAdamW, via: str, path) -> None:
    """Moves `opt`'s state into `fresh`: gathered (state_dict) or streamed through DCP."""
    if via == "state_dict":
        fresh.load_state_dict(opt.state_dict())
        return
    dcp.save({"optim": OffloadOptimizerState(opt)}, checkpoint_id=str(path), planner=StreamingSavePlanner())
    dcp.load({"optim": OffloadOptimizerState(fresh)}, checkpoint_id=str(path), planner=StreamingLoadPlanner())


@pytest.mark.parametrize("via", ["state_dict", "dcp"])
def test_state_round_trip_into_fresh_optimizer_on_other_dirs(tmp_path, via):
    dir_a, dir_b = tmp_path / "a", tmp_path / "b"
    dir_a.mkdir()
    dir_b.mkdir()
    cfg_a = OffloadConfig(kernel="torch", tiers=[f"posix:{dir_a}"], subgroup_numel=SG, host_budget_gb=budget_for(3))
    cfg_b = OffloadConfig(kernel="torch", tiers=[f"posix:{dir_b}"], subgroup_numel=SG, host_budget_gb=budget_for(4), prefetch=1)
    init = make_params()
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    ref_opt = torch.optim.AdamW(groups(ref), foreach=False)
    opt = OffloadAdamW(groups(mine), offload=cfg_a)
    for s in range(7):
        if s == 3:
            fresh = [torch.nn.Parameter(torch.zeros(sh)) for sh in SHAPES]
            other = OffloadAdamW(groups(fresh), lr=0.5, offload=cfg_b)
            save_and_load(opt, other, via, tmp_path / "ck")
            opt.close()
            opt, mine = other, fresh
            assert opt.param_groups[0]["lr"] == 1e-2  # hyperparameters come back too
        for p, r, g in zip(mine, ref, grads_for(s)):
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


def fresh_pair(tmp_path):
    """OffloadAdamW with most state on disk, and torch AdamW, on the same initial params."""
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, host_budget_gb=budget_for(3))
    init = make_params()
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    return OffloadAdamW(groups(mine), offload=cfg), torch.optim.AdamW(groups(ref), foreach=False), mine, ref


def test_injected_enospc_during_flush_loses_nothing(tmp_path, monkeypatch):
    opt, ref_opt, mine, ref = fresh_pair(tmp_path)
    real_write = posix_mod.pwrite_all
    for s in range(5):
        for p, r, g in zip(mine, ref, grads_for(s)):
            p.grad, r.grad = g, g.float()
        if s in (1, 3):
            code = errno.ENOSPC if s == 1 else errno.EIO

            def failing(fd, view, offset, code=code):
                raise OSError(code, os.strerror(code))

            monkeypatch.setattr(posix_mod, "pwrite_all", failing)
            with pytest.raises(OSError) as info:
                opt.step()
            assert info.value.errno == code
            with pytest.raises(RuntimeError, match="call step\\(\\) again"):
                opt.state_dict()
            monkeypatch.setattr(posix_mod, "pwrite_all", real_write)  # the fault is gone
        opt.step()  # finishes the interrupted step, or takes a normal one
        ref_opt.step()
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_subgroup_file_is_reported_with_its_path(tmp_path, damage):
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, host_budget_gb=budget_for(3))
    params = [torch.nn.Parameter(t) for t in make_params()]
    opt = OffloadAdamW(groups(params), offload=cfg)
    path = opt.store.tiers[0].path
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(SLOT)  # only the first subgroup's slot survives
        else:
            f.seek(SLOT * 10 - 5000)  # inside a subgroup that lives on disk
            f.write(b"\xff" * 64)
    for p, g in zip(params, grads_for(0)):
        p.grad = g
    with pytest.raises(CorruptSubgroupError, match=str(path)):
        opt.step()
    opt.close()


def test_bad_inputs_fail_clearly(tmp_path):
    p = lambda: [torch.nn.Parameter(t) for t in make_params()]  # noqa: E731
    with pytest.raises(TierError, match="does not exist"):
        OffloadAdamW(p(), offload=OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}/missing"], subgroup_numel=SG, host_budget_gb=budget_for(3)))
    with pytest.raises(ValueError, match="unknown tier scheme 'nfs'"):
        OffloadAdamW(p(), offload=OffloadConfig(kernel="torch", tiers=["nfs:/x"], subgroup_numel=SG, host_budget_gb=budget_for(3)))
    with pytest.raises(ValueError, match=rf"below the pipeline's minimum of [0-9.]+ GiB \({STAGING + 3 * SLOT} bytes\).*3 slots"):
        OffloadAdamW(p(), offload=OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, host_budget_gb=budget_for(2)))
    with pytest.raises(ValueError, match="add a tier"):
        OffloadAdamW(p(), offload=OffloadConfig(kernel="torch", subgroup_numel=SG, host_budget_gb=budget_for(4)))
    with pytest.raises(ValueError, match="grad_path='tier_fp32' writes grads to a tier"):
        OffloadAdamW(p(), offload=OffloadConfig(kernel="torch", subgroup_numel=SG, grad_path="tier_fp32"))
    with pytest.raises(ValueError, match="grad_path='fp8'"):
        OffloadAdamW(p(), offload=OffloadConfig(kernel="torch", subgroup_numel=SG, grad_path="fp8"))
    with pytest.raises(ValueError, match="multiple of 1024"):
        OffloadAdamW(p(), offload=OffloadConfig(kernel="torch", subgroup_numel=1000))
    with pytest.raises(ValueError, match="is torch.bfloat16, not float32"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])

    params = p()
    opt = OffloadAdamW(params, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
    opt.step()  # no grads: nothing to do, as torch's optimizers (tests/test_torch_idioms.py)
    assert opt.step_count == 0
    # torch itself refuses a .grad of another dtype or shape; hooks hand grads over through stage_grad
    with pytest.raises(TypeError, match="expects torch.bfloat16 grads"):
        opt.stage_grad(0, torch.zeros(SHAPES[0]))
    with pytest.raises(ValueError, match="shape \\(5,\\)"):
        opt.stage_grad(0, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="cannot be added later"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    opt.close()


def test_unwritable_tier_dir(tmp_path):
    if os.getuid() == 0:
        target = "/sys"  # root writes anywhere a mode allows: use a read-only file system
        if os.access(target, os.W_OK) and os.statvfs(target).f_flag & os.ST_RDONLY == 0:
            try:
                os.mkdir("/sys/fsdp-offload-probe")
                os.rmdir("/sys/fsdp-offload-probe")
                pytest.skip("running as root and /sys is writable: no unwritable dir to test with")
            except OSError:
                pass
    else:
        target = tmp_path / "ro"
        target.mkdir(mode=0o500)
    with pytest.raises(TierError, match=f"{target}"):
        OffloadAdamW(
            [torch.nn.Parameter(t) for t in make_params()],
            offload=OffloadConfig(kernel="torch", tiers=[f"posix:{target}"], subgroup_numel=SG, host_budget_gb=budget_for(3)),
        )


def test_tier_files_are_private_and_removed(tmp_path):
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, host_budget_gb=budget_for(3))
    opt = OffloadAdamW([torch.nn.Parameter(t) for t in make_params()], offload=cfg)
    path = opt.store.tiers[0].path
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    opt.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize("seed", range(12))
def test_random_layouts_caches_and_orders_match_torch(tmp_path, seed):
    """Random param sizes, cache sizes, prefetch depths, orders, missing grads and state_dict calls
    in the middle: every subgroup stays findable and the result is bit-exact."""
    import random

    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    sg = 1024
    shapes = [(rnd.randint(700, 3000),) for _ in range(rnd.randint(2, 6))]  # at least 2 subgroups
    n = sum(s[0] for s in shapes)
    m = -(-n // sg)
    padded = (m - 1) * sg + -(-(n - (m - 1) * sg) // 1024) * 1024
    prefetch = rnd.randint(0, min(3, m - 2))
    slots = rnd.randint(prefetch + 1, m - 1)  # at least one subgroup goes through the disk every step
    # (a split subgroup of 1024 takes 12 KiB too: its masters' low halves are padded to 4 KiB)
    cfg = OffloadConfig(
        kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=sg, prefetch=prefetch,
        host_budget_gb=gib(2 * padded + slots * 12 * sg), update_order=rnd.choice(["alternating", "fixed"]),
    )  # fmt: skip
    init = [torch.randn(s, generator=g) for s in shapes]
    mine = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = OffloadAdamW(mine, lr=1e-2, offload=cfg)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    read = 0
    for _ in range(4):
        with_grad = [rnd.random() < 0.8 for _ in shapes]
        with_grad[0] = True
        for p, r, has in zip(mine, ref, with_grad):
            grad = torch.randn(p.shape, generator=g).bfloat16() if has else None
            p.grad, r.grad = grad, None if grad is None else grad.float()
        opt.step()
        read += opt.last_metrics.subgroups_read
        ref_opt.step()
        if rnd.random() < 0.5:
            opt.state_dict()
    state = opt.state_dict()["state"]
    for i, r in enumerate(ref):
        assert torch.equal(state[i]["master_param"], r.data)
        assert torch.equal(mine[i].data, r.data.bfloat16())
    assert read > 0, "no subgroup went through the disk"
    opt.close()


def test_the_default_fused_kernel_matches_torch_adamw_end_to_end(tmp_path):
    """OffloadAdamW with the fused C++ kernel (the default where it builds), state streaming through a
    tier, against torch AdamW: moments bit for bit on any CPU (they depend on the grads only); params
    bit for bit where torch's sqrt is MKL's, which the kernel then uses too, else within the ulp bound of
    tests/test_kernels.py (a hardware sqrt differs from MKL's by at most 1 ulp)."""
    from fsdp_offload.kernels import cpu_adamw

    try:
        extension = cpu_adamw.load_extension()
    except Exception as exc:  # noqa: BLE001 - no compiler here: the kernel tests say so too
        pytest.skip(f"the fused kernel does not build here: {exc}")
    cfg = OffloadConfig(kernel="fused", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, host_budget_gb=budget_for(3))
    opt, ref_opt, mine, ref = run_pair(cfg)
    assert opt.kernel_name == "fused"
    state = opt.state_dict()["state"]
    for i, r in enumerate(ref):
        st = ref_opt.state[r]
        assert torch.equal(state[i]["exp_avg"], st["exp_avg"]) and torch.equal(state[i]["exp_avg_sq"], st["exp_avg_sq"])
        if extension.has_mkl_sqrt():
            assert torch.equal(state[i]["master_param"], r.data), f"param {i} master differs"
        else:
            torch.testing.assert_close(state[i]["master_param"], r.data, rtol=4 * 2**-23, atol=1e-7)
    opt.close()


def test_retry_after_a_failure_between_update_and_write_back_updates_once(tmp_path, monkeypatch):
    opt, ref_opt, mine, ref = fresh_pair(tmp_path)
    real = opt.grads.staging.copy_params_to_model
    calls = {"n": 0}

    def flaky(sg, params):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected copy failure")
        real(sg, params)

    for s in range(3):
        for p, r, g in zip(mine, ref, grads_for(s)):
            p.grad, r.grad = g, g.float()
        if s == 1:
            monkeypatch.setattr(opt.grads.staging, "copy_params_to_model", flaky)
            with pytest.raises(RuntimeError, match="injected"):
                opt.step()
            with pytest.raises(RuntimeError, match="call step\\(\\) again to finish it before the next backward"):
                opt.stage_grad(0, grads_for(s)[0])
        opt.step()
        ref_opt.step()
    assert_same_as_reference(opt, ref_opt, mine, ref)
    opt.close()


def test_a_retried_steps_kernel_time_is_its_own_try_s(tmp_path, monkeypatch):
    """cpu_kernel_s is the part of update_s spent in the CPU kernel: after a failed try, the retry's
    metrics count only the retry's kernels, as its update_s counts only the retry."""
    import time

    opt, _, mine, _ = fresh_pair(tmp_path)
    real_kernel, real_copy = opt.engine.cpu_kernel, opt.grads.staging.copy_params_to_model
    copies = {"n": 0}

    def slow_kernel(*args):
        time.sleep(0.05)
        real_kernel(*args)

    def failing_third(sg, params):
        copies["n"] += 1
        if copies["n"] == 3:
            raise RuntimeError("injected copy failure")
        real_copy(sg, params)

    monkeypatch.setattr(opt.engine, "cpu_kernel", slow_kernel)
    monkeypatch.setattr(opt.grads.staging, "copy_params_to_model", failing_third)
    for p, g in zip(mine, grads_for(0)):
        p.grad = g
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    opt.step()  # the retry: the subgroups the failed try had not updated
    m = opt.last_metrics
    assert 0 < m.cpu_kernel_s <= m.update_s, (m.cpu_kernel_s, m.update_s)
    opt.close()


def test_clip_norm_is_taken_per_param_as_grads_arrive():
    """The grad norm is each param's FP64 sum of squares, taken as its grad is staged (as the hook
    does in backward) and summed in param order; an accumulated grad's is taken at the step from its
    FP32 sum. Same value as the same sums taken on the grads directly; the update is clipped by it."""
    from fsdp_offload.grads import square_sum

    params = [torch.nn.Parameter(t) for t in make_params()]
    opt = OffloadAdamW(params, offload=OffloadConfig(kernel="torch", subgroup_numel=SG, max_grad_norm=0.05))
    once, twice = grads_for(0), grads_for(1)
    for i, g in enumerate(once):
        opt.stage_grad(i, g)
    opt.step()
    want = torch.stack([square_sum(g.reshape(-1)) for g in once]).sum()
    assert opt.last_grad_norm == float(want.sqrt()) > 0.05  # the clip bites
    assert opt.last_grad_norm == pytest.approx(sum(float(g.double().square().sum()) for g in once) ** 0.5, rel=1e-12)
    opt.zero_grad()
    for i, (a, b) in enumerate(zip(once, twice)):
        opt.stage_grad(i, a)
        opt.stage_grad(i, b)  # summed in FP32, as torch sums FP32 grads
    opt.step()
    accumulated = [a.float() + b.float() for a, b in zip(once, twice)]
    assert opt.last_grad_norm == float(torch.stack([square_sum(g.reshape(-1)) for g in accumulated]).sum().sqrt())
    opt.close()


def test_an_empty_local_shard_counts_for_nothing_in_the_norm():
    """FSDP2 leaves a rank an empty shard of a param whose dim 0 is below the world size: its grad adds
    nothing to the norm, whether it is taken at clip_grad_norm_() or from accumulated grads."""
    params = [torch.nn.Parameter(t) for t in make_params()] + [torch.nn.Parameter(torch.zeros(0))]
    opt = OffloadAdamW(params, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
    grads = grads_for(0) + [torch.zeros(0, dtype=torch.bfloat16)]
    for p, g in zip(params, grads):
        p.grad = g
    norm = opt.clip_grad_norm_(1e9)
    assert float(norm) == pytest.approx(sum(float(g.double().square().sum()) for g in grads) ** 0.5, rel=1e-12)
    opt.step()
    opt.close()


def leaf_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(t) for t in make_params()]


def test_host_budget_auto_takes_available_memory_less_headroom(tmp_path, monkeypatch, caplog):
    from fsdp_offload import memory

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    headroom = 0.5
    # available such that each of 2 local ranks gets the staging plus 5 slots
    monkeypatch.setattr(memory, "available_host_bytes", lambda: int(2 * (STAGING + 5 * SLOT) + headroom * 2**30))
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, host_budget_gb="auto", host_headroom_gb=headroom)
    with caplog.at_level("INFO", logger="fsdp_offload"):
        opt = OffloadAdamW(leaf_params(), offload=cfg)
    assert opt.store.cache.num_slots == 5
    assert "host_budget_gb=auto" in caplog.text and "over 2 local rank(s)" in caplog.text and "5 of 11 subgroups" in caplog.text
    opt.close()
    # the same node with all of it: every subgroup in memory, no tier needed
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 64 * 2**30)
    opt = OffloadAdamW(leaf_params(), offload=OffloadConfig(kernel="torch", subgroup_numel=SG, host_budget_gb="auto"))
    assert opt.store.cache.num_slots == 11
    opt.close()


def test_host_budget_auto_errors_name_what_it_measured(tmp_path, monkeypatch):
    from fsdp_offload import memory

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 2**30)
    with pytest.raises(ValueError, match=r"host_budget_gb=auto .*1.00 GiB available less host_headroom_gb=8.0.*lower offload.host_headroom_gb"):
        OffloadAdamW(leaf_params(), offload=OffloadConfig(kernel="torch", subgroup_numel=SG, host_budget_gb="auto"))
    monkeypatch.setattr(memory, "available_host_bytes", lambda: int(STAGING + 4 * SLOT + 0.25 * 2**30))
    with pytest.raises(ValueError, match=r"host_budget_gb=auto .* holds 4 of 11 subgroups and no tier"):
        OffloadAdamW(leaf_params(), offload=OffloadConfig(kernel="torch", subgroup_numel=SG, host_budget_gb="auto", host_headroom_gb=0.25))
    with pytest.raises(ValueError, match="'auto', or null"):
        OffloadConfig(host_budget_gb="lots")


def test_fp32_grad_buffer_counts_towards_the_host_budget(tmp_path):
    base = dict(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, host_budget_gb=budget_for(5))
    plain = OffloadAdamW(leaf_params(), offload=OffloadConfig(**base))
    fp32 = OffloadAdamW(leaf_params(), offload=OffloadConfig(**base, grad_path="tier_fp32"))
    # its one buffer holds a subgroup's FP32 grads (4 bytes x SG): one 12-byte slot fewer fits
    assert (plain.store.cache.num_slots, fp32.store.cache.num_slots) == (5, 4)
    plain.close()
    fp32.close()


SCHEDULERS = {  # (OneCycleLR and CyclicLR cycle betas[0] as well as lr)
    "one_cycle": lambda o: lr_scheduler.OneCycleLR(o, max_lr=[1e-2, 3e-3], total_steps=10),
    "cyclic": lambda o: lr_scheduler.CyclicLR(o, base_lr=1e-4, max_lr=1e-2, step_size_up=2, base_momentum=0.8, max_momentum=0.95),
    "warm_restarts": lambda o: lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=1e-5),
    "warmup_then_cosine": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3), lr_scheduler.CosineAnnealingLR(o, T_max=5)], milestones=[3]),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_schedulers_step_as_torch_adamw(name):
    opt, ref_opt, mine, ref = run_pair(OffloadConfig(kernel="torch", subgroup_numel=SG), steps=8, scheduler=SCHEDULERS[name])
    assert_same_as_reference(opt, ref_opt, mine, ref)
    assert [g["betas"] for g in opt.param_groups] == [g["betas"] for g in ref_opt.param_groups]
    opt.close()


def test_torch_adamw_options_are_accepted_at_defaults_and_refused_by_name_otherwise():
    opt = OffloadAdamW(leaf_params(), amsgrad=False, maximize=False, foreach=None, capturable=False,
                       differentiable=False, fused=None, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))  # fmt: skip
    assert [float(opt.state[p]["step"]) for p in opt._params] == [0.0] * len(SHAPES)  # torch's tools see the state
    opt.close()
    for name, why in [("amsgrad", "fourth FP32 state"), ("maximize", "negate the loss"), ("foreach", "offload.kernel"),
                      ("fused", "offload.kernel"), ("capturable", "CUDA graph"), ("differentiable", "autograd")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"does not support {name}=True: .*{why}"):
            OffloadAdamW(leaf_params(), **{name: True})
        with pytest.raises(ValueError, match=f"does not support {name}=True"):
            OffloadAdamW([{"params": leaf_params(), name: True}])
    # a group key of torch's AdamW, True there: False is torch.optim.Adam's L2 decay, which would be stepped as AdamW's
    with pytest.raises(ValueError, match="does not support decoupled_weight_decay=False: .*Adam's L2 decay"):
        OffloadAdamW([{"params": leaf_params(), "decoupled_weight_decay": False}])
    OffloadAdamW([{"params": leaf_params(), "decoupled_weight_decay": True}], offload=OffloadConfig(kernel="torch", subgroup_numel=SG)).close()


def test_a_torch_adamw_option_set_on_a_group_after_construction_is_refused_at_the_step():
    """torch AdamW reads amsgrad/maximize from the group at each step; here they would be ignored, so
    the step refuses them, before anything changes, and goes on once they are unset."""
    params = leaf_params()
    opt = OffloadAdamW(params, lr=1e-2, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
    before = [t.clone() for t in optimizer_tensors(opt)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.param_groups[0]["maximize"] = True
    with pytest.raises(ValueError, match="does not support maximize=True: .*negate the loss"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(opt), before))
    opt.param_groups[0]["maximize"] = False
    opt.param_groups[0]["decoupled_weight_decay"] = False
    with pytest.raises(ValueError, match="does not support decoupled_weight_decay=False"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(opt), before))
    opt.param_groups[0]["decoupled_weight_decay"] = True
    opt.step()
    assert opt.step_count == 1 and not all(torch.equal(a, b) for a, b in zip(optimizer_tensors(opt), before))
    opt.close()


def test_a_tensor_lr_or_betas_is_stepped_as_its_float_and_said_so(caplog):
    """torch AdamW given a tensor lr does its step-size arithmetic in FP32 tensors; here the value is read as a
    float, as torch steps a float lr: the same bits as that, and a warning that says so."""
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(SHAPES)]
    stepped = []
    as_tensors = (torch.tensor(1e-2), (torch.tensor(0.9), torch.tensor(0.99)))  # (FP32 values: 1e-2 is 0.00999999977...)
    as_floats = (float(as_tensors[0]), tuple(float(b) for b in as_tensors[1]))
    for lr, betas in (as_floats, as_tensors):
        params = leaf_params()
        with caplog.at_level(logging.WARNING):
            opt = OffloadAdamW(params, lr=lr, betas=betas, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype)
        opt.step()
        stepped.append([t.clone() for t in optimizer_tensors(opt)])
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(*stepped))
    assert "lr and betas given as a tensor: each step reads its value as a float" in caplog.text


def test_a_second_optimizer_on_a_cast_model_says_what_happened():
    params = leaf_params()
    first = OffloadAdamW(params, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
    with pytest.raises(ValueError, match="an earlier OffloadAdamW cast this model and holds its FP32 master weights"):
        OffloadAdamW(params, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
    first.close()


def test_host_budget_takes_sizes_as_people_write_them(tmp_path):
    base = dict(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG)
    opt = OffloadAdamW(leaf_params(), offload=OffloadConfig(**base, host_budget_gb=f"{(STAGING + 4 * SLOT) / 2**10}KiB"))
    assert opt.store.cache.num_slots == 4
    opt.close()
    minimum = (STAGING + 3 * SLOT) / 2**20
    with pytest.raises(ValueError, match=rf"host_budget_gb=0.2MiB is below the pipeline's minimum of {minimum:.4g} MiB"):
        OffloadAdamW(leaf_params(), offload=OffloadConfig(**base, host_budget_gb="0.2MiB"))
    with pytest.raises(ValueError, match="units KiB, MiB, GiB"):
        OffloadConfig(host_budget_gb="6 gigs")


def test_offload_options_as_a_dict():
    opt = OffloadAdamW(leaf_params(), offload={"kernel": "torch", "subgroup_numel": SG, "tiers": []})
    assert opt.offload.subgroup_numel == SG and len(opt.layout) == 11
    opt.close()
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['tierz'\]"):
        OffloadAdamW(leaf_params(), offload={"tierz": []})
    with pytest.raises(TypeError, match="not str"):
        OffloadAdamW(leaf_params(), offload="posix:/tmp")


def test_a_killed_runs_tier_file_is_removed_at_the_next_start_and_no_live_one(tmp_path):
    cfg = OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, host_budget_gb=budget_for(3))
    # a process of rank 0 that builds its optimizer and is killed: its file stays behind
    code = ("import os, signal, torch; from fsdp_offload import OffloadAdamW, OffloadConfig;"
            f"OffloadAdamW([torch.nn.Parameter(torch.ones(43120))], offload=OffloadConfig(kernel='torch', "
            f"tiers=['posix:{tmp_path}'], subgroup_numel={SG}, host_budget_gb={budget_for(3)}));"
            "os.kill(os.getpid(), signal.SIGKILL)")  # fmt: skip
    subprocess.run([sys.executable, "-c", code])
    leftovers = list(tmp_path.rglob("rank0-*-pid*.subgroups"))
    assert len(leftovers) == 1
    live = OffloadAdamW(leaf_params(), offload=cfg)  # a live rank-0 optimizer: removes the dead one's file
    assert not leftovers[0].exists()
    other = OffloadAdamW(leaf_params(), offload=cfg)  # another live one of the same rank keeps its file
    assert Path(live.store.tiers[0].path).exists() and Path(other.store.tiers[0].path).exists()
    live.close()
    other.close()
