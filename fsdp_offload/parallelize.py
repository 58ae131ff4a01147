"""Building a LLaMA-style model sharded with FSDP2, without materialising it whole anywhere."""

from __future__ import annotations

import warnings

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .models import LlamaArgs, Transformer


def build_fsdp_model(
    args: LlamaArgs, device: torch.device, seed: int = 0, mp_policy: MixedPrecisionPolicy | None = None
) -> Transformer:
    """Meta-device construction, `fully_shard` per block and on the root, then FP32 init on `device`.

    Every rank draws the same full init from `seed` and keeps its own shards of it, so the result does
    not depend on the world size.
    """
    with torch.device("meta"):
        model = Transformer(args)
    kw = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        # DTensor warns that its random ops are not complete on a CPU mesh; init only draws normal_()
        warnings.filterwarnings("ignore", message="DTensor random operators")
        model.init_weights()
    return model
