"""Building a LLaMA-style model sharded with FSDP2, without materialising it whole anywhere."""

from __future__ import annotations

import warnings

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .models import LlamaArgs, Transformer


def shard_units(model: Transformer, **kw) -> None:
    """`fully_shard`s the model unit by unit (`kw`: fully_shard's options): the embedding, each block,
    the final norm with the output head, then the root. The head is a unit of its own so that its grads
    are reduced (and can be updated) as soon as backward has run it, first, instead of with the
    root's at the very end; it stays unsharded from its forward to its backward, which follows at once.
    Tied embeddings keep the shared weight in the root unit."""
    if model.output is not None:
        fully_shard(model.tok_embeddings, **kw)
    for block in model.layers:
        fully_shard(block, **kw)
    if model.output is not None:
        fully_shard([model.norm, model.output], reshard_after_forward=False, **kw)
    fully_shard(model, **kw)


def build_fsdp_model(
    args: LlamaArgs, device: torch.device, seed: int = 0, mp_policy: MixedPrecisionPolicy | None = None
) -> Transformer:
    """Meta-device construction, `shard_units`, then FP32 init on `device`.

    Every rank draws the same full init from `seed` and keeps its own shards of it, so the result does
    not depend on the world size.
    """
    with torch.device("meta"):
        model = Transformer(args)
    shard_units(model, **({} if mp_policy is None else {"mp_policy": mp_policy}))
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        # DTensor warns that its random ops are not complete on a CPU mesh; init only draws normal_()
        warnings.filterwarnings("ignore", message="DTensor random operators")
        model.init_weights()
    return model
