"""Subgroups whose FP32 state stays on the GPU (offload.gpu_fraction), updated by the Triton kernel."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.optimizer_state import OffloadOptimizerState, StreamingLoadPlanner, StreamingSavePlanner

SG = 4096
SHAPES = [(300, 37), (513,), (1000, 29), (2500,)]  # 43_113 elements: 11 subgroups
STEPS = 5
LR = 1e-2
pytestmark = pytest.mark.gpu  # keeps the GPU visible to what it starts (conftest.py)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-resident state needs CUDA (and Triton)")


def config(tmp_path, **kw) -> OffloadConfig:
    # host budget: bf16 staging for all + 3 slots, so most host subgroups stream through the tier; the
    # grads in host memory unless a test says otherwise ("auto" would keep them on the GPU here)
    kw.setdefault("grad_path", "host_bf16")
    kw.setdefault("host_budget_gb", (2 * 11 * SG + 3 * 12 * SG) / 2**30)
    return OffloadConfig(kernel="torch", tiers=[f"posix:{tmp_path}"], subgroup_numel=SG, gpu_fraction=0.5, **kw)


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).bfloat16() for s in SHAPES]


def test_gpu_fraction_needs_cuda_params(tmp_path):
    with pytest.raises(ValueError, match="gpu_fraction=0.5 keeps state on the GPU, but the params are on cpu"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES], offload=config(tmp_path))
    with pytest.raises(ValueError, match="between 0 and 1"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4))], offload=OffloadConfig(gpu_fraction=1.5))


def ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x.abs(), torch.tensor(float("inf"))) - x.abs()


@needs_cuda
def test_gpu_resident_subgroups_track_torch_adamw(tmp_path):
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    mine = [torch.nn.Parameter(t.cuda()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = OffloadAdamW(mine, lr=LR, weight_decay=0.1, offload=config(tmp_path))
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.1, foreach=False)
    assert len(opt.store.gpu_state) == 6 and opt.store.cache.num_slots < len(opt.store.host_subgroups)  # some host state on disk
    for s in range(STEPS):
        for p, r, g in zip(mine, ref, grads(s)):
            p.grad, r.grad = g.cuda(), g.float()
        opt.step()
        ref_opt.step()
    state = opt.state_dict()["state"]
    on_gpu = torch.zeros(sum(t.numel() for t in init), dtype=torch.bool)
    for sg in opt.store.gpu_state:
        lo = sg * SG
        on_gpu[lo : lo + opt.layout.subgroups[sg].numel] = True
    master = torch.cat([state[i]["master_param"].flatten() for i in range(len(SHAPES))])
    want = torch.cat([r.data.flatten() for r in ref])
    assert torch.equal(master[~on_gpu], want[~on_gpu])  # host subgroups: the torch path, bit for bit
    # GPU subgroups: moments exact; params within 2 * steps ulp of max(|p|, lr) (sqrt rounding, see kernels)
    bound = 2 * STEPS * ulp(torch.maximum(want.abs(), torch.tensor(LR)))
    assert bool(((master - want).abs() <= bound)[on_gpu].all())
    m = torch.cat([state[i]["exp_avg"].flatten() for i in range(len(SHAPES))])
    assert torch.equal(m, torch.cat([ref_opt.state[r]["exp_avg"].flatten() for r in ref]))
    for p, i in zip(mine, range(len(SHAPES))):
        assert torch.equal(p.data.cpu(), state[i]["master_param"].bfloat16())
    opt.close()


@needs_cuda
def test_grad_path_auto_keeps_the_grads_on_the_gpu_where_the_cache_would_spill(tmp_path):
    """An optimizer built without a memory plan decides "auto" itself: a fixed GPU share, a host cache
    that spills with the grads in host memory, room on the GPU: the grads stay there, the cache gets
    their host memory, and every step is the same, bit for bit, as with the grads in host memory."""
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    opts = {}
    for path in ("auto", "host_bf16"):
        (tmp_path / path).mkdir()
        params = [torch.nn.Parameter(t.cuda()) for t in init]
        # gpu_fraction=0.5 keeps 6 of the 11 subgroups on the GPU; the budget holds the 5 others' bf16 grads
        # and 3 slots and a bit (3 slots), or two windows of one subgroup's grads and 4 slots (auto's choice);
        # the masters whole (12 bytes a param), which this sizing is of
        budget = (2 * 5 * SG + 3 * 12 * SG + 11 * SG) / 2**30
        offload = config(tmp_path / path, grad_path=path, host_budget_gb=budget, split_masters=False)
        opts[path] = (OffloadAdamW(params, lr=LR, weight_decay=0.1, offload=offload), params)
    (auto, auto_params), (host, host_params) = opts["auto"], opts["host_bf16"]
    assert (auto.grad_path, host.grad_path) == ("gpu_bf16", "host_bf16")
    assert (len(auto.store.gpu_state), len(host.store.gpu_state)) == (6, 6)
    assert (auto.store.cache.num_slots, host.store.cache.num_slots) == (4, 3)
    for s in range(STEPS):
        for p, q, g in zip(auto_params, host_params, grads(s)):
            p.grad, q.grad = g.cuda(), g.cuda()
        auto.step()
        host.step()
    a, h = auto.state_dict()["state"], host.state_dict()["state"]
    for i in range(len(SHAPES)):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[i][key], h[i][key]), (i, key)
        assert torch.equal(auto_params[i].data, host_params[i].data)
    auto.close()
    host.close()


def test_gpu_fraction_auto_on_cpu_keeps_state_off_the_gpu(tmp_path):
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = OffloadAdamW(params, offload=OffloadConfig(kernel="torch", subgroup_numel=SG, gpu_fraction="auto"))
    for s in range(2):
        for p, g in zip(params, grads(s)):
            p.grad = g
        opt.step()
    assert not opt.store.gpu_state and opt.last_metrics.subgroups_on_gpu == 0
    opt.close()


@needs_cuda
@pytest.mark.parametrize("grad_path", ["host_bf16", "gpu_bf16"])
@pytest.mark.parametrize("headroom_gb,moved", [(4.0, 11), (1e6, 0)])
def test_gpu_fraction_auto_moves_what_fits_after_the_first_step(tmp_path, headroom_gb, moved, grad_path):
    """After the first step, as many subgroups as fit (all 11 here; none with a headroom larger than the
    GPU) move to GPU memory, from the host cache and from the tier, and training goes on as before;
    with the grads in host memory or kept in GPU memory."""
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    mine = [torch.nn.Parameter(t.cuda()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    cfg = config(tmp_path, gpu_headroom_gb=headroom_gb, grad_path=grad_path)
    cfg.gpu_fraction = "auto"
    opt = OffloadAdamW(mine, lr=LR, weight_decay=0.1, offload=cfg)
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.1, foreach=False)
    slots = opt.store.cache.num_slots
    for s in range(STEPS):
        for p, r, g in zip(mine, ref, grads(s)):
            p.grad, r.grad = g.cuda(), g.float()
        opt.step()
        ref_opt.step()
        assert opt.last_metrics.subgroups_on_gpu == (0 if s == 0 else moved)
    assert opt.store.cache.num_slots == (0 if moved else slots)  # no subgroup left to cache: the slots went back
    state = opt.state_dict()["state"]
    master = torch.cat([state[i]["master_param"].flatten() for i in range(len(SHAPES))])
    want = torch.cat([r.data.flatten() for r in ref])
    if moved:  # updated by the Triton kernel from the second step on: within its ulp bound
        assert bool(((master - want).abs() <= 2 * STEPS * ulp(torch.maximum(want.abs(), torch.tensor(LR)))).all())
    else:
        assert torch.equal(master, want)
    m = torch.cat([state[i]["exp_avg"].flatten() for i in range(len(SHAPES))])
    assert torch.equal(m, torch.cat([ref_opt.state[r]["exp_avg"].flatten() for r in ref]))
    for p, i in zip(mine, range(len(SHAPES))):
        assert torch.equal(p.data.cpu(), state[i]["master_param"].bfloat16())
    opt.close()


def auto_pair(tmp_path):
    """An OffloadAdamW with gpu_fraction=auto that would move every subgroup, beside torch's AdamW."""
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    mine = [torch.nn.Parameter(t.cuda()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    cfg = config(tmp_path, gpu_headroom_gb=4.0)
    cfg.gpu_fraction = "auto"
    opt = OffloadAdamW(mine, lr=LR, weight_decay=0.1, offload=cfg)
    ref_opt = torch.optim.AdamW(ref, lr=LR, weight_decay=0.1, foreach=False)
    return opt, ref_opt, mine, ref


@needs_cuda
def test_a_move_to_the_gpu_that_fails_part_way_moves_nothing(tmp_path):
    """gpu_fraction=auto: a tier read failing after some subgroups were copied to the GPU (through a
    cached one's slot) leaves every subgroup where it was, that slot restored; the step raises the
    read's error, and its retry trains on off the GPU, bit for bit as torch AdamW."""
    opt, ref_opt, mine, ref = auto_pair(tmp_path)
    read, reads = opt.store.pipeline.read_stored, []

    def failing_second(sg: int, out: torch.Tensor) -> None:
        reads.append(sg)
        if len(reads) == 2:
            raise OSError(5, "Input/output error")
        read(sg, out)

    for s in range(STEPS):
        for p, r, g in zip(mine, ref, grads(s)):
            p.grad, r.grad = g.cuda(), g.float()
        if s == 1:
            opt.store.pipeline.read_stored = failing_second
            with pytest.raises(OSError, match="Input/output error"):
                opt.step()
            opt.store.pipeline.read_stored = read
            assert not opt.store.gpu_state and len(opt.store.host_subgroups) == len(opt.layout)
        opt.step()
        ref_opt.step()
        assert opt.last_metrics.subgroups_on_gpu == 0
    state = opt.state_dict()["state"]
    for i, r in enumerate(ref):
        assert torch.equal(state[i]["master_param"], r.data)
        assert torch.equal(state[i]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
    opt.close()


@needs_cuda
def test_a_move_to_the_gpu_that_runs_out_of_memory_warns_and_trains_on(tmp_path, caplog):
    """gpu_fraction=auto: out of GPU memory while moving (here at the state's copies, after the grad
    staging's device buffer was allocated), nothing moves, a warning says so, and training goes on off
    the GPU, bit for bit as torch AdamW."""
    import logging

    opt, ref_opt, mine, ref = auto_pair(tmp_path)

    def out_of_memory(count, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    opt.store.move_to_gpu = out_of_memory
    with caplog.at_level(logging.WARNING, logger="fsdp_offload"):
        for s in range(STEPS):
            for p, r, g in zip(mine, ref, grads(s)):
                p.grad, r.grad = g.cuda(), g.float()
            opt.step()
            ref_opt.step()
            assert opt.last_metrics.subgroups_on_gpu == 0
    assert any("ran out of memory" in r.getMessage() for r in caplog.records)
    assert opt.grads.staging.device_buffer is None  # the staging's device buffer was let go
    state = opt.state_dict()["state"]
    for i, r in enumerate(ref):
        assert torch.equal(state[i]["master_param"], r.data)
    opt.close()


@needs_cuda
def test_gpu_resident_state_survives_a_dcp_checkpoint(tmp_path):
    def run(split: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s).cuda()) for s in SHAPES]
        (tmp_path / "a").mkdir(exist_ok=True)
        opt = OffloadAdamW(params, lr=LR, offload=config(tmp_path / "a"))
        for s in range(STEPS):
            if split and s == 2:
                ck = str(tmp_path / "ck")
                dcp.save({"optim": OffloadOptimizerState(opt)}, checkpoint_id=ck, planner=StreamingSavePlanner())
                opt.close()
                params = [torch.nn.Parameter(torch.zeros(sh).cuda()) for sh in SHAPES]
                (tmp_path / "b").mkdir(exist_ok=True)
                opt = OffloadAdamW(params, lr=LR, offload=config(tmp_path / "b"))
                dcp.load({"optim": OffloadOptimizerState(opt)}, checkpoint_id=ck, planner=StreamingLoadPlanner())
            for p, g in zip(params, grads(s)):
                p.grad = g.cuda()
            opt.step()
        state = opt.state_dict()["state"]
        opt.close()
        return [state[i][k] for i in range(len(SHAPES)) for k in ("master_param", "exp_avg", "exp_avg_sq")]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
