"""FSDP2 glue: grad shards to host as reduce-scatter ends, new params back before the next forward.

A post-accumulate-grad hook on each sharded param takes its bf16 grad shard; once an FSDP unit's are
all in, the optimizer copies them into its staging buffer (page-locked host memory; GPU memory for
GPU-resident subgroups and with `grad_path="gpu_bf16"`) on the stream FSDP2 runs the hooks on (its
post-reduce stream) and frees the GPU grads. After the step, the new bf16 params go back on a side
stream of the optimizer's (`CopyStream`). With the update overlapped, a forward pre-hook on each FSDP
unit, ahead of FSDP's own, waits for the subgroups that hold that unit's params before FSDP
all-gathers them; with a synchronous step, the root's next all-gather waits on one event
(`set_post_optim_event`). On CPU (gloo) the copies are plain synchronous ones.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .held_grad import held_like, is_held, release_held_grads
from .unit_grads import HandOver, UnitGrads


def local_data(p: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's elements of `p` (the local shard of a DTensor)."""
    return p.to_local() if isinstance(p, DTensor) else p.data


class CopyStream:
    """The side stream for host<->device copies of one optimizer (no stream on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def after_current(self) -> Iterator[None]:
        """Runs the block on the side stream, ordered after the work queued so far."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def after(self, event: torch.cuda.Event | None) -> Iterator[None]:
        """Runs the block, on whatever thread, with the side stream as its current stream, ordered
        after `event` (recorded with `mark_current`)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_event(event)
        with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
            yield

    def mark_current(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the caller's current stream."""
        return None if self.stream is None else torch.cuda.current_stream(self.stream.device).record_event()

    def current_waits(self) -> None:
        """Orders the caller's current stream after the copies queued so far on the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def wait_host(self) -> None:
        """Blocks until every copy queued on the side stream has landed."""
        if self.stream is not None:
            self.stream.synchronize()

    def close(self) -> None:
        """Before the buffers the copies read are freed (at an optimizer's close, or its finalizer): waits for
        them, and for the grad hooks' copies into the staging buffer on FSDP2's stream (the whole device)."""
        if self.stream is not None:
            torch.cuda.synchronize(self.stream.device)

    def record(self) -> torch.cuda.Event | None:
        """An event after the copies queued so far. A thread that waits for it on the CPU sleeps rather
        than spins (blocking=True): a spinning wait takes a core from the CPU update it waits for."""
        return self._sleeping_event(self.stream)

    def record_current(self) -> torch.cuda.Event | None:
        """As record(), after the work queued so far on the caller's current stream (the grad hooks' copies,
        on FSDP2's post-reduce stream, or on the caller's in step())."""
        return None if self.stream is None else self._sleeping_event(torch.cuda.current_stream(self.stream.device))

    def _sleeping_event(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        return event


CAST_MARK = "_cast_by_offload_adamw"  # set on the models and params an OffloadAdamW cast to low precision


def cast_params(model: nn.Module, dtype: torch.dtype, params: list[torch.Tensor] | None = None) -> None:
    """Casts `params` (by default every param of the model) to `dtype` and leaves the model's other
    params and its buffers as they were (as FSDP2's mixed precision does: a bf16 RoPE table loses
    phase; a frozen param keeps its values). `model._apply` is what casts, because on an FSDP2 model
    it also re-points the sharded storage (FSDPModule._apply)."""
    chosen = None if params is None else {id(p) for p in params}
    owned = {id(p) for p in model.parameters()}

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if id(t) in owned and (chosen is None or id(t) in chosen) else t

    model._apply(cast)


def root_fsdp_module(model: nn.Module) -> FSDPModule:
    """The model itself, checked to be an FSDP2 root (fully_shard applied to it and its blocks) that has not
    run a forward yet (ValueError: the optimizer must be built before it)."""
    if not isinstance(model, FSDPModule):
        inner = any(isinstance(m, FSDPModule) for m in model.modules())
        hint = "call fully_shard(model) on the root too" if inner else "apply fully_shard to its blocks and to the root"
        raise TypeError(f"{type(model).__name__} is not an FSDP2-sharded model: {hint} before building OffloadAdamW")
    # FSDP2 settles its units (the root, the params' dtype, its buffers) at the root's first forward; the
    # optimizer then casts the sharded params to low precision, which the next forward or backward would
    # not survive (a dtype error deep in FSDP2). (A bare model.unshard() settles the units without a root:
    # not seen here. A model an earlier OffloadAdamW cast is said as such, by check_params.)
    if getattr(model._get_fsdp_state(), "_is_root", None) is not None and not getattr(model, CAST_MARK, False):
        raise ValueError(f"{type(model).__name__} has run a forward already: build OffloadAdamW right after fully_shard, "
                         "before the model's first forward (an evaluation or a dry run included); it casts the sharded "
                         "params to low precision, and FSDP2 fixed their dtype at that forward")  # fmt: skip
    return model


def check_sharded_params(model: nn.Module, params: list[torch.Tensor]) -> None:
    """Every optimizer param must be one of the model's FSDP2 sharded (DTensor) params."""
    names = {id(p): n for n, p in model.named_parameters()}
    for i, p in enumerate(params):
        if id(p) not in names:
            raise ValueError(f"param {i} (shape {tuple(p.shape)}) is not a parameter of the model passed as model=")
        if not isinstance(p, DTensor):
            raise ValueError(f"param {i} {names[id(p)]!r} (shape {tuple(p.shape)}) is not sharded by fully_shard (not a DTensor)")
        if p.device_mesh.ndim != 1:
            raise ValueError(f"param {i} lives on a {p.device_mesh.ndim}-D mesh: OffloadAdamW supports 1-D FSDP meshes")


class ModelHooks:
    """The hooks an optimizer put on its model's params and modules, removed together: by close(), or by
    the optimizer's finalizer where it was dropped without one. The HeldGrads in p.grad go with them, so
    the model is left as torch would leave it, and so do the grads the hooks still hold."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params
        self._handles: list = []
        self._unit_grads: UnitGrads | None = None
        self._sync_units: list[list[nn.Module]] = []

    def add(self, handles: list, unit_grads: UnitGrads | None = None, sync_units: list[list[nn.Module]] | None = None) -> None:
        self._handles += handles
        self._unit_grads = unit_grads or self._unit_grads
        self._sync_units = sync_units or self._sync_units

    def hand_over_grads(self) -> None:
        """Hands the optimizer the grads the grad hooks still hold: before anything reads the step's grads."""
        if self._unit_grads is not None:
            self._unit_grads.hand_over()

    @property
    def holding_grads(self) -> bool:
        """Whether the grad hooks hold grads not yet handed over."""
        return self._unit_grads is not None and self._unit_grads.holding

    def drop_grads(self) -> None:
        """Drops the grads the grad hooks still hold, and those FSDP2 left unreduced (zero_grad(), close())."""
        if self._unit_grads is not None:
            self._unit_grads.drop()
        drop_unreduced_grads(self._sync_units)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.drop_grads()
        release_held_grads(self._params)


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """A bound method called through a weak reference to its object (None, calling nothing, once that is
    gone), for the hooks an optimizer leaves on its model. A grad hook is held by its param from C++,
    where the garbage collector cannot follow: a strong reference from it would keep an optimizer dropped
    without close() (its pinned memory, tier files and threads) alive until the process ends."""
    ref = weakref.WeakMethod(method)

    def call(*args: object) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


def install_grad_hooks(params: list[torch.Tensor], units: list[tuple[list[nn.Module], list[nn.Parameter]]],
                       hand_over: HandOver, micro_batches: int) -> tuple[list, UnitGrads]:  # fmt: skip
    """Hooks that take each param's reduced grad shard for the optimizer, leaving a HeldGrad in `p.grad`,
    which refuses every read with an error naming the optimizer's own clip (with None there torch's
    clip_grad_norm_ would see no grad and clip nothing). The grads go to `hand_over(indices, grads,
    fresh)` an FSDP unit at a time (`units`, from fsdp_units; unit_grads.UnitGrads); `fresh[k]`
    says grad k found `p.grad` empty or zeroed (the step's first, or the first after p.grad was cleared).
    The next backward's grad, which FSDP2 adds to the HeldGrad, goes over as not fresh.

    FSDP2 runs these on its post-reduce stream, right after the reduction that made the grads, so the
    optimizer queues a unit's copies there: they wait for nothing else, backward's compute never waits
    for them, and the end of backward orders the current stream after them (FSDP2's post-reduce event).
    (A unit left incomplete goes over on the stream of whoever asks for it: the next unit's hooks, or
    step() on the caller's stream, ordered after the grads' own.)
    A side stream of our own costs a stream switch, a cross-stream wait and a cross-stream free per
    grad: scripts/bench_hook_stream.py measures the two."""
    index = {id(p): i for i, p in enumerate(params)}
    members = [[index[id(p)] for p in unit_params if id(p) in index and p.requires_grad] for _, unit_params in units]
    unit_grads = UnitGrads(members, len(params), hand_over)

    def make_hook(index: int) -> Callable[[torch.Tensor], None]:
        def take(local: torch.Tensor) -> None:
            unit_grads.add(index, local, False)

        def restart(local: torch.Tensor) -> None:
            unit_grads.add(index, local, True)

        # Runs once per param in the middle of backward, so it is kept to a few calls.
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if is_held(grad):
                return  # FSDP2 added this backward's grad to the held one: `take` (or `restart`) has it
            restart(grad._local_tensor if isinstance(grad, DTensor) else grad)  # (to_local() runs an op: 5 us)
            param.grad = held_like(grad, micro_batches, take, restart)

        return hook

    return [p.register_post_accumulate_grad_hook(make_hook(i)) for i, p in enumerate(params)], unit_grads


def units_holding(units: list[tuple[list[nn.Module], list[nn.Parameter]]], params: list[torch.Tensor]) -> list[list[nn.Module]]:
    """The modules of the units (from `fsdp_units`) that hold any of `params`."""
    mine = {id(p) for p in params}
    return [modules for modules, unit_params in units if any(id(p) in mine for p in unit_params)]


def reshard_gathered(modules: Iterable[nn.Module]) -> None:
    """Frees the gathered params that a forward without its backward (an eval forward, under
    reshard_after_forward=False or in FSDP2's root) left in any of `modules`' FSDP units: before a write
    to the shards (the update, a load) or a read of them, after which FSDP2's next forward would compute
    with the stale gathered copy rather than gather again. A no-op for a unit already sharded."""
    for m in modules:
        if isinstance(m, FSDPModule):
            m.reshard()


def compute_device_type(params: list[torch.Tensor]) -> str:
    """Where the model computes with `params`: an FSDP2 param's mesh says it (its shards may lie on the
    CPU for a model that computes on a GPU, under CPUOffloadPolicy); a plain tensor's own device."""
    first = params[0]
    return first.device_mesh.device_type if isinstance(first, DTensor) else first.device.type


def mesh_group(params: list[torch.Tensor]) -> torch.distributed.ProcessGroup | None:
    """The process group that shards the params (None for plain tensors: nothing to reduce)."""
    for p in params:
        if isinstance(p, DTensor):
            return p.device_mesh.get_group()
    return None


def fsdp_units(model: nn.Module) -> list[tuple[list[nn.Module], list[nn.Parameter]]]:
    """The model's FSDP units in module order (the root first, as the forward all-gathers them): the
    modules that share one FSDP state (one `fully_shard` call), with the params that unit manages
    itself (not those of units inside it)."""
    states: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            states.setdefault(id(m._get_fsdp_state()), []).append(m)
    claimed: set[int] = set()
    units = []
    for modules in reversed(list(states.values())):  # inner units first: a param is its innermost unit's
        own = [p for m in modules for p in m.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        units.append((modules, list({id(p): p for p in own}.values())))
    return units[::-1]


def forward_prefetched(module: nn.Module) -> list[nn.Module]:
    """Modules whose all-gather FSDP starts in `module`'s pre-forward (`set_modules_to_forward_prefetch`)."""
    states = getattr(module._get_fsdp_state(), "_states_to_forward_prefetch", None) or []
    return [m for state in states for m in state._modules]


def install_forward_waits(units: list[list[nn.Module]], wait: Callable[[int], None]) -> list:
    """Forward pre-hooks, run before FSDP's own, that call `wait(unit)` before FSDP all-gathers the
    params of `unit` (and of the units it prefetches)."""
    unit_of = {id(m): u for u, modules in enumerate(units) for m in modules}

    def make_hook(unit: int, module: nn.Module) -> Callable:
        def hook(_module: nn.Module, _args: tuple) -> None:
            wait(unit)
            for other in forward_prefetched(module):
                if id(other) in unit_of:
                    wait(unit_of[id(other)])

        return hook

    return [m.register_forward_pre_hook(make_hook(u, m), prepend=True) for u, modules in enumerate(units) for m in modules]


def _param_groups(module: nn.Module) -> list:
    """FSDP2's param groups of a unit (its private state: checked where the hooks are installed, so a
    torch that renamed it fails then, by name, rather than the checks going quiet)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13: a list
    if groups is None and hasattr(state, "_fsdp_param_group"):  # torch 2.11: one group or None
        groups = [g for g in (state._fsdp_param_group,) if g is not None]
    if groups is None or any(not hasattr(g, "reduce_grads") for g in groups):
        raise RuntimeError(f"this torch ({torch.__version__}) keeps FSDP2's gradient-sync state elsewhere: fsdp_offload "
                           "cannot check it; use torch 2.11-2.13")  # fmt: skip
    return groups


def _sync_off_error(module: nn.Module, when: str, micro_batches: int) -> RuntimeError:
    return RuntimeError(
        f"{type(module).__name__}: {when} with FSDP2's gradient sync off (set_requires_gradient_sync(False), or "
        "accelerate's accumulate()/no_sync): FSDP2 would sum the micro-batches' grads in the params' low precision, "
        "not in FP32 as OffloadAdamW sums them. Leave the sync on and let the optimizer sum the backwards "
        f"(offload.micro_batches, now {micro_batches}; with accelerate, GradientAccumulationPlugin(sync_each_batch=True)), "
        "or have FSDP2 sum them in FP32: fully_shard(..., mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))"
    )


def sums_in_fp32(module: nn.Module) -> bool:
    """Whether FSDP2 sums a unit's grads in FP32 while its gradient sync is off: it reduces in float32
    (MixedPrecisionPolicy.reduce_dtype), so it keeps the unsharded sums in float32 from backward to backward."""
    return all(getattr(g.mp_policy, "reduce_dtype", None) is torch.float32 for g in _param_groups(module))


def install_sync_checks(units: list[list[nn.Module]], micro_batches: int) -> list:
    """Forward pre-hooks on the units that hold the optimizer's params that refuse a training forward
    while FSDP2's gradient sync is off (`set_requires_gradient_sync(False)`, which accelerate's
    `accumulate()` and `no_sync` call), or while a unit still holds grads that a backward with the sync
    off left (the sync turned off around backward alone): FSDP2 would sum the micro-batches' unsharded
    grads in the params' low precision and reduce-scatter once, where the optimizer sums every backward's
    grads in FP32, as torch AdamW's FP32 grads are. A unit that reduces in float32 (`sums_in_fp32`, fixed
    once it is sharded) sums them in FP32 itself: it gets no hook. (`check_grads_synced` catches the sync
    turned off through the last backward, at the step.)"""
    checked = [modules for modules in units if not sums_in_fp32(modules[0])]  # (reads every unit's groups: checked here)

    def check(module: nn.Module, _args: tuple) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return  # an eval forward; or activation checkpointing's recompute in backward, the unit's later grads in
        if any(not g.reduce_grads for g in _param_groups(module)):
            raise _sync_off_error(module, "a forward", micro_batches)
        _check_unit_synced(module, micro_batches)

    return [m.register_forward_pre_hook(check, prepend=True) for modules in checked for m in modules]  # before FSDP2 gathers


def check_grads_synced(units: list[list[nn.Module]], micro_batches: int) -> None:
    """Raises where a backward left grads unreduced in a unit (its sync off through the step's last
    backward): the optimizer never got them (and without FP32 sums, FSDP2 would add the next backward's
    to them in low precision)."""
    for modules in units:
        _check_unit_synced(modules[0], micro_batches)


def _check_unit_synced(module: nn.Module, micro_batches: int) -> None:
    for group in _param_groups(module):
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if fsdp_param.unsharded_accumulated_grad is not None or (unsharded is not None and unsharded.grad is not None):
                why = (f"{type(module).__name__}: a backward with FSDP2's gradient sync off left its grads unreduced: FSDP2 "
                       "sums them in FP32 and reduce-scatters them in the first backward with the sync on, so the step "
                       "(and a clip) come after the step's last backward, which runs with the sync on "
                       "(set_requires_gradient_sync(True))" if sums_in_fp32(module)
                       else str(_sync_off_error(module, "a backward", micro_batches)))  # fmt: skip
                raise RuntimeError(
                    f"{why}. Or a backward raised part-way and left them: call model.reset_iter_state() (FSDP2's reset "
                    "after an error in forward or backward). opt.zero_grad() drops such grads with the step's others"
                )


def drop_unreduced_grads(units: list[list[nn.Module]]) -> None:
    """Drops the grads FSDP2 left unreduced in `units` (a backward with the sync off, or one that raised
    part-way), which FSDP2 would add to the next backward's: the optimizer's zero_grad() drops them with
    the step's (the model's own zero_grad() sees only the sharded params)."""
    for modules in units:
        for group in _param_groups(modules[0]):
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
