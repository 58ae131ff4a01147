"""Session 28 probe 2: why the planner's timed CPU rate reads 0.62-0.8x the rate a run's steps have on the same machine
(call 2: window and cold bytes change nothing). Variants, each timed as node_update_rate times (teams side by side,
a barrier a round, the median round's slowest team), 4 teams x 16 threads and 1 x 64:
  base     update_rate.node_update_rate itself
  same     this probe's loop over torch.zeros state and torch.empty grads (as node_update_rate)
  steplike the state in one page-aligned buffer (cache.aligned_host_buffer, as a host cache slot) and the grads in a
           pinned one (cache.host_buffer(pin=True), as the staging buffer), filled once with random values
  random   torch.zeros-made buffers holding random values (params, moments, grads) instead of zeros and 1e-3
  sweep    4 'steplike' sets a team, the kernel over them back to back in a round (as a step walks its subgroups), the
           round's time over 4
  procs    one process a team (spawned, as torchrun's ranks), the same loop, a multiprocessing barrier a round
and the machine's THP mode, NUMA nodes and each variant's AnonHugePages."""
import json, os, statistics, sys, threading, time
import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor
import torch

N_ROUNDS = 10


def facts():
    out = {}
    for f in ("enabled", "defrag"):
        try:
            out["thp_" + f] = open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip()
        except OSError as e:
            out["thp_" + f] = str(e)
    out["numa_nodes"] = sorted(d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")) if os.path.isdir("/sys/devices/system/node") else None
    return out


def anon_huge():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"):
            return line.split()[1] + " kB"


def buffers(kind, n):
    from fsdp_offload.cache import aligned_host_buffer, host_buffer
    if kind in ("same", "random"):
        state, grads = torch.zeros(3, n), torch.empty(n, dtype=torch.bfloat16)
    else:
        state = aligned_host_buffer(12 * n).view(torch.float32).view(3, n)
        grads = host_buffer(2 * n, pin=torch.cuda.is_available()).view(torch.bfloat16)
    if kind in ("random", "steplike"):
        state[0].normal_(0, 0.02); state[1].normal_(0, 1e-3); state[2].uniform_(0, 1e-6)
        src = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    else:
        state.zero_(); src = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    return state, grads, src


def team_loop(kind, n, threads, wait, record):
    from fsdp_offload.kernels import get_adamw_kernel
    from fsdp_offload.kernels.contract import AdamWHyper
    from fsdp_offload.threads import use_cpu_threads
    use_cpu_threads(threads)
    _, kernel = get_adamw_kernel("auto")
    sets = [buffers("steplike" if kind == "sweep" else kind, n) for _ in range(4 if kind == "sweep" else 1)]
    for step in range(1, N_ROUNDS + 2):
        for _, grads, src in sets:
            grads.copy_(src)
        wait()
        t0 = time.perf_counter()
        for state, grads, _ in sets:
            kernel(state[0], state[1], state[2], grads, grads, AdamWHyper(1e-4, 0.9, 0.999, 1e-8, 0.1, step))
        record(step, (time.perf_counter() - t0) / len(sets))
    return anon_huge()


def in_threads(kind, ranks, threads, n):
    times = {}
    barrier = threading.Barrier(ranks)
    lock = threading.Lock()
    def rec(i):
        def r(step, dt):
            with lock:
                times.setdefault(step, []).append(dt)
        return r
    with ThreadPoolExecutor(ranks) as pool:
        futs = [pool.submit(team_loop, kind, n, threads, barrier.wait, rec(i)) for i in range(ranks)]
        huge = [f.result() for f in futs][-1]
    rounds = [max(v) for s, v in sorted(times.items()) if s > 1]
    return n / statistics.median(rounds), huge


def proc_main(kind, n, threads, barrier, q):
    got = []
    huge = team_loop(kind, n, threads, barrier.wait, lambda s, dt: got.append((s, dt)))
    q.put((got, huge))


def in_procs(kind, ranks, threads, n):
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(ranks), ctx.Queue()
    ps = [ctx.Process(target=proc_main, args=(kind, n, threads, barrier, q)) for _ in range(ranks)]
    for p in ps: p.start()
    res = [q.get() for _ in ps]
    for p in ps: p.join()
    by_step = {}
    for got, _ in res:
        for s, dt in got:
            by_step.setdefault(s, []).append(dt)
    rounds = [max(v) for s, v in sorted(by_step.items()) if s > 1]
    return n / statistics.median(rounds), res[0][1]


if __name__ == "__main__":
    import fsdp_offload.update_rate as ur
    from fsdp_offload.threads import cpu_threads_per_rank
    print("FACTS", json.dumps(facts()), flush=True)
    for ranks in (4, 1):
        threads = cpu_threads_per_rank(None, ranks)
        n = max(1, min(100 << 20, 64 << 20, (128 << 20) // ranks))
        for kind in ("base", "same", "steplike", "random", "sweep", "procs", "steplike", "base"):
            t0 = time.perf_counter()
            if kind == "base":
                rate, huge = ur.node_update_rate("auto", 100 << 20, threads, ranks), anon_huge()
            elif kind == "procs":
                rate, huge = in_procs("same", ranks, threads, n)
            else:
                rate, huge = in_threads(kind, ranks, threads, n)
            print("PROBE", json.dumps(dict(ranks=ranks, threads=threads, kind=kind, mparams_per_s=round(rate / 1e6), anon_huge=huge,
                                           wall_s=round(time.perf_counter() - t0, 2))), flush=True)
