"""The grad hooks hand an FSDP unit's grads over together (unit_grads.UnitGrads). No grad is lost or taken twice where a unit's
params do not all get a grad: a unit left incomplete goes over when the next unit's grad comes, or before
the step reads the grads; a second backward's grad for a param still held hands the first over first."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.fsdp import cast_params, local_data
from fsdp_offload.grads import square_sum
from fsdp_offload.unit_grads import UnitGrads


def test_a_unit_goes_over_when_its_last_grad_comes():
    handed = []
    units = UnitGrads([[0, 1, 2], [3, 4]], 5, lambda i, g, f: handed.append((i, f)))
    units.add(3, torch.ones(1), True)
    assert handed == []
    units.add(4, torch.ones(1), False)
    assert handed == [([3, 4], [True, False])]
    units.add(2, torch.ones(1), True)
    units.add(0, torch.ones(1), True)  # param 1 takes no grad: the unit stays incomplete ...
    assert len(handed) == 1
    units.add(3, torch.ones(1), True)  # ... until another unit's grad comes
    assert handed[1] == ([2, 0], [True, True])
    units.add(4, torch.ones(1), True)
    units.add(0, torch.ones(1), True)
    units.add(0, torch.ones(1), False)  # a second grad for a param held: the first goes over first
    assert handed[3] == ([0], [True])
    units.hand_over()  # before the step reads the grads
    assert handed[4] == ([0], [False])
    units.add(1, torch.ones(1), True)
    units.drop()  # zero_grad() or close()
    units.hand_over()
    assert len(handed) == 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.unused = nn.Parameter(torch.ones(8))  # in the block's FSDP unit, never in the forward: no grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, blocks: int, root_unused: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(16, 4)
        if root_unused:  # the root's unit, reduced last in backward (FSDP2's final callback), never completes
            self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sharded_net(blocks: int, per_block: bool, root_unused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    net = Net(blocks, root_unused)
    if per_block:
        for block in net.blocks:
            fully_shard(block)
    return fully_shard(net)


def data(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + 7 * rank + micro)
    return torch.randn(4, 16, generator=g), torch.randint(0, 4, (4,), generator=g)


def reference_norm(rank: int, blocks: int, per_block: bool, micro_batches: int) -> float:
    """The grads' global norm from the model's own bf16 grads (no hooks), summed in FP32 over micro-batches."""
    net = sharded_net(blocks, per_block)
    cast_params(net, torch.bfloat16)
    sums: list[torch.Tensor | None] = [None] * len(list(net.parameters()))
    for m in range(micro_batches):
        x, y = data(rank, m)
        F.cross_entropy(net(x.bfloat16()).float(), y).backward()
        for i, p in enumerate(net.parameters()):
            if p.grad is not None:
                g = local_data(p.grad).reshape(-1)
                sums[i] = g if sums[i] is None else sums[i].float() + g
            p.grad = None
    sq = torch.stack([square_sum(s) for s in sums if s is not None]).sum().reshape(1)
    dist.all_reduce(sq)
    return math.sqrt(float(sq))


def offload_norm(rank: int, blocks: int, per_block: bool, micro_batches: int) -> float:
    net = sharded_net(blocks, per_block)
    cfg = OffloadConfig(subgroup_numel=1 << 10, kernel="torch", micro_batches=micro_batches)
    opt = OffloadAdamW(net.parameters(), lr=1e-3, model=net, offload=cfg)
    for m in range(micro_batches):
        x, y = data(rank, m)
        F.cross_entropy(net(x.bfloat16()).float(), y).backward()
    norm = float(opt.clip_grad_norm_(1e9))
    opt.step()
    opt.zero_grad()
    opt.close()
    return norm


def norms_with_incomplete_units(rank: int, world: int) -> None:
    # blocks of their own units, each missing a grad; one unit for the whole net over two micro-batches,
    # whose second backward's grads come while the first's are still held
    for blocks, per_block, micro_batches in ((3, True, 1), (2, False, 2)):
        want = reference_norm(rank, blocks, per_block, micro_batches)
        got = offload_norm(rank, blocks, per_block, micro_batches)
        assert math.isclose(got, want, rel_tol=1e-6), (blocks, per_block, micro_batches, got, want)


def test_units_left_incomplete_lose_no_grad():
    run_ranks(2, norms_with_incomplete_units)


def test_grads_the_optimizer_refuses_stay_held():
    handed, refuse = [], [True]

    def hand_over(indices, grads, fresh):
        if refuse[0]:
            raise RuntimeError("step 3 stopped part-way")
        handed.append(indices)

    units = UnitGrads([[0, 1, 2]], 3, hand_over)
    units.add(0, torch.ones(1), True)
    units.add(1, torch.ones(1), True)
    try:
        units.add(2, torch.ones(1), True)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the refusal was not raised")
    refuse[0] = False
    units.hand_over()  # asked again (the step after): nothing was lost
    assert handed == [[0, 1, 2]]


def closure_steps(rank: int, world: int) -> None:
    """step(closure) hands over the closure's grads, a unit left incomplete included (one FSDP unit for the
    whole net, with a param that takes no grad): the same update as backward() then step()."""
    params = []
    for with_closure in (False, True):
        net = sharded_net(2, per_block=False)
        opt = OffloadAdamW(net.parameters(), lr=1e-2, model=net, offload=OffloadConfig(subgroup_numel=1 << 10, kernel="torch"))
        x, y = data(rank, 0)

        def closure() -> torch.Tensor:
            loss = F.cross_entropy(net(x.bfloat16()).float(), y)
            loss.backward()
            return loss

        if with_closure:
            opt.step(closure)
        else:
            closure()
            opt.step()
        opt.finish_update()
        params.append([local_data(p).clone() for p in net.parameters()])
        opt.close()
    before = [local_data(p) for p in sharded_net(2, per_block=False).parameters()]
    assert any(not torch.equal(a.bfloat16(), b) for a, b in zip(before, params[1]))  # the closure's step updated
    assert all(torch.equal(a, b) for a, b in zip(*params))


def test_a_step_with_a_closure_takes_the_grads_of_its_backward():
    run_ranks(2, closure_steps)


def backward_overlap_steps(rank: int, world: int) -> None:
    """overlap='backward' updates subgroups as their grads come in backward: a unit left incomplete that is the
    last to reduce (the root's) goes over at step(), not never; and a model.zero_grad() between that backward
    and step() is refused, however far the update got."""
    params = {}
    for overlap in ("none", "backward"):
        net = sharded_net(2, per_block=True, root_unused=True)
        cfg = OffloadConfig(subgroup_numel=1 << 10, kernel="torch", overlap=overlap)
        opt = OffloadAdamW(net.parameters(), lr=1e-2, model=net, offload=cfg)
        x, y = data(rank, 0)
        F.cross_entropy(net(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.finish_update()
        params[overlap] = [local_data(p).clone() for p in net.parameters()]
        opt.zero_grad()
        F.cross_entropy(net(x.bfloat16()).float(), y).backward()
        net.zero_grad()  # torch: the step after it updates nothing
        try:
            opt.step()
        except RuntimeError as e:
            assert overlap == "backward" and "model.zero_grad() between backward and step()" in str(e), e
        else:
            assert overlap == "none", "overlap='backward' stepped after model.zero_grad()"
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(params["none"], params["backward"]))


def test_backward_overlap_takes_an_incomplete_unit_and_refuses_a_cleared_grad():
    run_ranks(2, backward_overlap_steps)


class TwoPaths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 4), nn.Linear(16, 4)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) if self.use_b else self.a(x)


def zeroed_then_unused(rank: int, world: int) -> None:
    """After zero_grad(set_to_none=False), a layer the next forward skips keeps a zeroed p.grad, and torch steps
    it with zeros (its weight decays): so does every overlap, 'backward' (whose update begins in backward) too."""
    results = {}
    for overlap in ("none", "next_forward", "backward"):
        torch.manual_seed(0)
        net = TwoPaths()
        for layer in (net.a, net.b):
            fully_shard(layer)
        fully_shard(net)
        opt = OffloadAdamW(net.parameters(), lr=1e-2, weight_decay=0.5, model=net,
                           offload=OffloadConfig(subgroup_numel=1 << 10, kernel="torch", overlap=overlap))  # fmt: skip
        for step in range(2):
            net.use_b = step == 0
            x, y = data(rank, step)
            F.cross_entropy(net(x.bfloat16()).float(), y).backward()
            opt.step()
            if step == 0:
                opt.finish_update()
                after_first = [local_data(p).clone() for p in net.b.parameters()]
            opt.zero_grad(set_to_none=False)
        opt.finish_update()
        assert opt.engine.steps == [2, 2, 2, 2], (overlap, opt.engine.steps)
        assert not all(torch.equal(a, local_data(p)) for a, p in zip(after_first, net.b.parameters())), overlap
        results[overlap] = [local_data(p).clone() for p in net.parameters()]
        opt.close()
    for overlap in ("next_forward", "backward"):
        assert all(torch.equal(a, b) for a, b in zip(results["none"], results[overlap])), overlap


def test_a_zeroed_grad_with_no_new_grad_steps_with_zeros_in_every_overlap():
    run_ranks(2, zeroed_then_unused)


def retry_with_grads_held(rank: int, world: int) -> None:
    """A step whose update raised part-way (overlap='none': in step() itself), then a backward for the next batch
    whose unit stays incomplete, so its grads stay held: step() refuses to retry over them, naming zero_grad(),
    where the retry would mark them consumed and the next zero_grad() drop them, unstepped and unsaid."""
    net = sharded_net(2, per_block=False)
    opt = OffloadAdamW(net.parameters(), lr=1e-2, model=net,
                       offload=OffloadConfig(subgroup_numel=1 << 10, kernel="torch", overlap="none"))  # fmt: skip
    update, failed = opt.engine.update_subgroup, []

    def flaky(sg: int, state: torch.Tensor, scale: float) -> None:
        if not failed and sg == opt.engine.forward[-1]:
            failed.append(sg)
            raise OSError("injected I/O error")
        update(sg, state, scale)

    opt.engine.update_subgroup = flaky
    x, y = data(rank, 0)
    F.cross_entropy(net(x.bfloat16()).float(), y).backward()
    try:
        opt.step()
    except OSError:
        pass
    else:
        raise AssertionError("the injected error did not surface")
    F.cross_entropy(net(x.bfloat16()).float(), y).backward()  # the next batch, before the step is finished
    try:
        opt.step()
    except RuntimeError as e:
        assert "stopped part-way" in str(e) and "opt.zero_grad() drops them" in str(e), e
    else:
        raise AssertionError("a retry consumed the next batch's grads")
    opt.zero_grad()
    opt.step()  # finishes the step that stopped
    assert opt.step_count == 1
    F.cross_entropy(net(x.bfloat16()).float(), y).backward()
    opt.step()
    assert opt.step_count == 2
    opt.close()


def test_a_retry_refuses_over_grads_held_for_the_next_step():
    run_ranks(1, retry_with_grads_held)


def zeros_then_retry(rank: int, world: int) -> None:
    """overlap='backward': a step() refused after zeros went in for a zeroed p.grad (here an lr changed since
    backward) goes on when called again; the zeros are not taken for a model.zero_grad() after backward."""
    torch.manual_seed(0)
    net = TwoPaths()
    for layer in (net.a, net.b):
        fully_shard(layer)
    fully_shard(net)
    opt = OffloadAdamW(net.parameters(), lr=1e-2, model=net,
                       offload=OffloadConfig(subgroup_numel=1 << 10, kernel="torch", overlap="backward"))  # fmt: skip
    x, y = data(rank, 0)
    F.cross_entropy(net(x.bfloat16()).float(), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    net.use_b = False
    F.cross_entropy(net(x.bfloat16()).float(), y).backward()
    opt.param_groups[0]["lr"] = 2e-2
    try:
        opt.step()
    except RuntimeError as e:
        assert "lr changed" in str(e), e
    else:
        raise AssertionError("the changed lr was not refused")
    opt.param_groups[0]["lr"] = 1e-2
    opt.step()
    opt.finish_update()
    assert opt.engine.steps == [2, 2, 2, 2]
    opt.close()


def test_a_step_called_again_after_zeros_went_in_goes_on():
    run_ranks(1, zeros_then_retry)
