"""FSDP2's gradient-sync state as each supported torch keeps it: torch 2.13 a list of param groups
(`_fsdp_param_groups`), torch 2.11 one group or None (`_fsdp_param_group`). The CI's torch is one of
them; the GPU machines' is the other, where session 20 found every FSDP2 model refused."""

from __future__ import annotations

import types

import pytest
from torch import nn

from fsdp_offload import fsdp


def unit_with(state: object) -> nn.Module:
    module = nn.Linear(2, 2)
    module._get_fsdp_state = lambda: state  # the one method fsdp._param_groups asks of a unit
    return module


def group() -> types.SimpleNamespace:
    return types.SimpleNamespace(reduce_grads=True, fsdp_params=[])


def test_param_groups_are_read_as_torch_2_13_keeps_them():
    groups = [group(), group()]
    assert fsdp._param_groups(unit_with(types.SimpleNamespace(_fsdp_param_groups=groups))) == groups


def test_param_groups_are_read_as_torch_2_11_keeps_them():
    one = group()
    assert fsdp._param_groups(unit_with(types.SimpleNamespace(_fsdp_param_group=one))) == [one]
    assert fsdp._param_groups(unit_with(types.SimpleNamespace(_fsdp_param_group=None))) == []  # a unit without params


def test_a_torch_that_keeps_them_elsewhere_is_refused_by_name():
    with pytest.raises(RuntimeError, match="keeps FSDP2's gradient-sync state elsewhere"):
        fsdp._param_groups(unit_with(types.SimpleNamespace()))
    with pytest.raises(RuntimeError, match="keeps FSDP2's gradient-sync state elsewhere"):
        fsdp._param_groups(unit_with(types.SimpleNamespace(_fsdp_param_groups=[object()])))
