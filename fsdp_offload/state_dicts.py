"""OffloadAdamW's state as torch's tools see it: state dicts, `opt.state[p]`, the FP32 export, and the
counters a DCP checkpoint keeps beside its subgroups.

`OptimizerStates` gathers the FP32 masters and moments from wherever the store keeps them (one
subgroup at a time, in host memory) and writes them back the same way, rewriting the model's
low-precision params from the restored masters. It always runs between steps: `settle` waits for the
update in flight and refuses a step that stopped part-way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .fsdp import CopyStream, local_data, reshard_gathered
from .order import order_ending_with
from .read_only import ReadOnlyState
from .step_engine import StepEngine
from .store import STATE_KEYS

META_KEY = "fsdp_offload"  # the first param group's entry for the offload's own counters


class OptimizerStates:
    """The state-dict family of one OffloadAdamW (its face delegates here)."""

    def __init__(self, engine: StepEngine, param_groups: list[dict[str, Any]], copies: CopyStream, settle: Callable[[], None],
                 units: list[list[torch.nn.Module]]) -> None:  # fmt: skip
        self.engine, self.param_groups, self.copies, self.settle = engine, param_groups, copies, settle
        self.units = units  # the FSDP units holding the params (none without model=)
        self.store, self.params = engine.store, engine.params
        self.param_states = [ParamState(self, i) for i in range(len(self.params))]  # `opt.state[p]`, in param order
        self.restored_at: int | None = None  # the step count at the last load of this optimizer's state

    def pass_order(self) -> list[int]:
        """The order of a pass that is not a step (a fill, a gather): it leaves the host cache holding
        what the next step needs first."""
        return order_ending_with(self.engine.forward, self.engine.step_count, self.engine.cfg.update_order)

    @torch.no_grad()
    def load_params_from_master(self, sg: int, master: torch.Tensor) -> None:
        """The model's params in subgroup `sg` from its new FP32 masters, rounded (after a fill or a load)."""
        with self.copies.after_current():
            self.engine.grads.staging.load_params_from_master(sg, master, [local_data(p) for p in self.params])

    def before_model_load(self) -> bool:
        """Before a model load copies anything: between steps. Whether the masters are to follow it: not
        while a load of this optimizer's own state is in progress (one `dcp.load` of the model's and the
        optimizer's Statefuls loads the model in between), which writes the masters and then the params
        from them when it ends."""
        self.settle()
        return not self.store.loading

    @torch.no_grad()
    def load_masters(self, loaded: dict[int, torch.Tensor]) -> None:
        """The FP32 masters of the params a model load wrote (`loaded[i]`: param i's local part as
        loaded, `model_state_dicts.py`), as torch AdamW's params take a load; moments and step counts
        stay. Right after a load of this optimizer's own state (no step since), a lower-precision piece
        that the restored masters round to, as a whole, keeps them: that is the model's own state dict,
        which torch's set_state_dict loads after the optimizer's."""
        self.settle()
        subgroups = self.store.layout.subgroups
        keep_restored = self.restored_at == self.engine.step_count

        def write(sg: int, state: torch.Tensor) -> None:
            master = subgroups[sg].parts(state)[0]
            for seg in subgroups[sg].segments:
                if seg.param in loaded:
                    new, dst = loaded[seg.param].reshape(-1)[seg.in_param].to(master.device), master[seg.in_subgroup]
                    # a restored master that rounds to the loaded piece, as a whole, is kept (a different
                    # load differs somewhere in every piece: it is taken whole, as torch would)
                    if not (keep_restored and new.dtype != dst.dtype and torch.equal(dst.to(new.dtype), new)):
                        dst.copy_(new)

        touched = {sg for sg, sub in enumerate(subgroups) if any(seg.param in loaded for seg in sub.segments)}
        self.store.visit([sg for sg in self.pass_order() if sg in touched], write)

    @torch.no_grad()
    def param_state(self, index: int, key: str) -> torch.Tensor:
        """Param `index`'s `key` (one of STATE_KEYS), this rank's part read from wherever its subgroups
        live, shaped as the param (a DTensor for a sharded one)."""
        self.settle()
        p = self.params[index]
        out: list[dict[str, torch.Tensor]] = [{} for _ in self.params]
        out[index][key] = torch.empty(local_data(p).shape, dtype=torch.float32)
        self.store.gather(list(self.engine.subgroups_of[index]), out)  # (a pass reorders its list)
        return like_param(ReadOnlyState(out[index][key], key), p)

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        self.settle()
        out = [{k: torch.empty(local_data(p).shape, dtype=torch.float32) for k in STATE_KEYS} for p in self.params]
        self.store.gather(self.pass_order(), out)
        state = {
            i: {"step": torch.tensor(float(self.engine.steps[i])), **{k: like_param(t, p) for k, t in out[i].items()}}
            for i, p in enumerate(self.params)
        }
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        groups[0][META_KEY] = self.offload_meta()
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def full_fp32_state_dict(self, model: torch.nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
        """Every param of `model` by each of its names (a tied weight under each name, as
        `model.state_dict()` has it), whole, in host memory: this optimizer's FP32 masters, the model's
        own values (and dtype) for the params it does not own; then the persistent buffers, as they are."""
        self.settle()
        reshard_gathered(model.modules())  # read from the shards
        index = {id(p): i for i, p in enumerate(self.params)}
        named = list(model.named_parameters(remove_duplicate=False))
        missing = sorted(set(index.values()) - {index[id(p)] for _, p in named if id(p) in index})
        if missing:
            raise ValueError(f"params {missing[:5]} of this optimizer are not parameters of the model given")
        out = [{"master_param": torch.empty(local_data(p).shape, dtype=torch.float32)} for p in self.params]
        self.store.gather(self.pass_order(), out)
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
        full: dict[str, torch.Tensor] = {}
        whole: dict[int, torch.Tensor] = {}  # a tied param is gathered once
        for name, p in named:
            if id(p) not in whole:
                t = out[index[id(p)]]["master_param"] if id(p) in index else local_data(p).detach()
                if isinstance(p, DTensor):  # the local shard goes where the mesh's collectives run
                    t = like_param(t.to(local_data(p).device), p).full_tensor()
                whole[id(p)] = t.cpu() if id(p) in index else t.cpu().clone()
            if keep:
                full[name] = whole[id(p)]
        if keep:
            full.update({k: v.detach().cpu() for k, v in model.state_dict().items() if k not in full})
        return full

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.settle()
        groups = state_dict["param_groups"]
        self.check_groups([len(g["params"]) for g in groups])
        # params are matched by position: keys are indices from state_dict(), or the names torch's
        # distributed state-dict API gives them (in this optimizer's order)
        keys = [k for g in groups for k in g["params"]]
        state = [state_dict["state"].get(k, {}) for k in keys]
        for i, p in enumerate(self.params):
            want = tuple(local_data(p).shape)
            for key in ("step", *STATE_KEYS):
                if key not in state[i]:
                    torch_adamw = "exp_avg" in state[i]  # (torch AdamW's own moments)
                    raise ValueError(f"state_dict param {i} ({keys[i]!r}) has no {key!r}: it was not saved by OffloadAdamW"
                                     + (" (a torch AdamW checkpoint loads with fsdp_offload.torch_adamw_state.load_torch_adamw)"
                                        if torch_adamw else ""))  # fmt: skip
            for key in STATE_KEYS:
                got = tuple(local_data(state[i][key]).shape)
                if got != want:
                    raise ValueError(
                        f"state_dict param {i} ({keys[i]!r}) {key}: local shape {got}, expected {want} (another model or sharding?)"
                    )
            if bool((local_data(state[i]["exp_avg_sq"]) < 0).any()):  # (refused before anything is overwritten)
                raise ValueError(f"state_dict param {i} ({keys[i]!r}) exp_avg_sq holds negative values (a mean of squares "
                                 "never is): the state is corrupt")  # fmt: skip

        def flat(key: str) -> Callable[[int], torch.Tensor]:
            return lambda i: local_data(state[i][key]).reshape(-1).to(torch.float32)

        self.begin_load()
        self.store.fill(self.pass_order(), {key: flat(key) for key in STATE_KEYS}, then=self.load_params_from_master)
        self.end_load(
            [{k: v for k, v in g.items() if k not in ("params", META_KEY)} for g in groups],
            [int(s["step"]) for s in state],
            groups[0].get(META_KEY) or state_dict.get("offload", {}),  # (state dicts saved before it moved)
        )

    def check_groups(self, sizes: list[int]) -> None:
        mine = [len(g["params"]) for g in self.param_groups]
        if sizes != mine:
            raise ValueError(
                f"the saved state has param groups of sizes {sizes}, this optimizer {mine}: it was saved from "
                "another model or another split of params into groups"
            )

    def begin_load(self) -> None:
        """Before a load overwrites subgroups (`store.overwrite`): until it ends, the optimizer refuses to step."""
        self.settle()
        self.copies.wait_host()  # the last step's copies to the model still read the staging buffer
        reshard_gathered(m for unit in self.units for m in unit)  # the load writes the shards
        self.engine.grads.clear()
        self.store.begin_load()

    def end_load(self, groups: list[dict], steps: list[int], meta: dict[str, Any]) -> None:
        """After every subgroup (and the model's params) was rewritten: takes the saved hyperparameters
        and counters."""
        self.store.end_load()
        self.engine.grads.clear()
        self.engine.params_written()
        self.copies.current_waits()  # a model load right after (set_state_dict's) copies after these param writes
        for mine, g in zip(self.param_groups, groups):
            mine.update(g)
        self.engine.steps = list(steps)
        self.engine.step_count = int(meta.get("step_count", 0))
        self.engine.grads.load_state_dict(meta.get("loss_scaler"))
        if meta.get("placement"):
            self.store.placement.load_state_dict(meta["placement"])
        self.restored_at = self.engine.step_count

    def offload_meta(self) -> dict[str, Any]:
        return {"step_count": self.engine.step_count, "loss_scaler": self.engine.grads.state_dict(),
                "placement": self.store.placement.state_dict()}  # fmt: skip

    def checkpoint_meta(self) -> dict[str, Any]:
        self.settle()
        self.store.require_loaded()
        return {
            "layout": self.store.layout_signature(),
            "steps": list(self.engine.steps),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "group_sizes": [len(g["params"]) for g in self.param_groups],
            "offload": self.offload_meta(),
        }

    def load_checkpoint_meta(self, meta: dict[str, Any]) -> None:
        self.store.check_layout(meta["layout"])
        self.check_groups(meta["group_sizes"])
        self.end_load(meta["param_groups"], meta["steps"], meta["offload"])


class ParamStates(dict):
    """`opt.state` of an OffloadAdamW: each param's ParamState, read only. Clearing it or deleting a param's
    entry, as code resetting torch AdamW's moments does, would change nothing here (the state lives in
    the store): it raises, naming the way that does reset them. A param it does not hold reads as {}, as
    torch's defaultdict reads, and is not added."""

    def __missing__(self, key: object) -> dict:
        return {}

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "opt.state is read-only: OffloadAdamW's state lives out of core, and changing opt.state would not change it "
            "(a cleared or deleted entry would not restart the moments as torch AdamW's would). To reset the moments, set "
            "'exp_avg', 'exp_avg_sq' and 'step' to zeros in opt.state_dict() and load it with opt.load_state_dict()"
        )

    __setitem__ = __delitem__ = clear = pop = popitem = update = setdefault = __ior__ = _refuse

    def __reduce__(self) -> tuple:  # a copy (copy.copy, deepcopy, pickle) is a plain dict of the same views
        return dict, (dict(self),)


class ReadOnlyStateAttr:
    """`opt.state` as an attribute that takes torch's own map at construction and then the optimizer's
    ParamStates, and refuses to be replaced after that (`opt.state = defaultdict(dict)`, as code resetting
    torch AdamW's moments does), at that line, leaving the optimizer as it was."""

    @property
    def state(self) -> Any:
        return self.__dict__["_state_map"]

    @state.setter
    def state(self, value: Any) -> None:
        if isinstance(self.__dict__.get("_state_map"), ParamStates):
            ParamStates._refuse(value)
        self.__dict__["_state_map"] = value


class ParamState(Mapping):
    """`opt.state[p]` of an OffloadAdamW: 'step' (a tensor, as torch's AdamW), and 'exp_avg',
    'exp_avg_sq' and 'master_param' read from the store on access. Each is a read-only copy
    (read_only.ReadOnlyState): a write to it raises, naming load_state_dict, instead of being lost."""

    def __init__(self, states: OptimizerStates, index: int) -> None:
        self._states, self._index = states, index

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == "step":
            self._states.engine.finish_update()  # the update in flight counts its step when it ends
            return ReadOnlyState(torch.tensor(float(self._states.engine.steps[self._index])), key)
        if key in STATE_KEYS:
            return self._states.param_state(self._index, key)
        raise KeyError(key)

    def __setitem__(self, key: str, value: object) -> None:
        raise TypeError(
            f"opt.state[p][{key!r}] = ...: OffloadAdamW's state lives out of core and opt.state[p] is read-only. "
            "To change the state, edit opt.state_dict() and load it back with opt.load_state_dict(state_dict)"
        )

    def __iter__(self):
        return iter(("step", *STATE_KEYS))

    def __len__(self) -> int:
        return 1 + len(STATE_KEYS)


def like_param(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`t` (the local part of a state tensor of `p`) shaped as `p`: a DTensor sharded like `p` when
    `p` is one."""
    if not isinstance(p, DTensor):
        return t
    # Built as FSDP2 builds its CPU-offloaded params: DTensor.from_local would copy `t` to the mesh's
    # device (all FP32 state onto the GPU); the local part stays where it is.
    spec = DTensorSpec(p.device_mesh, p.placements, tensor_meta=TensorMeta(p.shape, p.stride(), t.dtype))
    return DTensor(t.view(local_data(p).shape), spec, requires_grad=False)
