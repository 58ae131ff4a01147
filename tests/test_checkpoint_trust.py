"""A checkpoint never runs code on load: an object entry whose pickle has a side effect (here, creating
a file) is refused with a clear error, and the side effect does not happen. DCP's own load planner
would unpickle it with weights_only=False; load_checkpoint's planners load tensors and plain values only."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from fsdp_offload.checkpoint import load_checkpoint


class SideEffect:
    """Unpickling it creates `path`: what a crafted checkpoint could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.bad_input
@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
def test_a_pickle_with_a_side_effect_is_refused_without_running(tmp_path):
    model = torch.nn.Linear(4, 4)
    marker = tmp_path / "ran"
    step = tmp_path / "step_00000001"
    dcp.save({"model": get_model_state_dict(model), "rank0": SideEffect(str(marker))}, checkpoint_id=str(step / "model"))
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"checkpoint entry 'rank0' holds more than tensors and plain values"):
        load_checkpoint(str(step), model, optimizer)
    assert not marker.exists(), "the checkpoint's pickle ran"
    assert os.listdir(step / "model")  # the checkpoint is left as it was
