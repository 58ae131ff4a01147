"""Session 21 probe: how noisy is the planner's CPU-rate timing (best of 3 short runs), against longer windows."""
import json, os, statistics, sys, time
import torch
from fsdp_offload.kernels import get_adamw_kernel
from fsdp_offload.kernels.contract import AdamWHyper
from fsdp_offload.machine import cpu_update_rate
from fsdp_offload.threads import use_cpu_threads

def window_rate(threads, n, window_s, stat):
    _, kernel = get_adamw_kernel("auto")
    use_cpu_threads(threads)
    state = torch.zeros(3, n); grads = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    times = []; t_end = None; step = 0
    while True:
        step += 1
        t0 = time.perf_counter()
        kernel(state[0], state[1], state[2], grads, grads, AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.0, step))
        t = time.perf_counter() - t0
        grads.fill_(1e-3)
        if step == 1:
            t_end = time.perf_counter() + window_s; continue
        times.append(t)
        if time.perf_counter() > t_end and len(times) >= 5: break
    return n / (min(times) if stat == "best" else statistics.median(times)), len(times)

out = {}
for threads in (64, 16):
    cur = [cpu_update_rate("auto", 64 << 20, threads) / 1e6 for _ in range(8)]
    win_best = [window_rate(threads, 64 << 20, 0.4, "best")[0] / 1e6 for _ in range(4)]
    win_med = [window_rate(threads, 64 << 20, 0.4, "median")[0] / 1e6 for _ in range(4)]
    out[threads] = dict(current=cur, window_best=win_best, window_median=win_med)
    print(f"threads={threads} current best-of-3 Mparams/s: " + " ".join(f"{x:.0f}" for x in cur))
    print(f"threads={threads} 0.4 s window, best: " + " ".join(f"{x:.0f}" for x in win_best))
    print(f"threads={threads} 0.4 s window, median: " + " ".join(f"{x:.0f}" for x in win_med))
json.dump(out, open(os.path.join(os.environ["OUT"], "rate_probe.json"), "w"), indent=1)
