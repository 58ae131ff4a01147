"""Where the forward's units cut the subgroups: pieces in order, each unit waiting for the last piece
of each subgroup that holds its params."""

from __future__ import annotations

from fsdp_offload.subgroups import SubgroupLayout
from fsdp_offload.unit_pieces import unit_pieces


def test_pieces_cut_where_the_unit_changes_and_each_unit_needs_its_last_piece():
    # params of units 0, 0, 1, (none), 2, 2 laid end to end, cut every 2048 elements
    layout = SubgroupLayout([1024, 512, 1024, 256, 1024, 2048], 2048)
    pieces = unit_pieces(layout, [0, 0, 1, None, 2, 2], 3)
    segs = [[(s.param, s.numel) for s in sg.segments] for sg in layout.subgroups]
    assert segs == [[(0, 1024), (1, 512), (2, 512)], [(2, 512), (3, 256), (4, 1024), (5, 256)], [(5, 1792)]]
    assert pieces.ends == ((2, 3), (2, 4), (1,))  # a param of no unit joins the piece before it
    assert [pieces.count(sg) for sg in range(3)] == [2, 2, 1]
    assert pieces.segments(0, 1) == slice(2, 3) and pieces.segments(1, 0) == slice(0, 2)
    assert pieces.needs == ({0: 0}, {0: 1, 1: 0}, {1: 1, 2: 0})
    assert pieces.unit_subgroups() == [frozenset({0}), frozenset({0, 1}), frozenset({1, 2})]


def test_a_unit_whose_params_are_apart_needs_the_later_piece():
    layout = SubgroupLayout([1024, 1024, 1024], 4096)
    pieces = unit_pieces(layout, [0, 1, 0], 2)
    assert pieces.ends == ((1, 2, 3),)
    assert pieces.needs == ({0: 2}, {0: 1})


def test_without_units_each_subgroup_is_one_piece():
    layout = SubgroupLayout([3000, 3000], 2048)
    pieces = unit_pieces(layout, [None, None], 0)
    assert [pieces.count(sg) for sg in range(len(layout))] == [1, 1, 1]
    assert pieces.needs == ()
