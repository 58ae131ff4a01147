"""Where a region of one profiled step spends its CPU time: reads the per-rank traces that train.py
`train.profile_step=N` leaves in the run dir and, for every event named --region, sums the CPU ops
directly inside it on its thread, by name. A region's name may go on after a space with what it ran
on (FSDP2's "FSDP::post_backward_reduce (layers.3)"). The default region is FSDP2's post-backward,
where the grad hooks run; the optimizer's phases are `fsdp_offload.step_begin`,
`fsdp_offload.update`, `fsdp_offload.update_subgroup` and `fsdp_offload.copy_back`. What the region's
time holds beyond its ops is Python and the work between them (a kernel called outside torch's
dispatcher, as the fused CPU AdamW is).

    python scripts/trace_ops.py outputs/run --step 4 --device-kind nvidia-h200-x4

One JSON under --out (default: the run dir; result keys: source, step, region, per_rank: regions, region_ms, ops_ms, ops
{name: {count, ms}}); a table on stdout.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from trace_waits import rank_traces, writable_out

from fsdp_offload.results import record


def direct_children(region: dict, events: list[dict]) -> list[dict]:
    """The events of `region`'s thread that lie inside it and inside no other such event (`events`
    sorted by start, longest first at equal starts). An event spanning exactly the region (a wrapper
    of the same call) is not a child; one that runs past its end covers what starts under it."""
    lo, hi = region["ts"], region["ts"] + region["dur"]
    children, covered_to = [], lo
    for e in events:
        if e["ts"] < lo or e is region or (e["ts"] == lo and e["dur"] == region["dur"]):
            continue
        if e["ts"] >= hi:
            break
        if e["ts"] < covered_to:
            continue  # nested in a child (or in an event that overruns the region)
        if e["ts"] + e["dur"] <= hi:
            children.append(e)
        covered_to = e["ts"] + e["dur"]
    return children


def region_ops(trace: list[dict], region: str) -> dict:
    """Per op name, its calls and CPU ms directly inside the regions named `region*` of one rank."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in trace:
        if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"):
            by_thread[(e["pid"], e["tid"])].append(e)
    ops: dict[str, dict] = defaultdict(lambda: {"count": 0, "ms": 0.0})
    regions, region_ms = 0, 0.0
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        for r in (e for e in events if e["name"] == region or e["name"].startswith(region + " ")):
            regions += 1
            region_ms += r["dur"] / 1e3
            for child in direct_children(r, events):
                ops[child["name"]]["count"] += 1
                ops[child["name"]]["ms"] += child["dur"] / 1e3
    ranked = dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms"]))
    return {"regions": regions, "region_ms": region_ms, "ops_ms": sum(o["ms"] for o in ops.values()), "ops": ranked}


def region_names(trace: list[dict]) -> list[str]:
    """The names of the regions code named in a trace (record_function's), without what each ran on."""
    return sorted({e["name"].split(" ")[0] for e in trace if e.get("cat") == "user_annotation"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the run dir holding trace_step<N>_rank<R>.json[.gz]")
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--region", default="FSDP::post_backward_reduce", help="the regions' name (then a space and anything)")
    ap.add_argument("--device-kind", required=True, help="the machine kind the traces were taken on")
    ap.add_argument("--source", default=None, help="where the traces are kept, for the record (default: run_dir)")
    ap.add_argument("--top", type=int, default=12, help="ops per rank in the table")
    ap.add_argument("--out", default=None, help="where the JSON goes (default: the run dir, beside the traces)")
    args = ap.parse_args()
    out = writable_out(args.out, args.run_dir)
    traces = rank_traces(args.run_dir, args.step)
    per_rank = [region_ops(t, args.region) for t in traces]
    if not any(r["regions"] for r in per_rank):
        raise SystemExit(f"{args.run_dir}: no event named {args.region} in the step {args.step} traces; its named regions: "
                         + ", ".join(region_names(traces[0])))  # fmt: skip
    for rank, r in enumerate(per_rank):
        print(f"rank {rank}: {r['regions']} x {args.region}: {r['region_ms']:.1f} ms, {r['ops_ms']:.1f} ms of it in ops")
        for name, o in list(r["ops"].items())[: args.top]:
            print(f"  {name[:60]:60} {o['count']:5d} {o['ms']:8.2f} ms")
    path = record("trace_ops", args.device_kind, out, {"source": args.source or str(args.run_dir), "step": args.step,
                                                           "region": args.region, "per_rank": per_rank})  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
