"""Migration both ways between OffloadAdamW and torch.optim.AdamW checkpoints (DCP, FSDP2, through
torch's distributed state-dict API).

torch AdamW keeps `step`, `exp_avg` and `exp_avg_sq` per param, its FP32 params being the model's;
OffloadAdamW keeps the same plus `master_param`, the model holding bf16. So:

- into OffloadAdamW: load the FP32 model first (its params become the masters when the optimizer is
  built on it), then `load_torch_adamw(model, opt, path)` takes the moments and step counts;
- out to torch AdamW: `save_for_torch_adamw(model, opt, path)` writes {"model": FP32 masters (and the
  model's own values for what the optimizer does not own), "optim": torch AdamW's state dict}, which a
  torch loop loads with `get_*_state_dict` + `dcp.load` + `set_*_state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict

from .dcp_reader import SafeFileSystemReader
from .state_dicts import META_KEY

TORCH_KEYS = ("step", "exp_avg", "exp_avg_sq")  # what torch AdamW keeps per param
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")  # read from a torch checkpoint's groups


def torch_adamw_state_dict(model: torch.nn.Module, opt) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state dict, optimizer state dict) as a torch AdamW run on an FP32 copy of `model` has them
    through torch's distributed state-dict API: the model's entries with the FP32 masters for `opt`'s
    params, and per param `step`, `exp_avg`, `exp_avg_sq` keyed by name, the groups with every key
    torch AdamW's have. Sharded as the params (DTensors) under FSDP2, for `dcp.save`."""
    osd = get_optimizer_state_dict(model, opt)
    msd = get_model_state_dict(model)
    for name, state in osd["state"].items():
        msd[name] = state.pop("master_param")
    torch_defaults = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
    osd["param_groups"] = [
        {**{k: v for k, v in torch_defaults.items() if k != "params"}, **{k: v for k, v in g.items() if k != META_KEY}}
        for g in osd["param_groups"]
    ]  # fmt: skip
    return msd, osd


def save_for_torch_adamw(model: torch.nn.Module, opt, checkpoint_id: str) -> None:
    """Writes a DCP checkpoint {"model": ..., "optim": ...} that torch AdamW on the FP32 model loads
    (collective: every rank calls it)."""
    msd, osd = torch_adamw_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=checkpoint_id)


def load_torch_adamw(model: torch.nn.Module, opt, checkpoint_id: str, key: str = "optim") -> None:
    """Takes `step`, `exp_avg`, `exp_avg_sq` and the hyperparameters from the torch AdamW state saved
    under `key` of a DCP checkpoint (`get_optimizer_state_dict` of an FP32 model under FSDP2); the FP32
    masters stay those `opt` was built from: load the model's FP32 weights before building `opt`.
    Collective: every rank calls it."""
    osd = get_optimizer_state_dict(model, opt)  # the masters, and the shapes and shards to read into
    masters = {name: state["master_param"] for name, state in osd["state"].items()}
    saved_keys = SafeFileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    # torch >= 2.7 saves whether a group's weight decay is decoupled (AdamW) or L2 (Adam); older checkpoints lack the key
    decoupled = [f"{key}.param_groups.{i}.decoupled_weight_decay" in saved_keys for i in range(len(osd["param_groups"]))]
    template = {
        "state": {name: {k: state[k] for k in TORCH_KEYS} for name, state in osd["state"].items()},
        "param_groups": [{**{k: g[k] for k in HYPER_KEYS if k in g}, "amsgrad": False, "maximize": False,
                          **({"decoupled_weight_decay": True} if decoupled[i] else {}), "params": g["params"]}
                         for i, g in enumerate(osd["param_groups"])],
    }  # fmt: skip
    dcp.load({key: template}, storage_reader=SafeFileSystemReader(checkpoint_id))
    groups = []
    for i, (mine, saved) in enumerate(zip(osd["param_groups"], template["param_groups"])):
        for option in ("amsgrad", "maximize"):
            if saved.get(option):
                raise ValueError(f"{checkpoint_id}: the torch optimizer's param group {i} has {option}=True, which OffloadAdamW "
                                 "does not support (an AdamW with that option cannot be continued here)")  # fmt: skip
        if not saved.get("decoupled_weight_decay", True) and saved["weight_decay"] != 0:
            raise ValueError(f"{checkpoint_id}: the torch optimizer's param group {i} decays its weights as Adam does (L2, "
                             f"decoupled_weight_decay=False, weight_decay={saved['weight_decay']}): OffloadAdamW is AdamW, whose "
                             "decay is decoupled, so that run cannot be continued here as it was")  # fmt: skip
        groups.append({**mine, **{k: saved[k] for k in HYPER_KEYS[:4]}})
    state = {name: {**s, "master_param": masters[name]} for name, s in template["state"].items()}
    set_optimizer_state_dict(model, opt, {"state": state, "param_groups": groups})
