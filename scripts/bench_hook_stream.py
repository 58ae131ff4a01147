"""Where a grad hook's device-to-host copy should run in FSDP2's backward: on the stream the hook is
called on (FSDP2's post-reduce stream, what `fsdp.install_grad_hooks` does) or on a side stream of its
own (a stream switch, a cross-stream wait and a record_stream per grad).

One bf16 FSDP2 LLaMA on one GPU; each variant's hooks copy every reduced grad shard into one pinned
host buffer and free it. The variants take turns, round after round in one process, and each reports
the median and the least backward time over its iterations (a shared machine's noise is large).

    torchrun --nproc-per-node 1 scripts/bench_hook_stream.py --model 1b --device-kind nvidia-h100-x1
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fsdp_offload.fsdp import cast_params
from fsdp_offload.models import MODEL_PRESETS
from fsdp_offload.parallelize import build_fsdp_model
from fsdp_offload.results import record

VARIANTS = ("no_hook", "free_only", "hook_stream", "side_stream")


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def hooks_for(variant: str, params: list[torch.Tensor], host: torch.Tensor, side: torch.cuda.Stream) -> list:
    sizes = [local(p).numel() for p in params]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]

    def make(i: int):
        dst = host[offsets[i] : offsets[i] + sizes[i]]

        def hook(p: torch.Tensor) -> None:
            g = local(p.grad)
            if variant == "hook_stream":
                dst.copy_(g.reshape(-1), non_blocking=True)
                g.record_stream(torch.cuda.current_stream())
            elif variant == "side_stream":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    dst.copy_(g.reshape(-1), non_blocking=True)
                g.record_stream(side)
            p.grad = None

        return hook

    return [] if variant == "no_hook" else [p.register_post_accumulate_grad_hook(make(i)) for i, p in enumerate(params)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="backwards per variant and round (the first two left out)")
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    margs = dataclasses.replace(MODEL_PRESETS[args.model], activation_checkpointing=True, max_seq_len=args.seq)
    model = build_fsdp_model(margs, torch.device("cuda"), mp_policy=None)
    cast_params(model, torch.bfloat16)  # as OffloadAdamW casts it
    params = list(model.parameters())
    host = torch.empty(sum(local(p).numel() for p in params), dtype=torch.bfloat16, pin_memory=True)
    side = torch.cuda.Stream()
    tokens = torch.randint(0, margs.vocab_size, (1, args.seq + 1), device="cuda")
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            handles = hooks_for(variant, params, host, side)
            for step in range(args.steps):
                loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
                torch.cuda.synchronize()
                start = time.perf_counter()
                loss.backward()
                torch.cuda.synchronize()  # every stream: a copy tail counts
                if step >= 2:
                    times[variant].append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
            for h in handles:
                h.remove()
    summary = {v: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "n": len(t)} for v, t in times.items()}
    path = record("bench_hook_stream", args.device_kind, args.out, {"model": args.model, "seq": args.seq, "backward": summary,
                                                                     "backward_s": times})  # fmt: skip
    for v, s in summary.items():
        print(f"{v:>12}: backward median {s['median_s'] * 1e3:6.1f} ms, least {s['min_s'] * 1e3:6.1f} ms (n={s['n']})")
    print("wrote", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
