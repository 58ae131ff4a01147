"""One training step as train.py runs it (its micro-batches' forward and backward, then the optimizer),
timed into the step's row; and a step run under torch.profiler."""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from .data import TokenBatches
from .optimizer import OffloadAdamW
from .recipe import TrainConfig

log = logging.getLogger("train")  # train.py's logger: Hydra sends it to the console and the run dir's train.log


@contextlib.contextmanager
def profiled(prefix: str, device: torch.device):
    """One step under torch.profiler: `<prefix>.json` (a Chrome/Perfetto trace: the GPU's streams, the
    copies and collectives, the CPU ops of every thread) and `<prefix>.txt`, its ops by time. Every
    thread, not only this one: the overlapped update runs on a worker thread of its own (torch's
    experimental all-threads switch, torch >= 2.7)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=activities, experimental_config=every_thread) as prof:
        yield
    prof.export_chrome_trace(f"{prefix}.json")
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    with open(f"{prefix}.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40))
    log.info("profiled this step: %s.json", prefix)


def gathered_between_micro_batches(model: torch.nn.Module) -> bool:
    """Whether the model's FSDP2 units stay gathered from one micro-batch's backward to the next one's
    forward. They do where they stay gathered from forward to backward (`model.reshard_after_forward`
    false): every unit is gathered at a forward's end then, so holding them on costs no more at the
    step's peak, and it saves every later micro-batch one all-gather a unit."""
    return isinstance(model, FSDPModule) and model.args.reshard_after_forward is False


def sums_grads_unsharded(model: torch.nn.Module) -> bool:
    """Whether the model's FSDP2 units sum a step's micro-batch grads unsharded in FP32 (they reduce in
    float32, `model.sum_grads_unsharded`): the gradient sync stays off until the step's last backward, so
    each unit reduce-scatters once a step, and the optimizer takes one grad."""
    return isinstance(model, FSDPModule) and model.args.sum_grads_unsharded is True


def run_step(model, optimizer, batches: TokenBatches, tcfg: TrainConfig, max_grad_norm: float | None, device: torch.device) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    row = {"loss": 0.0, "forward_s": 0.0, "backward_s": 0.0}
    keep_gathered, sum_unsharded = gathered_between_micro_batches(model), sums_grads_unsharded(model)
    start = time.perf_counter()
    for micro in range(tcfg.micro_batches):
        tokens = next(batches).to(device)
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / tcfg.micro_batches
        sync()
        t1 = time.perf_counter()
        if keep_gathered:  # the last backward reshards: the update writes the shards, which the next forward gathers
            model.set_reshard_after_backward(micro == tcfg.micro_batches - 1)
        if sum_unsharded:  # the last backward reduce-scatters the sums
            model.set_requires_gradient_sync(micro == tcfg.micro_batches - 1)
        (optimizer.scale_loss(loss) if isinstance(optimizer, OffloadAdamW) else loss).backward()
        sync()
        row["forward_s"] += t1 - t0
        row.setdefault("first_forward_s", t1 - t0)  # the one forward that waits for the last update
        row["backward_s"] += time.perf_counter() - t1
        row["loss"] += loss.item()
    t2 = time.perf_counter()
    if not isinstance(optimizer, OffloadAdamW) and max_grad_norm is not None:  # OffloadAdamW clips in step()
        row["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    optimizer.step()
    optimizer.zero_grad()
    sync()
    row["step_call_s"] = time.perf_counter() - t2  # with the update overlapped, only its start
    row["step_s"] = time.perf_counter() - start
    loss_sum = torch.tensor([row["loss"]], device=device)
    dist.all_reduce(loss_sum)
    row["loss"] = loss_sum.item() / dist.get_world_size()
    if isinstance(optimizer, OffloadAdamW):
        row["grad_norm"] = optimizer.last_grad_norm
        # where several micro-batches' grads were summed: FSDP2's unsharded FP32 sums, or the optimizer's
        row["grad_accumulation"] = "fsdp2_unsharded" if sum_unsharded and tcfg.micro_batches > 1 else optimizer.grad_accumulation
        row["grad_path"] = optimizer.grad_path  # where the low-precision grads waited for their update
        if optimizer.loss_scaler is not None:
            row["loss_scale"] = optimizer.loss_scaler.scale
    else:
        row["update_s"] = row["exposed_update_s"] = row["step_call_s"]
    return row
