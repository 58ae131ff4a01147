"""Session 27 probe: the 1-rank update fixed costs (update_costs.py) timed in each context, to find why the
1-rank prediction's fixed-cost walk read 0.04-0.27 s where the steps' walk was 0.011-0.018 s (session 26).
Variants, each 3 times: in-process (today's 1-rank path), in-process after CUDA work, in a subprocess
(_side_by_side, as multi-rank), in-process at 16 threads. Prints one line each: subgroup_s, call_s, step_s (ms),
and the walk for 14 subgroups (the 1.35B at 100M a subgroup)."""
import json, os, sys, time
import torch
from fsdp_offload.update_costs import time_update_costs, _side_by_side, fitted_costs, SUBGROUPS
from fsdp_offload.update_rate import node_update_rate
from fsdp_offload.threads import cpu_threads_per_rank
import tempfile

variant = sys.argv[1]
threads = cpu_threads_per_rank(None, 1) if variant != "t16" else 16
numel = 1 << 16
rate = node_update_rate("auto", 100 << 20, threads, 1)
if variant == "cuda":
    x = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    (x @ x).sum().backward(); torch.cuda.synchronize()
out = []
for rep in range(3):
    if variant == "subprocess":
        with tempfile.TemporaryDirectory() as work:
            c = fitted_costs(_side_by_side(1, "auto", numel, threads, work, "exclusive", True), numel, rate)
    else:
        c = time_update_costs("auto", 100 << 20, threads, 1, None, "exclusive", rate)
    row = dict(variant=variant, env_omp=os.environ.get("OMP_WAIT_POLICY"), threads=threads, rate_mps=rate / 1e6,
               subgroup_ms=c.subgroup_s * 1e3, call_ms=c.call_s * 1e3, transfer_ms=c.transfer_s * 1e3, step_ms=c.step_s * 1e3,
               walk14_s=c.walk_seconds(14, 0) + c.step_s)
    out.append(row)
    print("PROBE", json.dumps(row), flush=True)
