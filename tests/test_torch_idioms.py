"""torch idioms in a user's own loop give torch's answer or a clear error (issue #30).

On 2 gloo ranks, with the update in flight on a slow (throttled) tier: `model.state_dict()`, torch's
`get_model_state_dict`, a step post-hook (the optimizer's own and torch's global one) and an eval
forward all see the updated params, as with torch's AdamW, while a loop that reads nothing is not
made to wait; `full_fp32_state_dict()` works after an eval forward; step() consumes the grads, and a
backward after it with no zero_grad() (torch would sum into them) is refused, and so is a forward with
FSDP2's gradient sync off (its low-precision sums). A
frozen param passed in is refused before anything is cast, a trainable one left out beside cast params
is refused by name. On plain params: a step with no grads does nothing (said once), `opt.state[p]`
refuses writes, copy/pickle refuse clearly.
"""

from __future__ import annotations

import collections
import copy
import io
import logging
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_fsdp import SG, batch, build_model, loss_of
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.optim.optimizer import register_optimizer_step_post_hook

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import local_data
from fsdp_offload.held_grad import is_held


def slow_optimizer(model: torch.nn.Module, tier: str) -> OffloadAdamW:
    os.makedirs(tier, exist_ok=True)
    budget = (2 * 40 * SG + 3 * 3 * SG * 4) / 2**30  # most state on the tier, whose I/O is slowed down
    cfg = OffloadConfig(tiers=[f"throttle:posix:{tier}?read=8MB/s&write=8MB/s"], host_budget_gb=budget, subgroup_numel=SG,
                        kernel="torch")  # fmt: skip
    return OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model, offload=cfg)


def raw_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The local shards as they are now, read without waiting for anything."""
    return [local_data(p).detach().clone() for p in model.parameters()]


def step_on(model, opt, rank: int, step: int) -> list[torch.Tensor]:
    """zero_grad(), a backward and step(); the params before the step."""
    opt.zero_grad()
    loss_of(model, batch(rank, step)).backward()
    before = raw_params(model)
    opt.step()
    return before


def updated(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    assert sum(not torch.equal(a, b) for a, b in zip(before, after)) > len(after) // 2, "the step changed nothing"


def same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    stale = [i for i, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w)]
    assert not stale, f"{what}: {len(stale)} of {len(want)} params are not the updated ones"


def reads_after_step(rank: int, world: int, tmp: str) -> None:
    model = build_model(rank)
    opt = slow_optimizer(model, f"{tmp}/tier{rank}")
    step_on(model, opt, rank, 0)
    # nothing reads: step() returns with the update in flight (no extra wait in the training loop)
    assert opt.engine.inflight.busy
    assert all(is_held(p.grad) for p in model.parameters())  # consumed, until a zero_grad()
    # model.state_dict()
    before = step_on(model, opt, rank, 1)
    sd = [local_data(t).clone() for t in model.state_dict().values() if t.is_floating_point() and t.dtype == torch.bfloat16]
    opt.finish_update()
    updated(before, raw_params(model))
    same(sd, raw_params(model), "model.state_dict() right after step()")
    # torch's distributed state-dict API
    step_on(model, opt, rank, 2)
    msd = get_model_state_dict(model)
    got = [local_data(msd[name]).clone() for name, _ in model.named_parameters()]
    opt.finish_update()
    same(got, raw_params(model), "get_model_state_dict right after step()")
    # step post-hooks, the optimizer's and torch's global ones, run after the update
    seen: list[list[torch.Tensor]] = []
    for register in (opt.register_step_post_hook, register_optimizer_step_post_hook):
        handle = register(lambda o, args, kwargs: seen.append(raw_params(model)))
        before = step_on(model, opt, rank, 3)
        assert not opt.engine.inflight.busy  # the step waited, for the hook's sake
        updated(before, seen[-1])
        same(seen[-1], raw_params(model), f"a {register.__name__} hook")
        handle.remove()
    # an eval forward waits per FSDP unit for its params
    step_on(model, opt, rank, 4)
    model.eval()
    tokens = batch(rank, 9)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    opt.finish_update()
    with torch.no_grad():
        assert torch.equal(logits, model(tokens[:, :-1])), "the eval forward saw params of before the step"
    # the FP32 export after an eval forward (FSDP2 left the root unsharded)
    full = opt.full_fp32_state_dict()
    masters = {n: s["master_param"].full_tensor() for n, s in zip(dict(model.named_parameters()), opt.state_dict()["state"].values())}
    if rank == 0:
        assert set(full) == set(model.state_dict())
        for name, t in masters.items():
            assert torch.equal(full[name], t), name
    model.train()
    opt.close()


def backward_after_step(rank: int, world: int, tmp: str) -> None:
    clears = {"opt.zero_grad()": lambda model, opt: opt.zero_grad(), "model.zero_grad()": lambda model, opt: model.zero_grad(),
              "model.zero_grad(set_to_none=False)": lambda model, opt: model.zero_grad(set_to_none=False)}  # fmt: skip
    runs = {}
    for name, clear in [*clears.items(), ("no zero_grad()", None)]:
        model = build_model(rank)
        os.makedirs(f"{tmp}/tier{len(runs)}_{rank}")
        cfg = OffloadConfig(tiers=[f"posix:{tmp}/tier{len(runs)}_{rank}"], host_budget_gb=(2 * 40 * SG + 3 * 10 * SG) / 2**30,
                            subgroup_numel=SG, kernel="torch")  # fmt: skip
        opt = OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model, offload=cfg)
        losses = []
        for step in range(3):
            loss = loss_of(model, batch(rank, step))
            if clear is None and step == 1:  # torch would add these grads to step 0's: refused, naming the fix, by the
                loss.backward()  # step (raising in the hook would stop FSDP2's backward half-way)
                want = r"a backward after step\(\) with no zero_grad\(\) in between.*opt\.zero_grad\(\)"
                with pytest.raises(RuntimeError, match=want):
                    opt.clip_grad_norm_(1.0)
                with pytest.raises(RuntimeError, match=want):
                    opt.step()
                opt.zero_grad()  # then as the error says: that backward again, and on as a fixed loop goes
                clear = clears["opt.zero_grad()"]
                loss = loss_of(model, batch(rank, step))
            loss.backward()
            losses.append(loss.item())
            opt.step()
            assert all(is_held(p.grad) for p in model.parameters())  # consumed, not None: torch would still hold them
            if name == "no zero_grad()" and step == 2:  # a second step(): torch would step with them again. Refused, and
                with pytest.raises(RuntimeError, match=r"step\(\) again on the grads the last step used.*opt\.zero_grad\(\)"):
                    opt.step()  # nothing changed: this run equals the others below, bit for bit
            if clear is not None:
                clear(model, opt)
        opt.finish_update()
        runs[name] = (losses, raw_params(model))
        for other, (want_losses, want_params) in runs.items():  # each way of clearing: the same run, bit for bit
            assert losses == want_losses, (name, other)
            same(runs[name][1], want_params, f"{name} against {other}")
        opt.close()


def cleared_before_step(rank: int, world: int, tmp: str) -> None:
    def run(second: str) -> tuple[list[torch.Tensor], int]:
        model = build_model(rank)
        opt = OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model,
                           offload=OffloadConfig(kernel="torch", subgroup_numel=SG))  # fmt: skip
        loss_of(model, batch(rank, 0)).backward()
        opt.step()
        if second.endswith("no backward"):  # torch: every p.grad a zero tensor, and a step with them
            (opt.zero_grad if second.startswith("opt") else model.zero_grad)(set_to_none=False)
        else:
            opt.zero_grad()
            loss = loss_of(model, batch(rank, 1))
            (loss * 0 if second == "zero grads" else loss).backward()
        if second == "set to None":
            model.zero_grad()  # torch: these params take no step
        elif second == "zeroed":
            model.zero_grad(set_to_none=False)  # torch: a step with zero grads (moments decay, weight decay)
        opt.step()
        opt.finish_update()
        out = (raw_params(model), opt.step_count)
        opt.close()
        return out

    one_step, _ = run("set to None")
    zeroed, steps = run("zeroed")
    want, want_steps = run("zero grads")
    assert steps == want_steps == 2
    same(zeroed, want, "model.zero_grad(set_to_none=False) between backward and step()")
    for who in ("opt", "model"):  # zeroed at the last step's end, no grad since: stepped with zeros
        zeroed, steps = run(f"{who} zeroed, no backward")
        assert steps == 2, who
        same(zeroed, want, f"{who}.zero_grad(set_to_none=False), then a step with no backward")
    model = build_model(rank)
    opt = OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
    loss_of(model, batch(rank, 0)).backward()
    opt.step()
    opt.finish_update()
    same(one_step, raw_params(model), "model.zero_grad() between backward and step(): no second step")
    opt.close()


def cleared_grad_leaves_the_norm(rank: int, world: int, tmp: str) -> None:
    """With clipping, a p.grad set to None between backward and step() counts in no norm: the step clips by
    the same norm as with that grad zeroed (`p.grad.zero_()`), and every other param takes the same step."""

    def run(clear: str) -> tuple[float, list[torch.Tensor]]:
        model = build_model(rank)
        opt = OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.1, model=model,
                           offload=OffloadConfig(kernel="torch", subgroup_numel=SG, max_grad_norm=0.5))  # fmt: skip
        loss_of(model, batch(rank, 0)).backward()
        cleared = list(model.parameters())[3]
        if clear == "set to None":
            cleared.grad = None
        else:
            cleared.grad.zero_()
        opt.step()
        opt.finish_update()
        out = (opt.last_grad_norm, raw_params(model))
        opt.close()
        return out

    (norm, params), (want_norm, want) = run("set to None"), run("zeroed")
    assert norm == want_norm, (norm, want_norm)
    same(params[:3] + params[4:], want[:3] + want[4:], "the params beside one whose grad was set to None, with clipping")


def no_sync_accumulation(rank: int, world: int, tmp: str) -> None:
    model = build_model(rank)
    opt = OffloadAdamW(model.parameters(), lr=3e-3, model=model, offload=OffloadConfig(kernel="torch", subgroup_numel=SG, micro_batches=2))
    model.set_requires_gradient_sync(False)  # as accelerate's accumulate() does for all micro-batches but the last
    with torch.no_grad():
        loss_of(model, batch(rank, 0))  # an eval forward makes no grads: let be
    with pytest.raises(RuntimeError, match=r"gradient sync off.*Leave the sync on.*offload\.micro_batches, now 2.*sync_each_batch=True"):
        loss_of(model, batch(rank, 0))
    model.set_requires_gradient_sync(True)
    loss = loss_of(model, batch(rank, 0))
    model.set_requires_gradient_sync(False)  # off after the forward (accelerate's no_sync around backward alone)
    loss.backward()
    with pytest.raises(RuntimeError, match=r"a backward with FSDP2's gradient sync off"):
        opt.step()
    opt.close()
    # the sync off around one micro-batch's backward alone, on again before the next forward: that forward
    # refuses, before the next backward's reduce-scatter could carry the low-precision sum into the optimizer
    model = build_model(rank)
    opt = OffloadAdamW(model.parameters(), lr=3e-3, model=model, offload=OffloadConfig(kernel="torch", subgroup_numel=SG, micro_batches=2))
    loss = loss_of(model, batch(rank, 0))
    model.set_requires_gradient_sync(False)
    loss.backward()
    model.set_requires_gradient_sync(True)
    with torch.no_grad():
        loss_of(model, batch(rank, 1))  # an eval forward takes no grads: let be
    with pytest.raises(RuntimeError, match=r"a backward with FSDP2's gradient sync off.*reset_iter_state"):
        loss_of(model, batch(rank, 1))
    opt.zero_grad()  # drops what that backward left (the model's zero_grad sees the sharded params alone): trains on
    loss_of(model, batch(rank, 1)).backward()
    opt.step()
    opt.close()


class BiasLast(torch.nn.Module):
    """A block whose last op saves no tensor: its bias takes its grad before checkpointing's recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.bias = torch.nn.Linear(8, 8), torch.nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) + self.bias


def recompute_with_a_grad_in(rank: int, world: int, tmp: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(BiasLast(), BiasLast())
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, model=model, offload=OffloadConfig(kernel="torch", subgroup_numel=SG, micro_batches=2))
    for micro in range(2):
        h = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + micro)).bfloat16()
        for block in model:
            h = checkpoint(block, h, use_reentrant=False)
        h.float().sum().backward()  # the recompute's forward runs with the unit's bias grad in: no sync was off
    opt.step()
    opt.finish_update()
    assert opt.engine.step_count == 1
    opt.close()


def unit_left_to_another_optimizer(rank: int, world: int, tmp: str) -> None:
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("fsdp_offload.optimizer_args").addHandler(handler)
    cfg = OffloadConfig(kernel="torch", subgroup_numel=SG)
    model = build_model(rank)
    blocks = [p for name, p in model.named_parameters() if name.startswith("layers.")]  # the root's units are left out
    opt = OffloadAdamW(blocks, lr=3e-3, model=model, offload=cfg)
    assert said == []  # not at construction: another OffloadAdamW may cast those units yet
    with pytest.raises(RuntimeError):  # torch's own dtype error, which does not say why
        loss_of(model, batch(rank, 0))
    if rank == 0:  # said once, by rank 0, before it, naming the units and the fix
        assert len(said) == 1 and "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in said[0], said
        assert all(name in said[0] for name in ("tok_embeddings.weight", "norm.weight")), said  # (a unit by its first)
    else:
        assert said == []
    opt.close()
    said.clear()
    model = build_model(rank)  # the same units left to a second OffloadAdamW: nothing to say
    rest = [p for name, p in model.named_parameters() if not name.startswith("layers.")]
    first = OffloadAdamW([p for name, p in model.named_parameters() if name.startswith("layers.")], model=model, offload=cfg)
    second = OffloadAdamW(rest, model=model, offload=cfg)
    loss_of(model, batch(rank, 0)).backward()
    assert said == []
    first.close()
    second.close()


def frozen_params(rank: int, world: int, tmp: str) -> None:
    model = build_model(rank)
    frozen = model.layers[0].attention.wq.weight
    frozen.requires_grad_(False)
    values = local_data(frozen).clone()
    with pytest.raises(ValueError, match=r"param \d+ 'layers.0.attention.wq.weight' \(shape \(64, 64\)\) does not require grad"):
        OffloadAdamW(model.parameters(), model=model, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before anything was cast
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = OffloadAdamW(trainable, model=model, offload=OffloadConfig(kernel="torch", subgroup_numel=SG))
    assert frozen.dtype == torch.float32 and torch.equal(local_data(frozen), values)  # left as it was
    assert all(p.dtype == torch.bfloat16 for p in trainable)
    full = opt.full_fp32_state_dict(rank0_only=False)
    assert torch.equal(full["layers.0.attention.wq.weight"], frozen.full_tensor())  # exported with the rest
    opt.close()

    model = build_model(rank)
    left_out = model.layers[1].feed_forward.w1.weight  # requires grad, not the optimizer's, in a unit it casts
    with pytest.raises(ValueError, match=r"'layers.1.feed_forward.w1.weight' .* requires grad but is not in this optimizer"):
        OffloadAdamW([p for p in model.parameters() if p is not left_out], model=model,
                     offload=OffloadConfig(kernel="torch", subgroup_numel=SG))  # fmt: skip
    dist.barrier()


def test_reads_right_after_step_see_the_updated_params(tmp_path):
    run_ranks(2, reads_after_step, str(tmp_path))


def test_a_backward_after_step_needs_a_zero_grad_of_either_kind_first(tmp_path):
    run_ranks(2, backward_after_step, str(tmp_path))


def test_grads_the_model_clears_between_backward_and_step_are_followed_as_torch_would(tmp_path):
    run_ranks(2, cleared_before_step, str(tmp_path))


def test_a_grad_set_to_none_before_step_counts_in_no_clipping_norm(tmp_path):
    run_ranks(2, cleared_grad_leaves_the_norm, str(tmp_path))


def test_fsdp2_gradient_sync_off_is_refused_naming_the_optimizers_own_accumulation(tmp_path):
    run_ranks(2, no_sync_accumulation, str(tmp_path))


def test_activation_checkpointings_recompute_with_some_of_the_units_grads_in_is_let_be(tmp_path):
    run_ranks(2, recompute_with_a_grad_in, str(tmp_path))


def test_a_trainable_fp32_unit_left_to_another_optimizer_is_named_at_the_first_forward(tmp_path):
    run_ranks(2, unit_left_to_another_optimizer, str(tmp_path))


def test_frozen_params_are_left_as_they_are_and_exported(tmp_path):
    run_ranks(2, frozen_params, str(tmp_path))


def plain_optimizer() -> tuple[list[torch.nn.Parameter], OffloadAdamW]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((300, 7), (513,))]
    return params, OffloadAdamW(params, lr=1e-2, offload=OffloadConfig(kernel="torch", subgroup_numel=1024))


def backward(params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = torch.full_like(p, 0.5)


def test_step_without_grads_does_nothing_and_says_so_once(caplog):
    params, opt = plain_optimizer()
    before = [p.detach().clone() for p in params]
    with caplog.at_level(logging.WARNING, logger="fsdp_offload.torch_idioms"):
        opt.step()
        opt.step()
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "no grads" in caplog.records[0].message
    assert opt.step_count == 0 and all(torch.equal(p, b) for p, b in zip(params, before))
    backward(params)
    opt.step()  # and a step with grads after it updates
    assert opt.step_count == 1 and not torch.equal(params[0], before[0])
    opt.close()


def test_opt_state_is_read_only():
    params, opt = plain_optimizer()
    backward(params)
    opt.step()
    state = opt.state[params[0]]
    exp_avg = state["exp_avg"]
    assert torch.equal(exp_avg, opt.state_dict()["state"][0]["exp_avg"]) and float(state["step"]) == 1.0
    for write in (lambda: exp_avg.zero_(), lambda: exp_avg.view(-1).add_(1), lambda: exp_avg.detach().copy_(exp_avg + 1),
                  lambda: exp_avg.mul_(0.5), lambda: torch.add(exp_avg, 1, out=exp_avg)):  # fmt: skip
        with pytest.raises(RuntimeError, match=r"writes into opt.state\[p\]\['exp_avg'\].*opt.load_state_dict"):
            write()
    with pytest.raises(RuntimeError, match=r"opt.state\[p\]\['step'\]"):
        state["step"] += 1
    with pytest.raises(TypeError, match="read-only"):
        state["exp_avg"] = torch.zeros_like(exp_avg)
    assert torch.equal(opt.state[params[0]]["exp_avg"], exp_avg) and float(opt.state[params[0]]["step"]) == 1.0
    # what resets torch AdamW's moments would reset nothing here: refused, naming what does (helper-70)
    for reset in (lambda: opt.state.clear(), lambda: opt.state.pop(params[0]), lambda: opt.state.update({}),
                  lambda: opt.state.__delitem__(params[0]), lambda: opt.state.__setitem__(params[0], {})):  # fmt: skip
        with pytest.raises(RuntimeError, match=r"opt.state is read-only.*'exp_avg', 'exp_avg_sq' and 'step' to zeros"):
            reset()
    assert len(opt.state) == len(params) and opt.state[torch.nn.Parameter(torch.zeros(1))] == {}  # as torch's reads
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)  # saves plain tensors
    buffer.seek(0)
    assert type(torch.load(buffer)["exp_avg"]) is torch.Tensor
    with pytest.raises(RuntimeError, match="opt.state is read-only"):  # replaced: refused at that line, nothing changed
        opt.state = collections.defaultdict(dict)
    assert type(copy.copy(opt.state)) is dict and len(opt.state) == len(params)  # a copy is a plain dict
    opt.load_state_dict(opt.state_dict())  # the optimizer goes on as it was
    opt.close()


def test_copy_and_pickle_refused_clearly():
    _, opt = plain_optimizer()
    for copier in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled: .* load it into a new OffloadAdamW"):
            copier(opt)
    opt.close()


def test_params_swapped_as_accelerate_fsdp2_does_are_refused():
    """accelerate's FSDP2 prepare() swaps the optimizer's params for the shards it made (its own function,
    run here as prepare runs it): the step refuses, naming the flow and the fix. (accelerate's FSDP2 flow
    itself does not run on CPU: accelerate 1.15 enables FSDP only on GPU-like devices; building
    OffloadAdamW under its active FSDP2 plugin is refused at construction, refuse_accelerate_fsdp2.)"""
    fsdp_utils = pytest.importorskip("accelerate.utils.fsdp_utils", reason="pip install accelerate")
    params, opt = plain_optimizer()
    shards = [torch.nn.Parameter(p.detach().float()) for p in params]
    fsdp_utils.fsdp2_switch_optimizer_parameters(opt, {p.data_ptr: s for p, s in zip(params, shards)})
    for s in shards:
        s.grad = torch.ones_like(s)
    with pytest.raises(RuntimeError, match="other params than those OffloadAdamW was built on.*accelerate's FSDP2 flow.*fully_shard first"):
        opt.step()
    opt.close()
