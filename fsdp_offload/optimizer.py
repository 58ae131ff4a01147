"""OffloadAdamW: AdamW whose FP32 master params and moments live out of core, in subgroups.

This is the face: torch's optimizer API and the wiring. The model keeps bf16 (or fp16) params; the
FP32 masters and Adam moments live in subgroups on the GPU, in a host cache or on storage tiers
(levels.py builds them; store.py owns where each lives). Backward's hooks hand each grad shard in
(fsdp.py); the step (step_engine.py) updates the subgroups and copies the new low-precision params
back, with an FSDP2 model on a worker thread while the next forward runs (overlap.py); state dicts
and the FP32 export are state_dicts.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable, Iterable

import torch

from .bandwidth import TierSpeed
from .closing import OwnedResources
from .config import OffloadConfig, offload_config
from .fsdp import (
    CAST_MARK, CopyStream, ModelHooks, cast_params, check_grads_synced, check_sharded_params, compute_device_type, fsdp_units,
    install_forward_waits, install_grad_hooks, install_sync_checks, local_data, mesh_group, reshard_gathered, root_fsdp_module,
    units_holding, weakly,
)  # fmt: skip
from .held_grad import consume_held_grads, refuse_backwards_after_step
from .kernels import get_adamw_kernel, triton_kernel, warm_up_gpu_kernel
from .levels import MemoryPlan, build_levels
from .metrics import StepMetrics
from .model_state_dicts import install_model_state_dict_hooks
from .node import says_once
from .optimizer_args import (
    TORCH_OPTIONS, check_hyperparameters, check_params, check_unit_dtypes, refuse_torch_options, warn_uncast_at_first_forward,
)  # fmt: skip
from .order import forward_order, order_ending_with
from .overlap import UpdateAborted, UpdateInFlight
from .state_dicts import OptimizerStates, ParamStates, ReadOnlyStateAttr
from .step_engine import StepEngine
from .subgroups import SubgroupLayout
from .torch_idioms import NoGradSteps, check_params_unswapped, follow_cleared_grads, hand_over_held_grads, has_step_post_hooks, refuse_copy, step_has_grads  # noqa: E501

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)


class OffloadAdamW(ReadOnlyStateAttr, torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with out-of-core FP32 state.

    Build it on the model's FP32 params: it takes their values as master weights and then casts those
    params (only those: frozen params keep their dtype and values) to `offload.param_dtype`, so the
    model (and the GPU) hold no FP32 copy of them. Grads must then arrive in that dtype. For an FSDP2
    model, the one line is

        optimizer = OffloadAdamW(model.parameters(), lr=3e-4, model=model, offload=OffloadConfig(...))

    which also hooks each sharded param so its grad shard goes to host memory as soon as it is reduced.

    `step()` consumes the grads: with model=, a backward after it with no `zero_grad()` in between
    (where torch would sum into the grads the step used) makes the next `step()` raise, naming
    `zero_grad()` (sum micro-batches within a step with `offload.micro_batches`). A step with no grads
    does nothing.
    The update runs after `step()` returns; what reads the params waits for it (a forward per FSDP
    unit, `model.state_dict()`, step post-hooks); code reading params directly calls `finish_update()`.

    `masters`: for a model already built in `offload.param_dtype` (never whole in FP32), the source of
    its FP32 master weights: `masters(p)` gives param p's local FP32 values (flat); it is asked in
    param order, a param once per subgroup it spans, and the model's params are set from what it gives
    (parallelize.StreamedMasters draws the init one module at a time).

    `tier_speeds` and `memory_plan` (levels.MemoryPlan: host budget, where grad sums go, the GPU share
    for gpu_fraction="auto"): the plan's, as train.py passes them, so nothing is measured twice; without
    them the tiers' speeds come from the profile or a measurement (tier_speeds.starting_speeds), the
    memory plan from the config and what is free now, and "auto" sizes the GPU share after step one.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        offload: OffloadConfig | Mapping | None = None,
        model: torch.nn.Module | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        masters: Callable[[torch.Tensor], torch.Tensor] | None = None,
        tier_speeds: list[TierSpeed] | None = None,
        memory_plan: MemoryPlan | None = None,
    ) -> None:
        refuse_torch_options(amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                             differentiable=differentiable, fused=fused)  # fmt: skip
        check_hyperparameters(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), "OffloadAdamW")
        if isinstance(params, torch.nn.Module):
            raise TypeError(
                f"OffloadAdamW takes the params (model.parameters() or param groups), not the {type(params).__name__} "
                "itself: OffloadAdamW(model.parameters(), model=model, ...)"
            )
        self._frozen = False
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._frozen = True
        self.offload = cfg = offload_config(offload)
        self.param_dtype = _DTYPES[cfg.param_dtype]
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._models = [] if model is None else [model]
        root, units = None if model is None else root_fsdp_module(model), []  # (first: a forward since leaves the root gathered)
        check_params(self._params, self._models, self.param_dtype, cfg.param_dtype, streamed=masters is not None)
        if model is not None:
            check_sharded_params(model, self._params)
            units = fsdp_units(model)
            check_unit_dtypes(model, units, self._params, self.param_dtype, cfg.param_dtype)
        elif any(hasattr(p, "device_mesh") for p in self._params):
            raise ValueError(
                "the params are FSDP2-sharded DTensors: pass model=model so OffloadAdamW can cast the model "
                "and hook its grad shards: OffloadAdamW(model.parameters(), ..., model=model)"
            )
        locals_ = [local_data(p) for p in self._params]
        device = locals_[0].device
        overlap = cfg.resolved_overlap(hooked=model is not None, model_on_cpu=compute_device_type(self._params) == "cpu")
        if cfg.overlap == "auto" and says_once():  # (the same on every rank)
            log.info("offload.overlap='auto': %s", overlap)
        self.layout = SubgroupLayout([t.numel() for t in locals_], cfg.subgroup_numel)  # (held split or whole: build_levels)
        index = {id(p): i for i, p in enumerate(self._params)}
        unit_subgroups = [
            frozenset(sg for p in params if id(p) in index for sg, _ in self.layout.param_segments[index[id(p)]])
            for _, params in units
        ]
        forward = forward_order(unit_subgroups, len(self.layout))
        first_pass = order_ending_with(forward, 0, cfg.update_order)  # the fill leaves the cache holding what step 1 needs first
        self.kernel_name, kernel = get_adamw_kernel(cfg.kernel)
        group = mesh_group(self._params)
        levels = build_levels(cfg, self.layout, forward, [t.shape for t in locals_], device, self.param_dtype, group, memory_plan,
                              tier_speeds)  # fmt: skip
        # closed in reverse: the update in flight ends, then the model's hooks go (a closed optimizer takes no
        # grads), then the copies land, before the buffers they read are freed
        self._owned = OwnedResources(self, device)
        self._owned.add(levels.staging, levels.sums, levels.store)
        self.layout, self.store, self.grads, self.grad_accumulation = levels.layout, levels.store, levels.grads, levels.grad_accumulation
        self.grad_path = levels.grad_path  # where the low-precision grads wait for their update (resolved)
        self._copies, self._hooks = CopyStream(device), ModelHooks(self._params)
        self._owned.add(self._copies, self._hooks)
        # None: step() updates every subgroup before it returns
        inflight = UpdateInFlight(unit_subgroups) if units and overlap != "none" else None
        self._owned.add(inflight)
        kernels = (kernel, triton_kernel() if self.store.gpu_state else None)
        self.engine = StepEngine(cfg, self.param_groups, self._params, self.layout, forward, self.store, self.grads, self._copies,
                                 kernels, inflight, overlap == "backward", root, levels.size_gpu_share_later, levels.rate_learner)  # fmt: skip
        if self.store.gpu_state:  # the GPU share reads FP32 sums where micro-batches are summed, else the staged grads
            warm_up_gpu_kernel(kernels[1], device, torch.float32 if cfg.micro_batches > 1 else self.param_dtype, self.param_dtype)
        self._sync_units: list[list[torch.nn.Module]] = units_holding(units, self._params)  # the FSDP units holding its params
        self._states = OptimizerStates(self.engine, self.param_groups, self._copies, self._settle, self._sync_units)
        if masters is None:  # the FP32 params are the masters
            flat = [t.detach().reshape(-1) for t in locals_]
            self.store.fill(first_pass, {"master_param": flat.__getitem__})  # moments start at zero
        else:  # in param order, as a streamed source draws them; the model's params follow the masters
            self.store.fill(list(range(len(self.layout))), {"master_param": lambda i: masters(self._params[i])},
                            then=self._states.load_params_from_master)  # fmt: skip
            self._copies.wait_host()
        self._no_grad_steps = NoGradSteps()
        if model is not None:
            if masters is None:
                cast_params(model, self.param_dtype, self._params)
            setattr(model, CAST_MARK, True)
            # the params must not keep the optimizer alive: the hooks call it weakly
            self._hooks.add(*install_grad_hooks(self._params, units, weakly(self._hooked_grads), cfg.micro_batches))
            self._hooks.add(install_sync_checks(self._sync_units, cfg.micro_batches), sync_units=self._sync_units)
            self._hooks.add(warn_uncast_at_first_forward(model, units, self._params, self.param_dtype))
            self._hooks.add(install_model_state_dict_hooks(model, self._params, self.engine.finish_update, self._states))
            if inflight is not None:
                self._hooks.add(install_forward_waits([modules for modules, _ in units], inflight.wait_unit))
        else:
            for p in self._params:
                if masters is None:
                    p.data = p.data.to(self.param_dtype)
                setattr(p, CAST_MARK, True)
        # `self.state[p]` answers as torch's AdamW's does; a non-empty `state` also tells torch's
        # distributed state-dict API that the state exists (it would otherwise run a zero-lr step)
        self.state = ParamStates(zip(self._params, self._states.param_states))  # (read-only: ReadOnlyStateAttr)

    def placement(self) -> dict[str, Any]:
        """Where this rank's subgroups live now: on the GPU, in host cache slots, and by tier (the one
        each would be written to), as the planner predicts it."""
        return self.store.placement_summary()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (a skipped fp16 step is not one)."""
        return self.engine.step_count

    @property
    def last_metrics(self) -> StepMetrics | None:
        """The last finished update's metrics."""
        return self.engine.last_metrics

    @property
    def skipped_steps(self) -> int:
        """fp16 steps skipped for inf/nan grads."""
        return self.engine.skipped_steps

    @property
    def loss_scaler(self):
        """The fp16 dynamic loss scaler (None with bf16)."""
        return self.grads.loss_scaler

    @property
    def last_grad_norm(self) -> float | None:
        return self.grads.last_norm

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_frozen", False):
            raise RuntimeError(
                "OffloadAdamW lays out its subgroups when it is built; params cannot be added later. "
                "Pass every param group to its constructor (OffloadAdamW([{'params': ...}, {'params': ..., 'lr': ...}], ...)); "
                "a param to unfreeze later goes in trainable, frozen after with p.requires_grad_(False)"
            )
        refuse_torch_options(**{k: param_group[k] for k in TORCH_OPTIONS if k in param_group})
        check_hyperparameters(param_group, f"param group {len(self.param_groups)}")
        super().add_param_group(param_group)

    # -- grads ----------------------------------------------------------------------------------

    def _hooked_grads(self, indices: list[int], grads: list[torch.Tensor], fresh: list[bool]) -> None:
        """An FSDP unit's grads from the hooks (unit_grads.UnitGrads). A fresh one that comes after the step's
        last planned grad found p.grad cleared (model.zero_grad(), p.grad = None): as torch, the param's
        earlier grads are dropped."""
        self._check_open()
        self.engine.stage_hooked_grads(indices, grads, fresh)

    def stage_grad(self, index: int, grad: torch.Tensor) -> None:
        """Hands param `index`'s low-precision grad to the step, after any the hooks still hold."""
        self._check_open()
        self._hooks.hand_over_grads()
        self.engine.stage_grads([index], [grad])

    def zero_grad(self, set_to_none: bool = True) -> None:
        inflight = self.engine.inflight
        if inflight is not None and inflight.awaiting_grads:
            raise RuntimeError(
                "zero_grad() between backward and step(): with offload.overlap='backward' backward has already "
                "updated subgroups with these grads; call step() first"
            )
        self._hooks.drop_grads()
        super().zero_grad(set_to_none)  # (a HeldGrad set to None, or zeroed: the grads it stood for are dropped)
        if self.engine.pending is None and not (inflight is not None and inflight.busy):
            self.grads.clear()  # (an update in flight clears them when it ends)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` for this optimizer's params, whose grads the hooks took out
        of `p.grad` (so torch's own function sees none): returns the global L2 norm of this step's
        grads (all ranks, every backward since the last step) as a tensor, and has the next `step()`
        scale them so that it is at most `max_norm`, in flight. The first call on an optimizer built
        without `offload.max_grad_norm` sums the grads already staged; from then on the hooks take each
        grad's sum of squares where it is, as `max_grad_norm` does."""
        self._check_open()
        self._check_backwards()
        return self.engine.clip(max_norm, norm_type, error_if_nonfinite)

    def _check_backwards(self) -> None:
        """Before a clip or step uses the grads: every backward since the last step handed them in (none
        after a step with no zero_grad() between, none left unreduced by FSDP2); a p.grad the model
        cleared since is followed as torch would (torch_idioms.follow_cleared_grads)."""
        hand_over_held_grads(self._hooks, self.engine)
        refuse_backwards_after_step(self._params)
        check_grads_synced(self._sync_units, self.offload.micro_batches)
        if self._sync_units:  # with model=, p.grad stands for the grads the hooks took (else it is the user's)
            follow_cleared_grads(self._params, self.grads.backwards, self.engine)
        reshard_gathered(m for unit in self._sync_units for m in unit)  # the update writes the shards

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the dynamic loss scale with fp16, as is otherwise."""
        return self.grads.scale_loss(loss)

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Updates every subgroup: with the update overlapped, on a worker thread, returning at once
        (the next forward waits per FSDP unit for its params; `finish_update` waits for all of it).
        If the update raises (an I/O error, say), nothing is lost: the error surfaces where it is
        waited for, and the next call finishes the same step from the subgroup where it stopped."""
        self._check_open()
        check_params_unswapped(self.param_groups, self._params)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_backwards()  # (after the closure's backward: a unit it left incomplete is handed over here)
        if self.engine.inflight is not None and self.engine.inflight.awaiting_grads:
            self.engine.hand_in_last_grads()
        elif step_has_grads(self.engine):
            self.engine.step()
        else:
            self._no_grad_steps.skip(self._params)
            self.grads.clear()  # (a clip taken on grads dropped since goes with them)
        if has_step_post_hooks(self):  # they read params as torch leaves them: updated
            self.engine.finish_update()
        consume_held_grads(self._params)  # a backward before the next zero_grad() would sum into them: refused
        return loss

    def finish_update(self) -> None:
        """Waits until the update of the last step has finished and its params are in the model;
        raises its error, if it had one. Saves, loads and the next step call it themselves."""
        self.engine.finish_update()

    def take_metrics(self) -> list[StepMetrics]:
        """The metrics of every step finished since the last call (a skipped fp16 step's too), oldest
        first: a step() that skips can follow the end of the step before it, so `last_metrics` alone
        may pass one by. Kept for the last 1024 steps."""
        taken = list(self.engine.untaken)
        self.engine.untaken.clear()
        return taken

    # -- state: state_dicts.py ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Like torch.optim.AdamW's, plus each param's FP32 'master_param', all gathered in host memory:
        for an FSDP2-sharded param each tensor is a DTensor sharded as the param is (its local shard in
        host memory), as torch's optimizers give, so torch's distributed state-dict API and DCP see
        whole tensors. The offload's own counters ride in the first param group ("fsdp_offload"),
        which that API keeps. For state that does not fit host memory, checkpoint through the DCP
        Stateful (optimizer_state.py) instead."""
        return self._states.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores masters, moments, step counts and hyperparameters, and rewrites the model's params
        from the restored masters."""
        self._states.load_state_dict(state_dict)

    def full_fp32_state_dict(self, model: torch.nn.Module | None = None, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """`model`'s state dict (by default the model given at construction) whole, in host memory, with
        the FP32 masters for this optimizer's params and the model's own values elsewhere (frozen params,
        buffers; a tied weight under each name): for `load_state_dict(strict=True)` of an FP32 copy,
        `torch.save`, or `save_pretrained`. Collective under FSDP2: every rank calls it, and with
        `rank0_only` only rank 0 gets the tensors (one whole param at a time crosses the others)."""
        model = model if model is not None else (self._models[0] if self._models else None)
        if model is None:
            raise ValueError("full_fp32_state_dict() names params by the model's names: pass model= (here or at construction)")
        return self._states.full_fp32_state_dict(model, rank0_only)

    def param_state(self, index: int, key: str) -> torch.Tensor:
        """Param `index`'s `key` ('master_param', 'exp_avg' or 'exp_avg_sq'), shaped as the param."""
        return self._states.param_state(index, key)

    def checkpoint_meta(self) -> dict[str, Any]:
        """Everything but the subgroups: what `load_checkpoint_meta` restores after they are written."""
        return self._states.checkpoint_meta()

    def begin_load(self) -> None:
        """Before a load overwrites subgroups (`store.overwrite`): until it ends, the optimizer refuses to step."""
        self._states.begin_load()

    def load_checkpoint_meta(self, meta: dict[str, Any]) -> None:
        """Ends a load whose subgroups were all overwritten: checks the layout they were saved in and
        takes the saved step counts, hyperparameters and offload state."""
        self._states.load_checkpoint_meta(meta)

    def load_params_from_master(self, sg: int, master: torch.Tensor) -> None:
        """The model's params in subgroup `sg` from its new FP32 masters (after a streamed load)."""
        self._states.load_params_from_master(sg, master)

    __reduce_ex__ = __deepcopy__ = refuse_copy  # copy.copy, copy.deepcopy, pickle: a clear error

    def close(self) -> None:
        """Waits for the update in flight, then deletes this rank's tier files and releases pinned memory."""
        inflight = self.engine.inflight
        try:
            if inflight is not None and inflight.awaiting_grads:
                # closed between backward and step() (backward raised, say): the step is dropped, not applied
                inflight.abort()
                try:
                    inflight.finish()
                except UpdateAborted:
                    pass
            self.engine.finish_update()
        finally:
            self._owned.close()  # (the model may go on with another optimizer: its hooks and held grads are gone)

    def _check_open(self) -> None:
        if not self._owned.open:
            raise RuntimeError("this OffloadAdamW was closed (its tier files and buffers are gone): build a new one, and load "
                               "a checkpoint into it to go on")  # fmt: skip

    def _settle(self) -> None:
        """Between steps: the update in flight finished, and no step stopped part-way."""
        self._check_open()
        self.engine.finish_update()
        if self.engine.pending is not None:
            raise RuntimeError(
                f"step {self.engine.step_count} stopped part-way ({len(self.engine.pending)} subgroups left to "
                "update); call step() again to finish it before saving or loading state"
            )
