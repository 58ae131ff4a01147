"""Session 36: where a profiled step's backward waits. For each run dir given (trace_step<N>_rank<R>.json),
per rank: backward windows (the autograd thread's busy spans), the compute stream's busy/idle time within
them, NCCL busy, the longest compute-idle gaps and what the autograd thread ran then, and the CPU time of
blocking syncs per thread."""
import gzip, json, sys
from collections import defaultdict
from pathlib import Path


def load(p):
    op = gzip.open if p.suffix == ".gz" else open
    with op(p, "rt") as f:
        t = json.load(f)
    return [e for e in t["traceEvents"] if e.get("ph") == "X"]


def union(iv):
    tot, end = 0.0, -1e30
    for a, b in sorted(iv):
        if a > end:
            tot += b - a; end = b
        elif b > end:
            tot += b - end; end = b
    return tot


def analyse(p):
    ev = load(p)
    kern = [e for e in ev if e.get("cat") == "kernel"]
    streams = defaultdict(list)
    for k in kern:
        streams[k["args"].get("stream")].append(k)
    nccl = {s for s, ks in streams.items() if sum(k["dur"] for k in ks if "nccl" in k["name"].lower()) > 0.5 * sum(k["dur"] for k in ks)}
    comp = max((s for s in streams if s not in nccl), key=lambda s: sum(k["dur"] for k in streams[s]))
    threads = defaultdict(list)
    for e in ev:
        if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"):
            threads[e["tid"]].append(e)
    # the autograd thread: the one with most "autograd::engine" time
    ag = max(threads, key=lambda t: sum(e["dur"] for e in threads[t] if e["name"].startswith("autograd::engine")))
    agev = sorted(threads[ag], key=lambda e: e["ts"])
    wins, cur = [], None
    for e in agev:
        if not e["name"].startswith("autograd::engine"):
            continue
        if cur and e["ts"] - cur[1] < 20000:
            cur[1] = max(cur[1], e["ts"] + e["dur"])
        else:
            cur = [e["ts"], e["ts"] + e["dur"]]; wins.append(cur)
    out = {"trace": p.name, "compute_stream": comp, "nccl_streams": sorted(nccl), "backwards": len(wins)}
    # per stream busy within backward windows
    def busy_in(ks, lo, hi):
        return union([(max(lo, k["ts"]), min(hi, k["ts"] + k["dur"])) for k in ks if k["ts"] < hi and k["ts"] + k["dur"] > lo])
    bw_ms = sum(b - a for a, b in wins) / 1e3
    out["backward_ms"] = round(bw_ms, 1)
    out["stream_busy_ms_in_backward"] = {str(s): round(sum(busy_in(ks, a, b) for a, b in wins) / 1e3, 1) for s, ks in streams.items()}
    # compute-idle gaps within backward
    gaps = []
    ck = sorted(streams[comp], key=lambda k: k["ts"])
    for a, b in wins:
        ks = [k for k in ck if a <= k["ts"] < b]
        for x, y in zip(ks, ks[1:]):
            g = y["ts"] - (x["ts"] + x["dur"])
            if g > 30:
                gaps.append((g, x["ts"] + x["dur"], x["name"][:50], y["name"][:50]))
    out["compute_idle_gaps_over_30us_ms"] = round(sum(g[0] for g in gaps) / 1e3, 1)
    out["gap_count"] = len(gaps)
    # what the autograd thread was inside at each big gap's start (innermost op)
    def inside(ts):
        stack = [e for e in agev if e["ts"] <= ts < e["ts"] + e["dur"]]
        return " > ".join(e["name"][:40] for e in sorted(stack, key=lambda e: -e["dur"])[-3:])
    by = defaultdict(lambda: [0, 0.0])
    for g in gaps:
        key = inside(g[1] + g[0] / 2)
        by[key][0] += 1; by[key][1] += g[0] / 1e3
    out["gap_ms_by_autograd_ctx"] = {k: [v[0], round(v[1], 2)] for k, v in sorted(by.items(), key=lambda kv: -kv[1][1])[:15]}
    out["longest_gaps"] = [[round(g[0] / 1e3, 2), g[2], g[3], inside(g[1] + g[0] / 2)] for g in sorted(gaps, reverse=True)[:10]]
    # blocking syncs and top regions per thread
    sync = defaultdict(float)
    for t, es in threads.items():
        for e in es:
            if any(s in e["name"] for s in ("Synchronize", "cudaStreamWaitEvent", "cudaMemcpy", "item", "_local_scalar_dense")):
                sync[(t == ag and "ag" or str(t)) + ":" + e["name"][:40]] += e["dur"] / 1e3
    out["sync_ms"] = {k: round(v, 2) for k, v in sorted(sync.items(), key=lambda kv: -kv[1])[:12]}
    regions = defaultdict(lambda: [0, 0.0])
    for e in agev:
        if e.get("cat") == "user_annotation":
            k = e["name"].split(" ")[0]
            regions[k][0] += 1; regions[k][1] += e["dur"] / 1e3
    out["autograd_thread_regions_ms"] = {k: [v[0], round(v[1], 1)] for k, v in sorted(regions.items(), key=lambda kv: -kv[1][1])[:12]}
    # kernels by name on the compute stream in backward (top)
    kn = defaultdict(float)
    for a, b in wins:
        for k in ck:
            if a <= k["ts"] < b:
                kn[k["name"][:60]] += k["dur"] / 1e3
    out["compute_kernels_ms"] = {k: round(v, 1) for k, v in sorted(kn.items(), key=lambda kv: -kv[1])[:12]}
    for s in nccl:
        kn = defaultdict(lambda: [0, 0.0])
        for k in streams[s]:
            kn[k["name"][:50]][0] += 1; kn[k["name"][:50]][1] += k["dur"] / 1e3
        out[f"nccl_{s}"] = {k: [v[0], round(v[1], 1)] for k, v in kn.items()}
    return out


if __name__ == "__main__":
    res = {}
    for d in sys.argv[2:]:
        for p in sorted(Path(d).rglob("*trace*rank*.json*")):
            try:
                r = analyse(p)
            except Exception as exc:
                r = {"error": repr(exc)}
            res[f"{d}/{p.name}"] = r
            print(json.dumps(r, indent=1)[:6000])
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
