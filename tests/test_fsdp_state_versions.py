"""What the optimizer reads of FSDP2's private state, as each supported torch keeps it: the gradient-sync
state (torch 2.13 a list of param groups, `_fsdp_param_groups`; torch 2.11 one group or None,
`_fsdp_param_group`: the CI's torch is one, the GPU machines' the other, where session 20 found every
FSDP2 model refused), and a unit's MixedPrecisionPolicy reduce dtype, said once where the grads do not
keep it."""

from __future__ import annotations

import logging
import types

import pytest
import torch
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


def test_a_reduce_dtype_the_grads_do_not_keep_is_said_once_naming_the_units(caplog):
    """torchtitan's MixedPrecisionPolicy(reduce_dtype=torch.float32): FSDP2 casts the reduced grads to
    the params' dtype, which the optimizer keeps in bf16, so the FP32 reduce reaches it as bf16."""
    from fsdp_offload.optimizer_args import check_unit_dtypes

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).to(torch.bfloat16)
    for module, reduce_dtype in zip(model, (torch.float32, None)):
        state = types.SimpleNamespace(_mp_policy=types.SimpleNamespace(reduce_dtype=reduce_dtype))
        module._get_fsdp_state = lambda state=state: state
    units = [([m], list(m.parameters())) for m in model]
    with caplog.at_level(logging.INFO, logger="fsdp_offload.optimizer_args"):
        check_unit_dtypes(model, units, list(model.parameters()), torch.bfloat16, "bfloat16")
    [record] = caplog.records
    assert "reduce their grads in torch.float32" in record.getMessage() and "torch.float32: Linear" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fsdp_offload.optimizer_args"):
        check_unit_dtypes(model, units[1:], list(model[1].parameters()), torch.bfloat16, "bfloat16")
    assert not caplog.records  # reduce_dtype unset: nothing to say
