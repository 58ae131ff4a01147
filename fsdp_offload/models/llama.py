"""A LLaMA-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One file that reads top to bottom, in the manner of torchtitan's `models/llama3/model.py` and
nanoGPT. It is the model the offloading optimizer is trained and benchmarked on, so it is built for
FSDP2: `layers` is an `nn.ModuleList` of blocks to `fully_shard` one by one, and it can be built on
the meta device and materialized later:

    with torch.device("meta"):
        model = Transformer(MODEL_PRESETS["70b"])
    fully_shard(...)                      # optional: per block, then the root
    model.to_empty(device="cuda")
    model.init_weights()                  # params and the RoPE table, from the torch RNG

`init_weights()` draws every parameter from the global torch RNG in a fixed order, so a model built
on meta and one built on CPU give the same parameters after the same `torch.manual_seed`. That order is
`init_modules()`, one module at a time (`init_module`): parallelize.py draws them so, each module whole
on an unsharded replica, and keeps each rank's shard (the streamed start-up).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _as_given(value: object) -> str:
    """A recipe value as a command line gives it (Hydra reads `null` as None)."""
    return "null" if value is None else repr(value)


# what a step keeps on its device, each true, false or "auto" (fsdp_offload.step_memory resolves it)
STEP_CHOICES = {
    "activation_checkpointing": "true, false or auto (off where the device holds the step's activations)",
    "reshard_after_forward": "true (gather each unit again in backward), false (keep it gathered from forward to "
                             "backward) or auto (false where the device holds the gathered units)",
    "sum_grads_unsharded": "true (sum a step's micro-batches unsharded in FP32 and reduce once), false (reduce every "
                           "micro-batch) or auto (true where the device holds the sums)",
}  # fmt: skip


@dataclass
class LlamaArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads (plain multi-head)
    vocab_size: int = 32000
    ffn_hidden: int | None = None  # None = LLaMA's rule: 2/3 * 4 * dim, rounded up to multiple_of
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # recompute each block's forward in backward (saves the activations of all but the block's input);
    # "auto": the entry resolves it from the device's memory (fsdp_offload.step_memory) before a build
    activation_checkpointing: bool | str = False
    # FSDP2's reshard_after_forward for the embedding and the blocks (parallelize.shard_units): true frees
    # a unit's gathered params after its forward and gathers them again in backward; false keeps them
    # gathered from forward to backward (a whole bf16 copy of the rank's units on the device), one
    # all-gather a unit a step instead of two. The numbers computed are the same either way. "auto": as
    # activation_checkpointing's (fsdp_offload.step_memory)
    reshard_after_forward: bool | str = True
    # With several micro-batches a step, true sums their grads unsharded in FP32 on the device (FSDP2's own
    # accumulation: the units reduce in float32, the sync off until the step's last backward), so each unit
    # reduce-scatters once a step and the optimizer takes one grad; 4 bytes a param on every device from the
    # first backward to the last. false: every micro-batch reduce-scatters and the optimizer sums the
    # shards in FP32. "auto": as activation_checkpointing's (fsdp_offload.step_memory)
    sum_grads_unsharded: bool | str = False

    def __post_init__(self) -> None:
        sizes = {"dim": self.dim, "n_layers": self.n_layers, "n_heads": self.n_heads, "vocab_size": self.vocab_size,
                 "multiple_of": self.multiple_of, "max_seq_len": self.max_seq_len, "n_kv_heads": self.n_kv_heads,
                 "ffn_hidden": self.ffn_hidden}  # fmt: skip
        for name, value in sizes.items():
            if value is None and name in ("n_kv_heads", "ffn_hidden"):  # None: n_heads, LLaMA's rule
                continue
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"model.{name}={value!r} must be a whole number >= 1")
        if not all(isinstance(v, (int, float)) and v > 0 for v in (self.norm_eps, self.rope_theta)):
            raise ValueError(f"model.norm_eps={self.norm_eps} and model.rope_theta={self.rope_theta} must be positive")
        bad = [f"model.{name}={_as_given(getattr(self, name))}: choose {choices}" for name, choices in STEP_CHOICES.items()
               if not (isinstance(getattr(self, name), bool) or getattr(self, name) == "auto")]  # fmt: skip
        if bad:
            raise ValueError("; ".join(bad))
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: pick a divisor of dim")
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim={self.head_dim} must be even for RoPE; change dim or n_heads"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not a multiple of model.n_kv_heads={self.kv_heads}: pick a divisor of n_heads"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        hidden = int(2 * (4 * self.dim) / 3)  # SwiGLU has 3 matrices: keep params ~ a 4*dim MLP
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def num_params(args: LlamaArgs) -> int:
    """Parameter count of `Transformer(args)`, from the shapes alone (no model is built)."""
    d, hd = args.dim, args.head_dim
    attention = d * args.n_heads * hd + 2 * d * args.kv_heads * hd + args.n_heads * hd * d
    feed_forward = 3 * d * args.ffn_dim
    block = attention + feed_forward + 2 * d  # + attention_norm, ffn_norm
    embeddings = args.vocab_size * d
    output = 0 if args.tie_embeddings else args.vocab_size * d
    return args.n_layers * block + embeddings + d + output  # + final norm


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # the mean of squares in bf16 loses too much
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles, (max_seq_len, head_dim // 2) each, in fp32.

    Real-valued rather than torchtitan's complex `freqs_cis`, so it works in bf16 on any device.
    OffloadAdamW and FSDP2's mixed precision keep them in fp32 (they cast params only); a plain
    `model.to(torch.bfloat16)` casts them too, and apply_rope still rotates in fp32.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[2i], x[2i+1]) of x: (bs, seqlen, heads, head_dim), as Meta's LLaMA."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :].float(), sin[None, :, None, :].float()
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(bs, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bs, seqlen, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bs, heads, seqlen, head_dim)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down (the output projection)
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.w3.weight, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)


class TransformerBlock(nn.Module):
    """Pre-norm block; the unit FSDP2 `fully_shard`s and activation checkpointing recomputes."""

    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.activation_checkpointing = args.activation_checkpointing
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        # GPT-2 style: each residual branch's output projection is scaled by 1/sqrt(2 * n_layers),
        # so the residual stream's variance does not grow with depth.
        self.out_std = INIT_STD / math.sqrt(2 * args.n_layers)
        self.compile_backend: str | None = None  # set by compile_blocks: the block's math runs compiled

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # (the function, not a bound method: a copy of the model computes with its own weights)
        math_of = TransformerBlock._forward if self.compile_backend is None else compiled_block_math(self.compile_backend)
        if self.activation_checkpointing and torch.is_grad_enabled():
            # Checkpoint the inner function, not the module: FSDP2's hooks on this block then run
            # once, and the recompute in backward finds the params already unsharded.
            return checkpoint(math_of, self, x, cos, sin, use_reentrant=False)
        return math_of(self, x, cos, sin)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.attention.init_weights(self.out_std)
        self.ffn_norm.init_weights()
        self.feed_forward.init_weights(self.out_std)


@functools.cache
def compiled_block_math(backend: str) -> Callable[..., torch.Tensor]:
    """TransformerBlock's math compiled by torch.compile with `backend`: one function for every block of
    every model, so they share its graph (the block comes in as an argument)."""
    return torch.compile(TransformerBlock._forward, backend=backend, fullgraph=True)


def compile_blocks(model: "Transformer", backend: str = "inductor") -> None:
    """Runs each block's computation compiled (compiled_block_math; `backend`: inductor, its default, fuses
    the norms, the rotary embedding and SwiGLU's elementwise ops into a few kernels each way). The module
    calls and their hooks (FSDP2's gathers and reductions, the optimizer's grad hooks) stay eager, and
    the params' names do not change; the model holds only the backend's name (it still pickles and
    copies). The first step compiles the graph."""
    for block in model.layers:
        block.compile_backend = backend


class Transformer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        for name in STEP_CHOICES:
            if getattr(args, name) == "auto":  # a model does or does not: the entry decides which
                raise ValueError(f"model.{name}='auto' is resolved before the model is built, from the device's memory: "
                                 "train.py and the planner do it (fsdp_offload.step_memory); set true or false to build a "
                                 "Transformer yourself")  # fmt: skip
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Tied: no output module, the logits reuse tok_embeddings.weight. A shared Parameter would
        # come apart in to_empty() on the meta path; keep tok_embeddings in the root FSDP unit.
        self.output: nn.Linear | None = None
        if not args.tie_embeddings:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: derived from args, recomputed by init_weights (needed after to_empty).
        cos, sin = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (bs, seqlen) int64 -> logits: (bs, seqlen, vocab_size)."""
        seqlen = tokens.shape[1]
        if seqlen > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seqlen} > max_seq_len={self.args.max_seq_len}; "
                "raise LlamaArgs.max_seq_len"
            )
        cos, sin = self.rope_cos[:seqlen], self.rope_sin[:seqlen]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def init_modules(self) -> list[tuple[str, nn.Module]]:
        """The modules whose params `init_weights` draws, by name, in the order it draws them (their
        params in the order of `parameters()`): a streamed start-up draws them one at a time."""
        named = [("tok_embeddings", self.tok_embeddings)]
        named += [(f"layers.{i}", layer) for i, layer in enumerate(self.layers)]
        named.append(("norm", self.norm))
        if self.output is not None:
            named.append(("output", self.output))
        return named

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The RoPE table, computed on the buffers' device (after `to_empty`)."""
        cos, sin = precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize every parameter and buffer in place; a fixed RNG draw order."""
        self.init_buffers()
        for _, module in self.init_modules():
            init_module(module)


@torch.no_grad()
def init_module(module: nn.Module) -> None:
    """Draws the params of one of `Transformer.init_modules()` from the global torch RNG."""
    if isinstance(module, (nn.Embedding, nn.Linear)):  # tok_embeddings, output
        nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
    else:  # TransformerBlock, RMSNorm
        module.init_weights()
