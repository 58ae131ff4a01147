"""What OffloadAdamW accepts: torch AdamW's arguments checked as torch checks them, the options it
refuses (each with why), and the params it can own. (The `offload=` config is config.py's.)"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from .fsdp import CAST_MARK, local_data
from .node import says_once
from .torch_idioms import refuse_accelerate_fsdp2

log = logging.getLogger(__name__)

TORCH_OPTIONS = {
    "amsgrad": "it keeps a fourth FP32 state tensor (the running max of exp_avg_sq) that the out-of-core layout has no room for",
    "maximize": "the fused kernels descend; negate the loss instead",
    "foreach": "torch's implementation choice: OffloadAdamW always runs its own kernels (choose with offload.kernel)",
    "fused": "torch's implementation choice: OffloadAdamW always runs its own kernels (choose with offload.kernel)",
    "capturable": "the update runs on the CPU and storage, outside any CUDA graph",
    "differentiable": "the update is not part of autograd",
    # (a group key of torch's AdamW, True there; False is torch.optim.Adam's L2 decay)
    "decoupled_weight_decay": "AdamW decouples its weight decay from the gradient; False asks for Adam's L2 decay, which the "
                              "kernels do not implement (leave it True: with weight_decay=0 the two are the same)",
}


def refuse_torch_options(**given: Any) -> None:
    """torch AdamW's options other than the math ones: their defaults are accepted, any other value is
    refused by name with why."""
    for name, value in given.items():
        if (not value) if name == "decoupled_weight_decay" else value:
            raise ValueError(f"OffloadAdamW does not support {name}={value!r}: {TORCH_OPTIONS[name]}")


def hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Each group's AdamW hyperparameters as the kernels take them, read at each step; a torch AdamW
    option set on a group since construction (`amsgrad`, `maximize`, ...) is refused as there."""
    for g in param_groups:
        refuse_torch_options(**{k: g[k] for k in TORCH_OPTIONS if k in g})
    return [
        {"lr": float(g["lr"]), "beta1": float(g["betas"][0]), "beta2": float(g["betas"][1]),
         "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])}
        for g in param_groups
    ]  # fmt: skip


def check_hyperparameters(values: dict[str, Any], where: str) -> None:
    """AdamW's hyperparameters that `values` sets, checked as torch AdamW checks them (NaN refused
    too), and of their kind: numbers (or what float() takes, as a 0-d tensor), betas a pair."""

    def number(value: Any) -> float:
        try:
            return math.nan if isinstance(value, bool) else float(value)
        except (TypeError, ValueError, RuntimeError):
            return math.nan

    for name, must in (("lr", "a number >= 0"), ("eps", "a number >= 0"), ("weight_decay", "a number >= 0 (0: none)")):
        if name in values and not number(values[name]) >= 0.0:
            raise ValueError(f"{where}: invalid {name} {values[name]!r}: must be {must}")
    if "betas" in values:  # a pair of any kind torch AdamW takes: a tuple, a list, Hydra's ListConfig, a tensor
        betas = values["betas"]
        try:
            pair = [number(b) for b in betas] if not isinstance(betas, str) else []
        except TypeError:  # not iterable
            pair = []
        if not (len(pair) == 2 and all(0.0 <= b < 1.0 for b in pair)):
            raise ValueError(f"{where}: invalid betas {betas!r}: give two numbers in [0, 1), e.g. (0.9, 0.999)")
    as_tensor = {"lr": lambda v: isinstance(v, torch.Tensor),
                 "betas": lambda v: isinstance(v, torch.Tensor) or any(isinstance(b, torch.Tensor) for b in v)}  # fmt: skip
    tensors = [name for name, test in as_tensor.items() if name in values and test(values[name])]
    if tensors and says_once():
        log.warning(
            "%s: %s given as a tensor: each step reads its value as a float, as torch AdamW steps a float %s; torch AdamW "
            "given the tensor does that arithmetic in FP32 tensors, so the two can differ in the last bits",
            where, " and ".join(tensors), " and ".join(tensors),
        )


def check_params(params: list[torch.Tensor], models: list[torch.nn.Module], param_dtype: torch.dtype, dtype_name: str,
                 streamed: bool) -> None:  # fmt: skip
    """The params an OffloadAdamW can own: on one device type, contiguous, FP32 (or, `streamed`, in
    param_dtype, offload.param_dtype=`dtype_name`, with masters= giving the FP32 values), and not cast by
    an earlier OffloadAdamW."""
    if not params:
        raise ValueError("OffloadAdamW got an empty parameter list")
    refuse_accelerate_fsdp2(params, models)
    devices = {local_data(p).device.type for p in params}
    if len(devices) > 1:
        raise ValueError(f"params are on mixed device types {sorted(devices)}: put the whole model on one device")
    names = param_names(models)
    for i, p in enumerate(params):
        if streamed:
            if p.dtype != param_dtype:
                raise ValueError(
                    f"{param_label(i, p, names)} is {p.dtype}: with masters= the model is built in "
                    f"offload.param_dtype={dtype_name} and the masters come from the source "
                    "(parallelize.build_offloaded_model does both); without masters=, give FP32 params"
                )
        elif p.dtype != torch.float32 and any(getattr(x, CAST_MARK, False) for x in [p, *models]):
            raise ValueError(
                f"{param_label(i, p, names)} is {p.dtype}: an earlier OffloadAdamW cast this model and "
                "holds its FP32 master weights. Keep using that optimizer; to rebuild one (other options, "
                "another tier), save the old one's state (state_dict() or a DCP checkpoint), close() it, "
                "build the model again in FP32, build the new optimizer on it and load the state"
            )
        elif p.dtype != torch.float32:
            raise ValueError(
                f"{param_label(i, p, names)} is {p.dtype}, not float32: OffloadAdamW takes its FP32 "
                "master weights from the model's FP32 params and casts the model to "
                f"{dtype_name} itself; build it before casting the model"
            )
        if not p.requires_grad:  # refused before anything is cast: a corrected retry finds the model as it was
            raise ValueError(
                f"{param_label(i, p, names)} does not require grad: a frozen param takes no step. Leave it "
                "out of the optimizer (OffloadAdamW([p for p in model.parameters() if p.requires_grad], ...)); "
                "it then keeps its dtype and values, and full_fp32_state_dict() still exports it. To unfreeze it later, pass "
                "it in trainable and freeze it with p.requires_grad_(False) once the optimizer is built: frozen, it takes no "
                "step, as with torch AdamW (params cannot be added to an OffloadAdamW later)"
            )
        if not local_data(p).is_contiguous():
            raise ValueError(f"{param_label(i, p, names)} is not contiguous")


def param_names(models: list[torch.nn.Module]) -> dict[int, str]:
    """The models' params' names by id (none without a model): what errors call a param."""
    return {id(p): n for m in models for n, p in m.named_parameters()}


def param_label(i: int, p: torch.Tensor, names: dict[int, str]) -> str:
    """How an error names the optimizer's param `i`: its name where the model was given, its shape."""
    name = f" {names[id(p)]!r}" if id(p) in names else ""
    return f"param {i}{name} (shape {tuple(p.shape)})"


def check_unit_dtypes(model: torch.nn.Module, units: list[tuple[list[torch.nn.Module], list[torch.nn.Parameter]]],
                      params: list[torch.Tensor], param_dtype: torch.dtype, dtype_name: str) -> None:  # fmt: skip
    """FSDP2 needs the params of one unit that take grads to share a dtype (it reduce-scatters their
    grads together): a param that requires grad but is not this optimizer's stays as it is, so it must
    not share a unit with params this optimizer casts to another dtype. (Frozen params may: FSDP2
    all-gathers a unit of mixed dtypes as bytes.) Says once, by rank 0, which of its units reduce in
    another dtype (`MixedPrecisionPolicy(reduce_dtype=torch.float32)`, torchtitan's default, and the
    recipes' where FSDP2 sums the micro-batches): FSDP2 casts the reduced grads back to the params' dtype,
    so the optimizer takes them in that dtype still."""
    mine = {id(p) for p in params}
    names = param_names([model])
    reduced_in: dict[str, list[str]] = {}
    for modules, unit_params in units:
        if not any(id(p) in mine for p in unit_params):
            continue
        reduce_dtype = getattr(mp_policy(modules), "reduce_dtype", None)
        if reduce_dtype not in (None, param_dtype):
            reduced_in.setdefault(str(reduce_dtype), []).append(type(modules[0]).__name__)
        for p in unit_params:
            if id(p) not in mine and p.requires_grad and p.dtype != param_dtype:
                raise ValueError(
                    f"param {names.get(id(p), tuple(p.shape))!r} ({p.dtype}) requires grad but is not in this optimizer, "
                    f"and shares an FSDP unit ({type(modules[0]).__name__}) with params it casts to {dtype_name}: FSDP2 "
                    "needs a unit's trainable params to share a dtype. Pass it to the optimizer, freeze it "
                    "(p.requires_grad_(False)), or give it an FSDP unit of its own (fully_shard on its module)"
                )
    if reduced_in and says_once():
        log.info(
            "FSDP units of this optimizer's params reduce their grads in %s (MixedPrecisionPolicy.reduce_dtype): FSDP2 "
            "casts the reduced grads to the params' dtype, %s, so the optimizer takes %s grads. With FSDP2's gradient "
            "sync off between a step's micro-batches it sums them in FP32 first and reduces once a step; with the sync "
            "on, each micro-batch reduces (the optimizer sums them in FP32); units: %s",
            " and ".join(reduced_in), dtype_name, dtype_name, "; ".join(f"{d}: {', '.join(sorted(set(u)))}" for d, u in reduced_in.items()),
        )  # fmt: skip


def mp_policy(modules: list[torch.nn.Module]) -> object | None:
    """The MixedPrecisionPolicy of an FSDP unit (FSDP2's private state; None where it has none)."""
    return getattr(modules[0]._get_fsdp_state(), "_mp_policy", None)


def warn_uncast_at_first_forward(model: torch.nn.Module, units: list[tuple[list[torch.nn.Module], list[torch.nn.Parameter]]],
                                 params: list[torch.Tensor], param_dtype: torch.dtype) -> list:  # fmt: skip
    """A one-shot forward pre-hook on the model that names, once, by rank 0, the units of none of this
    optimizer's params that compute trainable params in another dtype than the ones it casts. At the
    first forward, not at construction: another OffloadAdamW built after this one casts its own units."""
    mine = {id(p) for p in params}
    theirs = [(modules, unit_params) for modules, unit_params in units if not any(id(p) in mine for p in unit_params)]

    def check(_module: torch.nn.Module, _args: tuple) -> None:
        handle.remove()
        names = {id(p): n for n, p in model.named_parameters()}
        uncast = [line for modules, unit_params in theirs
                  for line in uncast_params(modules, [p for p in unit_params if p.requires_grad], param_dtype, names)]  # fmt: skip
        warn_uncast(uncast, param_dtype)

    handle = model.register_forward_pre_hook(check)
    return [handle]


def uncast_params(modules: list[torch.nn.Module], trainable: list[torch.nn.Parameter], param_dtype: torch.dtype,
                  names: dict[int, str]) -> list[str]:  # fmt: skip
    """The first trainable param of a unit that computes in another dtype than `param_dtype` (its own,
    where its MixedPrecisionPolicy sets none), described; or nothing."""
    computes_in = getattr(mp_policy(modules), "param_dtype", None)
    other = [p for p in trainable if (computes_in or p.dtype) != param_dtype]
    if not other:
        return []
    return [f"{names.get(id(other[0]), tuple(other[0].shape))} in {type(modules[0]).__name__}, computed in {computes_in or other[0].dtype}"]


def warn_uncast(uncast: list[str], param_dtype: torch.dtype) -> None:
    """A unit none of whose params are this optimizer's (another optimizer's, say) computes in its params'
    dtype unless its MixedPrecisionPolicy says otherwise: trainable FP32 params there, beside units
    this optimizer casts, make most forwards fail on mixed dtypes (a matmul of FP32 and bf16), with an
    error that does not say why. Said once, by rank 0."""
    if not uncast or not says_once():
        return
    log.warning(
        "FSDP units hold trainable params this optimizer does not manage, computed in another dtype than the %s of "
        "the units it manages (%s): a forward that mixes them fails on the dtypes. Give those units "
        "MixedPrecisionPolicy(param_dtype=%s) in fully_shard, or pass their params to this optimizer",
        param_dtype, "; ".join(uncast), param_dtype,
    )  # fmt: skip
