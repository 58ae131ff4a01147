"""A unit's grads are copied into the staging buffer, and added to the FP32 sums, one run at a time
(staging.runs): pieces that lie end to end on one storage on both sides are one op, on the GPU one
launch of the backward's thread instead of one a param."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from test_unit_grads import data, sharded_net

from fsdp_offload.fsdp import cast_params, local_data
from fsdp_offload.grad_sums import GradSums
from fsdp_offload.held_grad import held_like, is_held
from fsdp_offload.staging import LowpStaging, copy_in_runs, runs
from fsdp_offload.subgroups import SubgroupLayout


def copies_made(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")


def test_pieces_end_to_end_on_both_sides_are_one_copy():
    src, dst = torch.arange(40.0), torch.zeros(40)
    srcs = [src[0:10], src[10:25], src[25:40]]
    dsts = [dst[0:10], dst[10:25], dst[25:40]]
    assert copies_made(lambda: copy_in_runs(dsts, srcs)) == 1
    assert torch.equal(dst, src)


def test_a_gap_or_another_allocation_starts_a_new_copy():
    src, dst, other = torch.arange(40.0), torch.zeros(40), torch.arange(100.0, 110.0)
    srcs = [src[0:10], src[10:20], src[25:35], other]  # a gap in the source after the second piece
    dsts = [dst[0:10], dst[10:20], dst[20:30], dst[30:40]]
    assert copies_made(lambda: copy_in_runs(dsts, srcs)) == 3
    assert torch.equal(dst, torch.cat([src[0:20], src[25:35], other]))


def test_a_strided_piece_is_not_merged_into_the_run_it_starts_after():
    src, dst = torch.arange(72.0).view(9, 8), torch.zeros(16)
    strided = src[1:, 0]  # starts where src[0] ends, a stride of 8
    copy_in_runs([dst[:8], dst[8:]], [src[0], strided])
    assert torch.equal(dst, torch.cat([src[0], strided]))


def _an_fsdp_units_grads_are_one_run(rank: int, world_size: int) -> None:
    net = sharded_net(2, per_block=True)
    cast_params(net, torch.bfloat16)
    lin = net.blocks[0].lin
    grads: dict[int, list[torch.Tensor]] = {0: [], 1: []}  # a unit's grads in each backward, as the optimizer takes them

    def take(grad: torch.Tensor) -> None:  # in the HeldGrad's dispatch, where a view made is not tracked (no `_base`)
        grads[1].append(grad.reshape(-1)[: grad.numel()])

    for p in (lin.weight, lin.bias):  # the first backward's from p.grad; then a HeldGrad there takes the second's
        p.register_post_accumulate_grad_hook(lambda p: is_held(p.grad) or grads[0].append(local_data(p.grad)))
    for micro in range(2):
        x, y = data(rank, micro)
        F.cross_entropy(net(x.bfloat16()).float(), y).backward()
        for p in (lin.weight, lin.bias):
            if not is_held(p.grad):
                p.grad = held_like(p.grad, 2, take, take)
    for taken in grads.values():
        sums = torch.zeros(sum(g.numel() for g in taken))
        pieces = list(sums.split([g.numel() for g in taken]))
        assert len(list(runs(pieces, taken))) == 1
        copy_in_runs(pieces, taken)
        assert torch.equal(sums, torch.cat([g.reshape(-1).float() for g in taken]))


def test_an_fsdp_units_grads_are_one_run():
    """FSDP2 views a unit's grads out of its reduce-scatter output. The grad it adds to a HeldGrad is taken in
    the HeldGrad's dispatch, below autograd, where a view of it has no `_base`. Both kinds are found to lie
    end to end: a unit's grads are one copy (or one add), not one a param."""
    run_ranks(2, _an_fsdp_units_grads_are_one_run)


def test_another_allocation_that_starts_where_a_run_ends_starts_a_new_copy():
    memory = bytearray(160)  # two storages end to end in memory, neither a view of the other
    a, b = (torch.frombuffer(memory, dtype=torch.float32, count=20, offset=offset) for offset in (0, 80))
    a.copy_(torch.arange(20.0)), b.copy_(torch.arange(20.0, 40.0))
    dst = torch.zeros(40)
    assert len(list(runs([dst[:20], dst[20:]], [a, b]))) == 2
    copy_in_runs([dst[:20], dst[20:]], [a, b])
    assert torch.equal(dst, torch.arange(40.0))


def test_a_source_of_another_size_fails_as_unmerged():
    src, dst = torch.arange(40.0), torch.zeros(30)
    with pytest.raises(RuntimeError):
        copy_in_runs([dst[:10], dst[10:]], [src[:10], src[10:14]])  # 4 elements for 20: not read on past them


def _a_units_later_grads_are_one_add(rank: int, world_size: int, subgroup_numel: int) -> None:
    net = sharded_net(2, per_block=True)
    cast_params(net, torch.bfloat16)
    lin = net.blocks[0].lin
    params = [lin.weight, lin.bias]
    layout = SubgroupLayout([local_data(p).numel() for p in params], subgroup_numel)
    sums = GradSums(layout, LowpStaging(layout, torch.bfloat16, pin=False), "gpu", torch.device("cpu"), frozenset(), planned=True)
    taken: list[torch.Tensor] = []
    adds: list[int] = []
    expected = [local_data(p).new_zeros(local_data(p).shape, dtype=torch.float32).reshape(-1) for p in params]

    def take(grad: torch.Tensor) -> None:  # in the HeldGrad's dispatch, where the hand-over adds a unit's grads
        taken.append(grad)
        if len(taken) == len(params):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                sums.add([0, 1], taken)
            adds.append(sum(e.count for e in prof.key_averages() if e.key == "aten::add_"))
            for i, g in enumerate(taken):
                expected[i] += g.float().reshape(-1)
            taken.clear()

    for micro in range(2):
        x, y = data(rank, micro)
        F.cross_entropy(net(x.bfloat16()).float(), y).backward()
        for i, p in enumerate(params):
            if not is_held(p.grad):  # the first micro-batch's grads start the sums
                sums.add([i], [local_data(p.grad)])
                expected[i] += local_data(p.grad).float().reshape(-1)
                p.grad = held_like(p.grad, 2, take, take)
    assert len(layout) == 1 and adds == [1]
    for i in range(len(params)):
        assert torch.equal(sums.param_sum(i), expected[i])


def test_a_units_later_grads_are_one_add():
    """The second micro-batch's grads of a unit (a 16x16 weight and its bias, sharded over 2 ranks), taken
    in the HeldGrad's dispatch, go into the FP32 sums in one add, not one a param."""
    run_ranks(2, _a_units_later_grads_are_one_add, 1 << 10)
