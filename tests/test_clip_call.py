"""`opt.clip_grad_norm_(max_norm)`, the call users write after backward, does what
`offload.max_grad_norm` does, bit for bit, on 2 gloo ranks (with grad accumulation and state on disk),
and returns the global norm torch would; torch's own clip_grad_norm_, which would silently clip nothing,
refuses the params whose grads the hooks took."""

from __future__ import annotations

import math
import os

import pytest
import torch
from dist_utils import optimizer_tensors, run_ranks
from test_fsdp import SG, batch, build_model, loss_of

from fsdp_offload import OffloadAdamW, OffloadConfig

MAX_NORM = 0.5


def train(rank: int, tier: str, configured: bool) -> tuple[list[float], list[float], list[torch.Tensor]]:
    os.makedirs(tier, exist_ok=True)
    model = build_model(rank)
    budget = (2 * 40 * SG + 4 * 3 * SG * 4) / 2**30
    cfg = OffloadConfig(tiers=[f"posix:{tier}"], host_budget_gb=budget, subgroup_numel=SG, kernel="torch",
                        max_grad_norm=MAX_NORM if configured else None)  # fmt: skip
    opt = OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model, offload=cfg)
    losses, norms = [], []
    for step in range(4):
        loss = 0.0
        for micro in range(2):
            part = loss_of(model, batch(rank, 2 * step + micro)) / 2
            part.backward()
            loss += part.item()
        if not configured:
            # torch's own call would find no p.grad, clip nothing and return 0: it refuses, naming ours
            for clip in (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_):
                with pytest.raises(RuntimeError, match=r"call opt.clip_grad_norm_\(max_norm\) instead"):
                    clip(model.parameters(), MAX_NORM)
            norm = opt.clip_grad_norm_(MAX_NORM)
            assert isinstance(norm, torch.Tensor) and norm.dim() == 0
            norms.append(float(norm))
        opt.step()
        if configured:
            norms.append(opt.last_grad_norm)
        opt.zero_grad()
        losses.append(loss)
    out = optimizer_tensors(opt)
    with pytest.raises(ValueError, match="L2 norm"):
        opt.clip_grad_norm_(1.0, norm_type=1.0)
    opt.close()
    return losses, norms, out


def worker(rank: int, world: int, tmp: str) -> None:
    configured = train(rank, f"{tmp}/a{rank}", True)
    called = train(rank, f"{tmp}/b{rank}", False)
    assert called[0] == configured[0], "losses differ"
    assert called[1] == configured[1], f"norms differ: {called[1]} vs {configured[1]}"
    assert all(math.isfinite(n) and n > MAX_NORM for n in called[1])  # the clip did something
    for i, (a, b) in enumerate(zip(called[2], configured[2])):
        assert torch.equal(a, b), f"state tensor {i} differs"


def test_clip_call_equals_configured_clipping():
    run_ranks(2, worker, _tmp())


def _tmp() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="clip-call-")


def test_clip_call_before_backward_is_an_error():
    opt = OffloadAdamW([torch.nn.Parameter(torch.ones(8))], offload=OffloadConfig(kernel="torch"))
    with pytest.raises(RuntimeError, match="before any backward"):
        opt.clip_grad_norm_(1.0)
    opt.close()
