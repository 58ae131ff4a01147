"""FSDP2 + OffloadAdamW against plain FSDP2 + torch AdamW on the GPU: memory and iteration breakdown.

Three runs of the same LLaMA-style model, one after another in one process:
  1. plain FSDP2: FP32 sharded params, bf16 compute (MixedPrecisionPolicy), fused torch AdamW on GPU;
  2. the bf16-sharded model with no optimizer hooks (backward time without the D2H grad copies);
  3. FSDP2 + OffloadAdamW: bf16 params, grads to host in backward, FP32 state out of core;
  4. the same clipping at 1.0 (the hooks also take each grad's sum of squares).
Reports peak GPU memory, forward / backward / update seconds (medians over the steps after the first),
and backward with vs without the hook.

    torchrun --nproc-per-node 1 scripts/bench_fsdp.py --model 1b --device-kind nvidia-h100-x1
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_offload import OffloadAdamW, OffloadConfig
from fsdp_offload.models import MODEL_PRESETS, num_params
from fsdp_offload.fsdp import cast_params
from fsdp_offload.parallelize import build_fsdp_model
from fsdp_offload.results import record


def build(args: argparse.Namespace, mp: MixedPrecisionPolicy | None) -> torch.nn.Module:
    margs = dataclasses.replace(MODEL_PRESETS[args.model], activation_checkpointing=True, max_seq_len=args.seq)
    return build_fsdp_model(margs, torch.device("cuda"), mp_policy=mp)


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()  # every stream: a D2H tail that did not overlap counts
    return time.perf_counter() - start


def iterate(model, optimizer, tokens, steps: int) -> dict:
    rows = []
    for _ in range(steps):
        out = {}
        loss_box = []
        out["forward_s"] = timed(lambda: loss_box.append(
            F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())))  # fmt: skip
        out["backward_s"] = timed(lambda: loss_box[0].backward())
        if optimizer is not None:
            out["update_s"] = timed(optimizer.step)
            optimizer.zero_grad()
        else:
            model.zero_grad()
        rows.append(out)
    rows = rows[1:]  # the first iteration warms up allocators and kernels
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}  # a shared machine's outliers left out


def run_case(name: str, args, make) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, optimizer = make()
    tokens = torch.randint(0, MODEL_PRESETS[args.model].vocab_size, (args.batch, args.seq + 1), device="cuda")
    res = iterate(model, optimizer, tokens, args.steps + 1)
    if args.profile_dir:  # one more iteration under the profiler: where the CPU and GPU time goes
        os.makedirs(args.profile_dir, exist_ok=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            iterate(model, optimizer, tokens, 2)
        trace = os.path.join(args.profile_dir, f"{name}.trace.json")
        prof.export_chrome_trace(trace)
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
        with open(os.path.join(args.profile_dir, f"{name}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    res["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if isinstance(optimizer, OffloadAdamW):
        res["offload_metrics"] = optimizer.last_metrics.as_dict()
        res["kernel"] = optimizer.kernel_name
        optimizer.close()
    print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items() if isinstance(v, float)), flush=True)
    del model, optimizer
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1b", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tier", default=None, help="tier spec for the offloaded state (default: a temp dir)")
    ap.add_argument("--host-budget-gb", type=float, default=None, help="None keeps all state in host memory")
    ap.add_argument("--gpu-fraction", type=float, default=0.0, help="offload.gpu_fraction of the offload case")
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--profile-dir", default=None, help="write a torch.profiler summary of each case here")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    tier_dir = tempfile.mkdtemp(prefix="bench-fsdp-")
    tiers = [args.tier or f"posix:{tier_dir}"] if args.host_budget_gb is not None else []

    def plain():
        model = build(args, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def no_hook():
        model = build(args, None)
        cast_params(model, torch.bfloat16)  # as OffloadAdamW casts it
        return model, None

    def offload(max_grad_norm: float | None = None):
        model = build(args, None)
        cfg = OffloadConfig(tiers=tiers, host_budget_gb=args.host_budget_gb, gpu_fraction=args.gpu_fraction, max_grad_norm=max_grad_norm)
        return model, OffloadAdamW(model.parameters(), lr=1e-4, model=model, offload=cfg)

    cases = (("plain_fsdp", plain), ("no_hook", no_hook), ("offload", offload), ("offload_clip", lambda: offload(1.0)))
    results = {name: run_case(name, args, make) for name, make in cases}
    if dist.get_rank() == 0:
        off = results["offload"]
        result = {
            "world_size": dist.get_world_size(),
            "params_billion": num_params(MODEL_PRESETS[args.model]) / 1e9,
            "seq": args.seq,
            "batch": args.batch,
            "gpu_peak_gib": off["gpu_peak_gib"],
            "gpu_peak_gib_plain_fsdp": results["plain_fsdp"]["gpu_peak_gib"],
            "forward_s": off["forward_s"],
            "backward_s": off["backward_s"],
            "backward_s_without_hook": results["no_hook"]["backward_s"],
            "backward_s_clipping": results["offload_clip"]["backward_s"],  # the hooks also take each grad's sum of squares
            "update_s": off["update_s"],
            "plain_fsdp": results["plain_fsdp"],
            "offload": off,
            "tiers": tiers,
            "host_budget_gb": args.host_budget_gb,
            "gpu_fraction": args.gpu_fraction,
        }
        path = record("bench_fsdp", args.device_kind, args.out, result, launcher=f"torchrun --nproc-per-node {dist.get_world_size()}")
        print(f"\n{'':12} {'GPU peak GiB':>12} {'forward s':>10} {'backward s':>11} {'update s':>9}")
        for name, r in results.items():
            print(f"{name:12} {r['gpu_peak_gib']:>12.2f} {r['forward_s']:>10.3f} {r['backward_s']:>11.3f} {r.get('update_s', 0):>9.3f}")
        print(f"backward with hook / without: {off['backward_s'] / results['no_hook']['backward_s']:.3f}, with clipping "
              f"{results['offload_clip']['backward_s'] / results['no_hook']['backward_s']:.3f}; wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
