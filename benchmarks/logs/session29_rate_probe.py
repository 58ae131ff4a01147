"""Session 29 probe: the planner's timed CPU rate (update_rate.node_update_rate: teams as threads of one process) against
one process a team (spawned as torchrun's ranks, a multiprocessing barrier a round), in turns, 4 ranks x 16 threads and
1 x 64, to set beside the steps' rate of the bench_scale runs of the same call (their profile.json)."""
import json, sys, time
sys.path.insert(0, ".carry")
from s28_rate_probe2 import in_procs, anon_huge
import fsdp_offload.update_rate as ur
from fsdp_offload.threads import cpu_threads_per_rank

if __name__ == "__main__":
    tag = sys.argv[1]
    for ranks in (4, 1):
        threads = cpu_threads_per_rank(None, ranks)
        n = max(1, min(100 << 20, 64 << 20, (128 << 20) // ranks))
        for kind in ("base", "procs", "base", "procs"):
            t0 = time.perf_counter()
            rate = ur.node_update_rate("auto", 100 << 20, threads, ranks) if kind == "base" else in_procs("same", ranks, threads, n)[0]
            print("PROBE", json.dumps(dict(tag=tag, ranks=ranks, threads=threads, kind=kind, mparams_per_s=round(rate / 1e6),
                                           wall_s=round(time.perf_counter() - t0, 2))), flush=True)
