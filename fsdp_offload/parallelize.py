"""Building a LLaMA-style model sharded with FSDP2, without materialising it whole anywhere.

Two start-ups draw the same weights (bit for bit, on any world size):
- `build_fsdp_model`: the sharded FP32 model on the device, for plain FSDP2 (torch AdamW) or for an
  OffloadAdamW that takes its masters from the FP32 params;
- `build_offloaded_model`: the model in the low-precision param dtype and its OffloadAdamW, with the FP32
  init drawn one module at a time and handed straight to the optimizer's subgroups
  (`StreamedMasters`), so no FP32 copy of the whole model exists on the GPU or on the host.

Both draw each init module (`Transformer.init_modules`) whole, as an unsharded model would, and keep
this rank's shard of it: the weights depend on the seed only, not on the world size or the sharding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from .fsdp import cast_params, local_data
from .models import LlamaArgs, Transformer
from .models.llama import init_module
from .optimizer import OffloadAdamW, offload_config


def shard_units(model: Transformer, **kw) -> None:
    """`fully_shard`s the model unit by unit (`kw`: fully_shard's options): the embedding, each block,
    the final norm with the output head, then the root. The head is a unit of its own so that its grads
    are reduced (and can be updated) as soon as backward has run it, first, instead of with the
    root's at the very end; it stays unsharded from its forward to its backward, which follows at once.
    Tied embeddings keep the shared weight in the root unit. The embedding and the blocks reshard after
    forward as `model.args.reshard_after_forward` says. Where `model.args.sum_grads_unsharded`, every
    unit reduces in float32 (MixedPrecisionPolicy.reduce_dtype, `kw`'s policy's or one of its own): FSDP2
    then sums the micro-batches' grads in FP32 while the training loop keeps its gradient sync off."""
    if model.args.sum_grads_unsharded is True:
        policy = kw.get("mp_policy") or MixedPrecisionPolicy()
        if policy.reduce_dtype not in (None, torch.float32):
            raise ValueError(f"model.sum_grads_unsharded=true sums the grads in FP32, and the given mp_policy reduces in "
                             f"{policy.reduce_dtype}: give reduce_dtype=torch.float32, or set model.sum_grads_unsharded=false")  # fmt: skip
        kw = {**kw, "mp_policy": dataclasses.replace(policy, reduce_dtype=torch.float32)}
    units = {**kw, "reshard_after_forward": model.args.reshard_after_forward}
    if model.output is not None:
        fully_shard(model.tok_embeddings, **units)
    for block in model.layers:
        fully_shard(block, **units)
    if model.output is not None:
        fully_shard([model.norm, model.output], reshard_after_forward=False, **kw)
    fully_shard(model, **kw)


def data_parallel_mesh(device: torch.device) -> DeviceMesh:
    """Every rank, in one dimension, on `device`'s type. FSDP2's default mesh is on the accelerator
    whenever the machine has one, which would put a CPU run's shards on the GPU."""
    if not dist.is_initialized():
        dist.init_process_group()  # as fully_shard would: env://, torchrun's variables
    return init_device_mesh(device.type, (dist.get_world_size(),))


def meta_fsdp_model(args: LlamaArgs, device: torch.device, mp_policy: MixedPrecisionPolicy | None = None) -> Transformer:
    """The model on the meta device, sharded by `shard_units` over the ranks' `device`s: its shapes,
    and no memory yet."""
    with torch.device("meta"):
        model = Transformer(args)
    shard_units(model, mesh=data_parallel_mesh(device), **({} if mp_policy is None else {"mp_policy": mp_policy}))
    return model


def local_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, a whole value of `param` (an FSDP2 param, sharded on dim 0 as
    torch.chunk cuts it, the last ranks possibly empty), or `full` itself for a plain param."""
    if not isinstance(param, DTensor):
        return full
    if param.device_mesh.ndim != 1 or param.placements != (Shard(0),):
        raise ValueError(f"param of shape {tuple(param.shape)} is placed as {param.placements}: only FSDP2's Shard(0) is supported")
    chunks = torch.chunk(full, param.device_mesh.size(), dim=0)
    rank = param.device_mesh.get_local_rank()
    part = chunks[rank] if rank < len(chunks) else full[:0]
    if part.shape != local_data(param).shape:
        raise ValueError(f"param of shape {tuple(param.shape)}: its local shard is {tuple(local_data(param).shape)}, "
                         f"the chunk of rank {rank} is {tuple(part.shape)}")  # fmt: skip
    return part


def drawn_params(model: Transformer, device: torch.device, seed: int) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """Each param of `model` with its whole initial FP32 value, drawn from `seed` on `device` one init
    module at a time (on an unsharded meta replica of that module, materialised while it is drawn),
    in the order `Transformer.init_weights` draws them."""
    with torch.device("meta"):
        replica = Transformer(model.args)
    torch.manual_seed(seed)
    for name, module in replica.init_modules():
        module.to_empty(device=device)
        init_module(module)
        for pname, full in module.named_parameters():
            yield model.get_parameter(f"{name}.{pname}"), full.detach()
        module.to_empty(device="meta")  # frees it before the next one is drawn


def build_fsdp_model(
    args: LlamaArgs, device: torch.device, seed: int = 0, mp_policy: MixedPrecisionPolicy | None = None
) -> Transformer:
    """The FP32 model on `device`, sharded by `shard_units`, initialised from `seed` (see the module's
    note: the same weights on any world size)."""
    model = meta_fsdp_model(args, device, mp_policy)
    model.to_empty(device=device)
    model.init_buffers()
    with torch.no_grad():
        for param, full in drawn_params(model, device, seed):
            local_data(param).copy_(local_shard(full, param))
    return model


class StreamedMasters:
    """The FP32 masters of a model built in low precision, for `OffloadAdamW(masters=...)`: each param's
    local shard of its init, drawn (`drawn_params`) as the optimizer's fill asks for it. The fill asks
    in param order, a param once per subgroup it spans, so only the param at hand and the rest of its
    init module are held. A param the optimizer does not take (a frozen one) gets its value in the
    model directly. `zeros=True`: zeros, nothing drawn (a resumed run, whose checkpoint load follows)."""

    def __init__(self, model: Transformer, device: torch.device, seed: int, zeros: bool = False) -> None:
        self._drawn = None if zeros else drawn_params(model, device, seed)
        self._held: tuple[torch.Tensor, torch.Tensor] | None = None  # (param, its flat local FP32 shard)

    @torch.no_grad()
    def __call__(self, param: torch.Tensor) -> torch.Tensor:
        if self._drawn is None:
            return torch.zeros(local_data(param).numel(), dtype=torch.float32, device=local_data(param).device)
        if self._held is not None and self._held[0] is param:
            return self._held[1]
        for p, full in self._drawn:
            if p is param:
                self._held = (p, local_shard(full, p).reshape(-1))
                return self._held[1]
            local_data(p).copy_(local_shard(full, p))  # not the optimizer's: the model keeps it as drawn
        raise RuntimeError(
            f"param of shape {tuple(param.shape)} was asked for after the init drew past it: OffloadAdamW "
            "takes a streamed model's params in model.parameters() order"
        )

    @torch.no_grad()
    def finish(self) -> None:
        """Draws what the optimizer did not ask for (params after its last one) into the model, and
        lets go of the last param."""
        if self._drawn is not None:
            for p, full in self._drawn:
                local_data(p).copy_(local_shard(full, p))
        self._held = None


def build_offloaded_model(
    args: LlamaArgs, device: torch.device, seed: int = 0, *, init: bool = True, **optimizer: Any
) -> tuple[Transformer, OffloadAdamW]:
    """The model in `offload.param_dtype` on `device` and its OffloadAdamW (keyword args: the
    optimizer's), with the FP32 init streamed into the optimizer's subgroups one module at a time.
    `init=False`: the masters start at zero and nothing is drawn, for a run that loads a checkpoint next.
    The weights equal build_fsdp_model's with the same seed, bit for bit."""
    cfg = offload_config(optimizer.get("offload"))
    model = meta_fsdp_model(args, device)
    cast_params(model, getattr(torch, cfg.param_dtype))  # on meta: nothing is allocated yet
    model.to_empty(device=device)
    model.init_buffers()
    masters = StreamedMasters(model, device, seed, zeros=not init)
    opt = OffloadAdamW(model.parameters(), **{**optimizer, "offload": cfg}, model=model, masters=masters)
    masters.finish()
    return model, opt
