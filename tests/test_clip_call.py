"""`opt.clip_grad_norm_(max_norm)`, the call users write after backward, does what
`offload.max_grad_norm` does, bit for bit, on 2 gloo ranks (with grad accumulation and state on disk),
and returns the global norm torch would. Whatever else reads or writes the grads the hooks took (torch's
clip_grad_norm_ from any import path, get_total_norm, clip_grad_value_, a NaN check, an in-place
scale) raises an error naming opt.clip_grad_norm_, where it would otherwise see no grads and clip
nothing, silently (after any backward, however many a step takes); and a step whose backwards are not the
planned offload.micro_batches (one more, fewer, some dropped by a cleared p.grad) is exact all the same."""

from __future__ import annotations

import math
import os

import pytest
import torch
from dist_utils import optimizer_tensors, run_ranks
from torch.nn.utils import clip_grad_norm_  # bound at import time: no patch of torch.nn.utils could reach it
from torch.nn.utils.clip_grad import clip_grad_norm_ as clip_grad_norm_of_module
from test_fsdp import SG, batch, build_model, loss_of

from fsdp_offload import OffloadAdamW, OffloadConfig

MAX_NORM = 0.5


def train(rank: int, tier: str, configured: bool) -> tuple[list[float], list[float], list[torch.Tensor]]:
    os.makedirs(tier, exist_ok=True)
    model = build_model(rank)
    budget = (2 * 40 * SG + (6 * 40 + 4) * SG + 4 * 3 * SG * 4) / 2**30  # staging, grad sums and scratch, 4 slots
    cfg = OffloadConfig(tiers=[f"posix:{tier}"], host_budget_gb=budget, subgroup_numel=SG, kernel="torch", micro_batches=2,
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
            for read in GRAD_READERS:  # each would find no grad and clip nothing: each raises, naming ours
                with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_\(max_norm\)"):
                    read(model)
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


GRAD_READERS = [
    lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
    lambda model: clip_grad_norm_(model.parameters(), MAX_NORM),
    lambda model: clip_grad_norm_of_module(model.parameters(), MAX_NORM),
    lambda model: torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]),
    lambda model: torch.nn.utils.clip_grad_value_(model.parameters(), MAX_NORM),
    lambda model: any(bool(torch.isnan(p.grad).any()) for p in model.parameters()),
    lambda model: [p.grad.mul_(0.5) for p in model.parameters()],
]


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


def backwards_as_given(rank: int, micro_batches: int, batches: list[list[int]], clear_after: int | None = None):
    """Two steps of FSDP2 backwards over `batches[step]` on an optimizer planned for `micro_batches`,
    each clipped by opt.clip_grad_norm_ after torch's clip_grad_norm_ has refused to clip; `clear_after`:
    model.zero_grad() after that many backwards of each step. The norms and the state."""
    model = build_model(rank)
    opt = OffloadAdamW(model.parameters(), model=model, offload=OffloadConfig(subgroup_numel=SG, kernel="torch",
                                                                              micro_batches=micro_batches))  # fmt: skip
    norms = []
    for step_batches in batches:
        for n, b in enumerate(step_batches):
            if n == clear_after:
                model.zero_grad()  # as torch: the grads of the backwards before are dropped
            loss_of(model, batch(rank, b)).backward()
            with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_\(max_norm\)"):
                clip_grad_norm_(model.parameters(), MAX_NORM)  # after any backward, not only the planned last
        norms.append(float(opt.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    state = optimizer_tensors(opt)
    opt.close()
    return norms, state


def backwards_not_as_planned(rank: int, world: int, tmp: str) -> None:
    planned = backwards_as_given(rank, 2, [[0, 1], [2, 3]])
    assert all(n > MAX_NORM for n in planned[0])  # the clip bites
    cases = {
        "one more than planned (FSDP2 adds it to the held grad)": backwards_as_given(rank, 1, [[0, 1], [2, 3]]),
        "fewer than planned": backwards_as_given(rank, 3, [[0, 1], [2, 3]]),
        "p.grad cleared after the first": backwards_as_given(rank, 2, [[5, 0, 1], [6, 2, 3]], clear_after=1),
    }
    for name, (norms, state) in cases.items():
        assert norms == planned[0], f"{name}: norms {norms} vs {planned[0]}"
        assert all(torch.equal(a, b) for a, b in zip(state, planned[1])), f"{name}: the state differs"


def test_backwards_not_as_planned_are_summed_in_fp32_and_clipped_as_torch_would():
    """However many backwards a step takes (one beyond offload.micro_batches, fewer, or some dropped by
    a cleared p.grad), the step equals the planned one on the same grads, bit for bit, and torch's clip
    refuses after each of them rather than seeing no grad."""
    run_ranks(2, backwards_not_as_planned, _tmp())


def test_clip_call_before_backward_is_an_error():
    opt = OffloadAdamW([torch.nn.Parameter(torch.ones(8))], offload=OffloadConfig(kernel="torch"))
    with pytest.raises(RuntimeError, match="before any backward"):
        opt.clip_grad_norm_(1.0)
    opt.close()


def clipped_twice_or_early(rank: int, world: int) -> None:
    """Two clips in a step compose as torch's do (each clips the grads the last left: 0.2 then 0.3 is 0.2, and
    the second returns the clipped grads' norm); a clip before the step's last backward, whose grads torch
    would add unclipped, is refused at the step rather than clipping the whole sum."""
    results = []
    for clips in ((0.2,), (0.2, 0.3)):
        model = build_model(rank)
        opt = OffloadAdamW(model.parameters(), lr=3e-3, model=model,
                           offload=OffloadConfig(subgroup_numel=SG, kernel="torch", micro_batches=2))  # fmt: skip
        for micro in range(2):
            loss_of(model, batch(rank, micro)).backward()
        norms = [float(opt.clip_grad_norm_(c)) for c in clips]
        opt.step()
        results.append((norms, optimizer_tensors(opt)))
        opt.close()
    (once, state_once), (twice, state_twice) = results
    assert once[0] > 0.2 and twice[0] == once[0] and math.isclose(twice[1], 0.2, rel_tol=1e-5), (once, twice)
    assert all(torch.equal(a, b) for a, b in zip(state_once, state_twice))
    model = build_model(rank)
    opt = OffloadAdamW(model.parameters(), model=model, offload=OffloadConfig(subgroup_numel=SG, kernel="torch", micro_batches=2))
    loss_of(model, batch(rank, 0)).backward()
    opt.clip_grad_norm_(MAX_NORM)
    loss_of(model, batch(rank, 1)).backward()
    with pytest.raises(RuntimeError, match=r"grads came after clip_grad_norm_\(\) in this step"):
        opt.step()
    opt.zero_grad()  # drops them: the next step goes on
    loss_of(model, batch(rank, 2)).backward()
    opt.clip_grad_norm_(MAX_NORM)
    opt.step()
    opt.zero_grad()
    loss_of(model, batch(rank, 3)).backward()
    tight = float(opt.clip_grad_norm_(1e-3))
    model.zero_grad()  # the batch skipped: its grads, and the clip taken on them, go
    opt.step()  # nothing to step
    loss_of(model, batch(rank, 3)).backward()
    assert float(opt.clip_grad_norm_(MAX_NORM)) == tight  # the same grads' own norm, not one the dropped clip left
    opt.step()
    opt.close()


def test_clips_compose_as_torchs_and_one_before_a_backward_is_refused():
    run_ranks(2, clipped_twice_or_early)


def test_a_backward_after_a_clip_without_model_is_refused():
    """Without model=, a clip stages p.grad; a backward after it adds to p.grad, which torch would step with (the
    clipped part and the new one unclipped): the step refuses, where it would silently leave the backward out."""
    lin = torch.nn.Linear(8, 2)
    opt = OffloadAdamW(lin.parameters(), offload=OffloadConfig(kernel="torch"))
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    lin(x).float().pow(2).sum().backward()
    opt.clip_grad_norm_(1.0)
    lin(x).float().pow(2).sum().backward()
    with pytest.raises(RuntimeError, match=r"grads came after clip_grad_norm_\(\)"):
        opt.step()
    opt.zero_grad()
    lin(x).float().pow(2).sum().backward()
    opt.clip_grad_norm_(1.0)
    opt.step()  # a clip after the last backward: stepped
    assert opt.step_count == 1
    for after_clip in ("the grads dropped", "a param's first grad"):
        opt.zero_grad()
        lin(x).float().pow(2).sum().backward()
        if after_clip == "a param's first grad":
            lin.bias.grad = None
        opt.clip_grad_norm_(1.0)
        if after_clip == "the grads dropped":
            lin.zero_grad()  # torch steps nothing: the clipped grads are gone
        lin(x).float().pow(2).sum().backward()
        with pytest.raises(RuntimeError, match=r"grads came after clip_grad_norm_\(\)"):
            opt.step()
    opt.close()
