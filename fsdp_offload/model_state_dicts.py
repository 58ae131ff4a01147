"""Where the model's own state dicts meet OffloadAdamW: they wait for the update in flight, and weights
loaded into the model after the optimizer is built become its FP32 masters.

**Waits.** The update runs on a worker thread after `step()` returns. `model.state_dict()` (a
submodule's, torch's `get_model_state_dict`, a DCP save) would read half-updated params, and a load
would have the update write over the loaded values: a state-dict and a load pre-hook on every module
waits for it, only when it reads or loads.

**Loads.** Weights loaded into the model after the optimizer is built become its FP32 masters, as
torch AdamW's params would take them: a fine-tuning loop may load pretrained weights after building
the optimizer (`model.load_state_dict`, or torch's `set_model_state_dict`, which calls it), torchtitan
loads its initial checkpoint after it builds the optimizers, and a rollback loads a snapshot. Before,
the masters kept the old values and the first `step()` wrote them, plus the update, back over the
loaded weights: a silently different run whose first loss looked right.

- Each module that owns one of the optimizer's params takes, in its load pre-hook, the value about to
  be copied into it (this rank's part, in the value's own precision: an FP32 checkpoint stays FP32 in
  the masters although the model keeps bf16). Where torch refuses a value (a size mismatch, a plain
  tensor for a sharded param), it is not taken; the post-hook keeps only what torch did copy.
- The first of the model's modules a `load_state_dict()` reaches (the model, a submodule loaded
  alone, or the model under a parent such as `torch.compile`'s wrapper; a load nested in another's
  hooks is its own) checks, before anything is copied, that no step stopped part-way, reshards the
  FSDP2 units a forward without backward left unsharded (their unsharded params are not the
  optimizer's), and in its post-hook writes the values into the masters, one pass over the subgroups
  they live in. Moments and step counts stay, as torch leaves them.
- While a load of the optimizer's own state is in progress (one `dcp.load` of the model's and the
  optimizer's Statefuls loads the model in between), the masters do not follow: that load writes them,
  and then the params from them, when it ends.
- Right after a load of the optimizer's own state (no step since), a lower-precision piece of a param
  that the restored masters round to, as a whole, keeps them: torch's `set_state_dict` loads the
  optimizer's state, then the model's own bf16 state dict, whose values are the restored masters
  rounded. (Other bf16 weights loaded there keep the restored masters only in pieces that round alike
  as a whole, such as a norm's ones: within half a bf16 ulp of torch.)
- A load that someone else's hook stops part-way leaves the params it copied ahead of their masters;
  load again.
- Precision is the loaded value's: `dcp.load` into `get_model_state_dict(model)` (torchtitan) writes
  the checkpoint into the model's bf16 tensors before `load_state_dict` runs, so the masters then take
  those bf16 values. Writes that bypass `load_state_dict` altogether (`p.data.copy_`, an init function
  after construction, `dcp.load` into the model's tensors with no `load_state_dict` after) are not
  seen: load before building the optimizer, or through `load_state_dict`; after such a write,
  `model.load_state_dict(model.state_dict())` hands the model's values to the masters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch.distributed.tensor import DTensor

from .fsdp import local_data, reshard_gathered, weakly

if TYPE_CHECKING:
    from .state_dicts import OptimizerStates


def loaded_part(value: object, param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of `value` as torch's load would copy it into `param` (None where torch refuses:
    not a tensor, another (global) shape, a plain tensor for a DTensor param or the other way round)."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) != isinstance(param, DTensor) or value.shape != param.shape:
        return None
    if isinstance(value, DTensor):
        if value.device_mesh != param.device_mesh or value.placements != param.placements:
            value = value.redistribute(param.device_mesh, param.placements)
        value = value.to_local()
    return value


def copied(param: torch.Tensor, part: torch.Tensor) -> bool:
    """Whether torch's load did copy `part` into `param` (a copy it refused leaves another value; of tied
    names, the last one loaded is the one the param holds)."""
    local = local_data(param).detach()
    part = part.to(local.device, local.dtype)
    return bool(((local == part) | (local.isnan() & part.isnan())).all())  # NaN loaded is NaN held


def install_model_state_dict_hooks(model: torch.nn.Module, params: list[torch.Tensor], finish_update: Callable[[], None],
                                   states: OptimizerStates) -> list:  # fmt: skip
    """On every module of `model`: state-dict pre-hooks that wait for the update in flight
    (`finish_update`); load pre-hooks that call `states.before_model_load()` once a load, before
    anything is copied, and take the values loaded into `params`; load post-hooks that hand those torch
    copied to `states.load_masters` ({param index: its loaded local part}) once the load ends. The
    hooks hold the optimizer weakly; once it is gone they do nothing."""
    owned = {id(p): i for i, p in enumerate(params)}
    finish, check, load = (weakly(m) for m in (finish_update, states.before_model_load, states.load_masters))
    # Each running load_state_dict() by its missing_keys list (torch passes the same one to every module's
    # hooks of one call, and a new one to the next, nested or not): the first of our modules it reached,
    # whose post-hook comes after all the others' (the model itself, or a submodule loaded alone, under any
    # parent), and what it took (None: the masters are not to follow it).
    loads: dict[int, tuple[list, torch.nn.Module, dict[int, torch.Tensor] | None]] = {}  # id(missing_keys) -> its load

    def wait(*_args: object) -> None:
        finish()

    def take(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict, _strict: bool,
             missing_keys: list, *_: object) -> None:  # fmt: skip
        load_call = loads.get(id(missing_keys))
        if load_call is None or load_call[0] is not missing_keys:  # a new load (a nested one keeps the outer's)
            if local_metadata.get("assign_to_params_buffers"):
                raise RuntimeError(
                    f"{type(module).__name__}.load_state_dict(assign=True) would replace the params OffloadAdamW "
                    "holds with the loaded tensors, which it does not know; load with assign=False (the default)"
                )
            follow = bool(check())  # (False once the optimizer is gone)
            reshard_gathered(model.modules())  # the load writes the shards
            load_call = loads[id(missing_keys)] = (missing_keys, module, {} if follow else None)
        taken = load_call[2]
        if taken is None:
            return
        for name, p in module._parameters.items():
            index = owned.get(id(p)) if p is not None else None
            if index is not None and prefix + name in state_dict:
                part = loaded_part(state_dict[prefix + name], p)
                if part is not None:
                    taken[index] = part

    def give(module: torch.nn.Module, incompatible_keys: object) -> None:
        missing_keys = getattr(incompatible_keys, "missing_keys", None)
        load_call = loads.get(id(missing_keys))
        if load_call is None or load_call[0] is not missing_keys or module is not load_call[1]:
            return
        del loads[id(missing_keys)]
        loaded = {i: part for i, part in (load_call[2] or {}).items() if copied(params[i], part)}
        if loaded:
            load(loaded)

    handles = []
    for m in model.modules():
        handles += [m.register_state_dict_pre_hook(wait), m.register_load_state_dict_pre_hook(take),
                    m.register_load_state_dict_post_hook(give)]  # fmt: skip
    return handles
