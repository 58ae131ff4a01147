"""Where the model's own state dicts meet OffloadAdamW: they wait for the update in flight, and weights
loaded into the model after the optimizer is built become its FP32 masters.

**Waits.** The update runs on a worker thread after `step()` returns. `model.state_dict()` (a
submodule's, torch's `get_model_state_dict`, a DCP save) would read half-updated params, and a load
would have the update write over the loaded values: a state-dict and a load pre-hook on every module
waits for it, only when it reads or loads.

**Loads.** Weights loaded into the model after the optimizer is built become its FP32 masters, as
torch AdamW's params would take them: torchtitan loads its initial checkpoint into the model after it
builds the optimizers, and a fine-tuning loop may load pretrained weights the same way
(`model.load_state_dict`, or torch's `set_model_state_dict`, which calls it). Before, the masters kept
the old values and the first `step()` wrote old values plus the update back over the loaded weights:
a silently different run whose first loss looked right. Each module that owns one of the optimizer's
params takes, in its load pre-hook, the value about to be copied into it (this rank's part, in the
value's own precision: an FP32 checkpoint stays FP32 in the masters although the model keeps bf16).
The load's outermost module writes them into the masters in its post-hook, one pass over the
subgroups they live in. Moments and step counts stay, as torch leaves an optimizer's state when the
model is loaded. A value torch would not copy (a size mismatch, a missing key) is not taken, nor one
the param already holds exactly: the model's own bf16 state dict loaded back (torch's `set_state_dict`
loads the optimizer first, then the model) keeps the FP32 masters the optimizer load restored. Writes
that bypass `load_state_dict` (`p.data.copy_`, an init function after construction, `dcp.load` into
the model's tensors without `load_state_dict`) are not seen: load before building the optimizer, or
through `load_state_dict`.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from .fsdp import local_data


def loaded_part(value: object, param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of `value` as torch's load copies it into `param` (None where it would not: not a
    tensor, another shape)."""
    if isinstance(value, DTensor) and isinstance(param, DTensor):
        if value.device_mesh != param.device_mesh or value.placements != param.placements:
            value = value.redistribute(param.device_mesh, param.placements)
        value = value.to_local()
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.shape != local_data(param).shape:
        return None
    return value


def holds_already(param: torch.Tensor, part: torch.Tensor) -> bool:
    """Whether `param` already holds `part`'s values exactly (compared in the loaded precision): the
    model's own low-precision state dict loaded back, as torch's `set_state_dict` does after loading
    the optimizer, whose FP32 masters then stay."""
    return torch.equal(part, local_data(param).detach().to(part.device, part.dtype))


def install_model_state_dict_hooks(model: torch.nn.Module, params: list[torch.Tensor], finish_update: Callable[[], None],
                                   load_masters: Callable[[dict[int, torch.Tensor]], None]) -> list:  # fmt: skip
    """On every module of `model`: state-dict and load pre-hooks that wait for the update in flight
    (`finish_update`), and load hooks that hand the values loaded into `params` to `load_masters`
    ({param index: its loaded local part}) once the load ends. The hooks hold the optimizer weakly;
    once it is gone they do nothing."""
    owned = {id(p): i for i, p in enumerate(params)}
    finish, load = weakref.WeakMethod(finish_update), weakref.WeakMethod(load_masters)
    loaded: dict[int, torch.Tensor] = {}
    outermost: list[torch.nn.Module] = []  # the module whose load_state_dict() is running

    def wait(*_args: object) -> None:
        if (method := finish()) is not None:
            method()

    def take(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *_: object) -> None:
        wait()
        if prefix == "":  # the module load_state_dict() was called on (its children have prefixes)
            loaded.clear()
            outermost[:] = [module]
            if local_metadata.get("assign_to_params_buffers"):
                raise RuntimeError(
                    f"{type(module).__name__}.load_state_dict(assign=True) would replace the params OffloadAdamW "
                    "holds with the loaded tensors, which it does not know; load with assign=False (the default)"
                )
        for name, p in module._parameters.items():
            index = owned.get(id(p)) if p is not None else None
            if index is not None and prefix + name in state_dict:
                part = loaded_part(state_dict[prefix + name], p)
                if part is not None and not holds_already(p, part):
                    loaded[index] = part

    def give(module: torch.nn.Module, _incompatible_keys: object) -> None:
        if outermost and module is outermost[0]:
            taken = dict(loaded)
            loaded.clear()
            outermost.clear()
            if taken and (method := load()) is not None:
                method(taken)

    handles = []
    for m in model.modules():
        handles += [m.register_state_dict_pre_hook(wait), m.register_load_state_dict_pre_hook(take),
                    m.register_load_state_dict_post_hook(give)]  # fmt: skip
    return handles
