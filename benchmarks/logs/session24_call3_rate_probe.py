"""Session 24 probe: the planner's timed CPU rate against a step-like sweep over distinct subgroups, on one machine.
Order matters (torch.set_num_threads turns MKL's dynamic threading off for the whole process), so it is printed."""
import json, os, statistics, sys, threading, time
import torch
from fsdp_offload.kernels import get_adamw_kernel
from fsdp_offload.kernels.contract import AdamWHyper
from fsdp_offload.threads import use_cpu_threads
from fsdp_offload.update_rate import node_update_rate

_, kernel = get_adamw_kernel("auto")
out = {"log": []}
def say(tag, value):
    print(f"{tag}: {value}", flush=True); out["log"].append([tag, value])

def sweep(teams, threads, subgroups, numel, sweeps=3, pin=False):
    """Each team (a Python thread) updates its own `subgroups` distinct subgroups of `numel` in turn, as a step does;
    returns each sweep's slowest team time and the params/s a team."""
    times = [[0.0] * sweeps for _ in range(teams)]
    bar = threading.Barrier(teams)
    def team(i):
        if threads != torch.get_num_threads(): use_cpu_threads(threads)
        states = [torch.zeros(3, numel) for _ in range(subgroups)]
        grads = [torch.full((numel,), 1e-3, dtype=torch.bfloat16) for _ in range(subgroups)]
        if pin:
            for t in states: torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * 4, 0)
        for s in range(sweeps + 1):
            bar.wait()
            t0 = time.perf_counter()
            for k in range(subgroups):
                kernel(states[k][0], states[k][1], states[k][2], grads[k], grads[k], AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.0, s + 1))
            if s: times[i][s - 1] = time.perf_counter() - t0
            for g in grads: g.fill_(1e-3)
        if pin:
            for t in states: torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    ths = [threading.Thread(target=team, args=(i,)) for i in range(teams)]
    [t.start() for t in ths]; [t.join() for t in ths]
    worst = [max(times[i][s] for i in range(teams)) for s in range(sweeps)]
    return [round(subgroups * numel / w / 1e6) for w in worst]

M = 1 << 20
say("mkl dynamic at start (torch threads)", torch.get_num_threads())
say("planner 1 rank x64, fresh process, Mparams/s", [round(node_update_rate("auto", 100 * M, 64, 1) / 1e6) for _ in range(5)])
say("sweep 1 team x64 over 13 x 100Mi (the 1.35B at 1 rank), Mparams/s", sweep(1, 64, 13, 100 * M))
say("sweep 1 team x64 over 1 x 64Mi repeated (as the planner), Mparams/s", sweep(1, 64, 1, 64 * M, sweeps=8))
say("sweep 1 team x64 over 13 x 100Mi, pinned, Mparams/s", sweep(1, 64, 13, 100 * M, pin=True))
say("planner 1 rank x64 again, Mparams/s", [round(node_update_rate("auto", 100 * M, 64, 1) / 1e6) for _ in range(5)])
say("planner 4 ranks x16, Mparams/s a rank", [round(node_update_rate("auto", 100 * M, 16, 4) / 1e6) for _ in range(5)])
say("sweep 4 teams x16 over 4 x 84Mi each (the 1.35B at 4 ranks), Mparams/s a team", sweep(4, 16, 4, 84 * M))
say("planner 1 rank x64 after set_num_threads(16) in teams, Mparams/s", [round(node_update_rate("auto", 100 * M, 64, 1) / 1e6) for _ in range(5)])
say("sweep 1 team x64 over 13 x 100Mi after, Mparams/s", sweep(1, 64, 13, 100 * M))
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "rate_probe.json"), "w"), indent=1)
