"""Who each collective waited for: reads the per-rank traces of one profiled step (train.py
`train.profile_step=N` leaves trace_stepN_rankR.json[.gz] in the run dir) and, collective by collective,
sets each rank's NCCL kernel start beside the others'. A collective moves its bytes only once the last
rank has started it, so for each one:

- transfer = its end - the last rank's start (moving bytes);
- wait, per rank = the last rank's start - this rank's start (time spent in the kernel for a late rank).

Also per rank: its GPU compute-kernel time and which rank was last how often. The traces of one machine
share a clock (Kineto's timestamps are the host's), so starts compare across ranks.

    python scripts/trace_waits.py outputs/run --step 4 --device-kind nvidia-h200-x4

One JSON under --out (default: the run dir; result keys: source, step, ranks, collectives, per_rank, transfer_ms_total,
wait_ms_mean); a table on stdout.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
from pathlib import Path

from fsdp_offload.results import record


def load_trace(path: Path) -> list[dict]:
    """The complete events, their `ts` in microseconds since the epoch (Kineto's are since the trace's
    baseTimeNanoseconds, which may differ between ranks)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    return [{**e, "ts": e["ts"] + base_us} for e in trace["traceEvents"] if e.get("ph") == "X"]


def rank_traces(run_dir: Path, step: int) -> list[list[dict]]:
    """The complete events of each rank's trace of `step`, in rank order."""
    traces = []
    while True:
        found = [p for p in (run_dir / f"trace_step{step}_rank{len(traces)}.json{ext}" for ext in ("", ".gz")) if p.exists()]
        if not found:
            break
        traces.append(load_trace(found[0]))
    if not traces:
        if not run_dir.is_dir():
            raise SystemExit(f"{run_dir} is not a dir: give the run dir that holds trace_step<N>_rank<R>.json[.gz] "
                             "(train.py's train.out_dir, or its Hydra run dir)")  # fmt: skip
        steps = sorted({int(m.group(1)) for p in run_dir.glob("trace_step*_rank0.json*") if (m := re.match(r"trace_step(\d+)_", p.name))})
        there = f"it holds step(s) {steps}" if steps else "it holds no trace"
        raise SystemExit(f"{run_dir}: no trace_step{step}_rank0.json[.gz] ({there}); run train.py with train.profile_step={step}")
    return traces


def writable_out(out: str | None, run_dir: Path) -> str:
    """Where the JSON goes (--out, else the run dir), refused at once where it cannot be written."""
    where = Path(out) if out else run_dir
    existing = where
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        raise SystemExit(f"cannot write the JSON into {where}: pass --out <a dir you can write>")
    return str(where)


def is_collective(event: dict) -> bool:
    return event.get("cat") == "kernel" and event["name"].startswith("ncclDevKernel")


def waits(traces: list[list[dict]]) -> dict:
    """Per collective and per rank, as the module's doc says (times in ms)."""
    kernels = [sorted((e for e in t if is_collective(e)), key=lambda e: e["ts"]) for t in traces]
    counts = {len(k) for k in kernels}
    if len(counts) != 1:
        raise SystemExit(f"the ranks' traces hold different numbers of collectives ({sorted(counts)}): not one step of one run")
    if counts == {0}:
        raise SystemExit(f"the {len(traces)} rank(s)' traces hold no NCCL collective kernel: trace_waits reads when each rank's "
                         "GPU ran its collectives, so it needs a run on GPUs with NCCL (a gloo run's collectives are CPU "
                         "ops such as gloo:all_reduce; trace_ops.py --region gloo:all_reduce sums their time)")  # fmt: skip
    ranks, origin = len(traces), min(k[0]["ts"] for k in kernels if k)
    collectives, last_count, waited = [], [0] * ranks, [0.0] * ranks
    for i in range(counts.pop()):
        names = {k[i]["name"].split("(")[0] for k in kernels}
        if len(names) != 1:  # several process groups whose collectives interleave differently per rank
            raise SystemExit(f"collective {i} is {sorted(names)} on different ranks: these traces cannot be paired by order")
        starts = [k[i]["ts"] for k in kernels]
        last = max(starts)
        end = max(k[i]["ts"] + k[i]["dur"] for k in kernels)
        late = starts.index(last)
        last_count[late] += 1
        for r in range(ranks):
            waited[r] += (last - starts[r]) / 1e3
        collectives.append({"name": kernels[0][i]["name"].split("(")[0], "start_ms": [(s - origin) / 1e3 for s in starts],
                            "transfer_ms": (end - last) / 1e3, "last_rank": late})  # fmt: skip
    compute = [sum(e["dur"] for e in t if e.get("cat") == "kernel" and not is_collective(e)) / 1e3 for t in traces]
    per_rank = [{"rank": r, "waited_ms": waited[r], "last_in": last_count[r], "compute_kernels_ms": compute[r]} for r in range(ranks)]
    return {"ranks": ranks, "collectives": collectives, "per_rank": per_rank,
            "transfer_ms_total": sum(c["transfer_ms"] for c in collectives),
            "wait_ms_mean": sum(waited) / ranks}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--step", type=int, required=True, help="the profiled step (train.profile_step)")
    ap.add_argument("--device-kind", required=True, help="the machine the traces were taken on")
    ap.add_argument("--out", default=None, help="where the JSON goes (default: the run dir, beside the traces)")
    args = ap.parse_args()
    out = writable_out(args.out, args.run_dir)
    result = waits(rank_traces(args.run_dir, args.step))
    print(f"{len(result['collectives'])} collectives over {result['ranks']} ranks; moving bytes {result['transfer_ms_total']:.1f} ms, "
          f"waiting for the last rank {result['wait_ms_mean']:.1f} ms a rank on average")  # fmt: skip
    print(f"{'rank':>4} {'waited ms':>10} {'last in':>8} {'compute kernels ms':>19}")
    for r in result["per_rank"]:
        print(f"{r['rank']:4d} {r['waited_ms']:10.1f} {r['last_in']:8d} {r['compute_kernels_ms']:19.1f}")
    path = record("trace_waits", args.device_kind, out, {"source": str(args.run_dir), "step": args.step, **result})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
