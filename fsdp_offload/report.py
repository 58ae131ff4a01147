"""Figures and a table from training runs' per-step metrics (the `metrics.jsonl` that scripts/train.py
writes in its run dir, beside Hydra's `.hydra/config.yaml`):

- iteration time by phase (forward, backward, the `step()` call, the rest), and the update beside it,
  split into what ran hidden behind forward/backward (`overlap_s`) and what the loop waited for
  (`exposed_update_s`);
- effective I/O throughput of the update, and the bytes it read and wrote per step;
- the share of subgroups on each tier per step (MLP-Offload's Figure 10).

    python -m fsdp_offload.report RUN_DIR [RUN_DIR ...] --out figures/ [--skip 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from statistics import mean
from typing import Any

try:
    import matplotlib
except ImportError as exc:
    raise ImportError("fsdp_offload.report draws with matplotlib: pip install 'fsdp-offload[report]'") from exc

matplotlib.use("Agg")  # files, not windows: this also runs headless
import matplotlib.pyplot as plt  # noqa: E402

PHASES = ("forward_s", "backward_s", "step_call_s")


@dataclass
class Run:
    name: str
    path: str
    rows: list[dict[str, Any]]
    offload: dict[str, Any] = field(default_factory=dict)  # the run's offload options, as Hydra recorded them


def load_run(path: str, name: str | None = None) -> Run:
    """A run dir of scripts/train.py: its rank-0 metrics and the offload options it ran with. The rows are
    the last run's alone: the file its config names (train.metrics_file), which a fresh run starts anew
    (earlier runs' rows, every rank's, are moved aside under stamped names that are never read here)."""
    config = os.path.join(path, ".hydra", "config.yaml")
    metrics_file, offload = "metrics.jsonl", {}  # (a run dir without Hydra's record: train.py's defaults)
    if os.path.isfile(config):
        from omegaconf import OmegaConf

        recorded = OmegaConf.load(config)
        metrics_file = str(OmegaConf.select(recorded, "train.metrics_file", default=metrics_file))
        offload = OmegaConf.to_container(recorded.get("offload", {}), resolve=False)
    metrics = os.path.join(path, metrics_file)
    if not os.path.isfile(metrics):
        raise FileNotFoundError(f"{metrics} does not exist: give the run dir of a scripts/train.py run")
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{metrics} has no rows: the run logged no step")
    return Run(name or _run_name(path), path, rows, offload)


def _run_name(path: str) -> str:
    """The dir's name; for a Hydra multirun job (dirs 0, 1, ...), the swept overrides that made it."""
    base = os.path.basename(os.path.normpath(path))
    overrides = os.path.join(path, ".hydra", "overrides.yaml")
    if not (base.isdigit() and os.path.isfile(overrides)):
        return base
    from omegaconf import OmegaConf

    mine = [str(o) for o in OmegaConf.load(overrides)]
    sweep = os.path.join(os.path.dirname(os.path.normpath(path)), "multirun.yaml")
    if os.path.isfile(sweep):  # keep the overrides the sweep varied (those given as a,b,...)
        swept = {str(o).split("=", 1)[0] for o in OmegaConf.load(sweep).hydra.overrides.task if "," in str(o)}
        mine = [o for o in mine if o.split("=", 1)[0] in swept] or mine
    return ",".join(mine) or base


def summarize(run: Run, skip: int = 1) -> dict[str, Any]:
    """Means over the steps after the first `skip` (warm-up) but the profiled one (its times carry the
    profiler's cost), bytes summed over tiers."""
    rows = [r for r in run.rows[skip:] if not r.get("profiled")] or run.rows[-1:]

    def avg(key: str) -> float | None:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return mean(values) if values else None

    out: dict[str, Any] = {"name": run.name, "steps_averaged": len(rows)}
    for key in ("step_s", "forward_s", "backward_s", "step_call_s", "update_s", "exposed_update_s", "overlap_s",
                "effective_io_gbps", "tokens_per_s", "host_peak_gib"):  # fmt: skip
        out[key] = avg(key)
    out["iteration_s"] = out.pop("step_s")
    for key in ("bytes_read", "bytes_written"):
        out[key] = mean(sum((r.get(key) or {}).values()) for r in rows)
    return out


def plot_phases(rows: list[dict[str, Any]], ax) -> None:
    """`rows`: the runs' `summarize`d metrics."""
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for key, label in zip(PHASES, ("forward", "backward", "step() call")):
        values = [r[key] or 0.0 for r in rows]
        ax.bar([i - 0.2 for i in x], values, 0.4, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    rest = [max(0.0, (r["iteration_s"] or 0.0) - b) for r, b in zip(rows, bottom)]
    ax.bar([i - 0.2 for i in x], rest, 0.4, bottom=bottom, label="rest of the iteration", color="lightgray")
    exposed = [r["exposed_update_s"] or 0.0 for r in rows]
    hidden = [max(0.0, (r["update_s"] or 0.0) - e) for r, e in zip(rows, exposed)]
    ax.bar([i + 0.2 for i in x], exposed, 0.4, label="update: exposed", color="tab:red")
    ax.bar([i + 0.2 for i in x], hidden, 0.4, bottom=exposed, label="update: hidden", color="tab:red", alpha=0.35)
    ax.set_xticks(list(x), [r["name"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("seconds per step")
    ax.set_title("iteration by phase (left) and the update (right)")
    ax.legend(fontsize=7)


def plot_io(rows: list[dict[str, Any]], ax_rate, ax_bytes) -> None:
    """`rows`: the runs' `summarize`d metrics."""
    x = list(range(len(rows)))
    ax_rate.bar(x, [r["effective_io_gbps"] or 0.0 for r in rows], color="tab:green")
    ax_rate.set_ylabel("GB/s")
    ax_rate.set_title("effective I/O of the update")
    ax_bytes.bar([i - 0.2 for i in x], [r["bytes_read"] / 1e9 for r in rows], 0.4, label="read")
    ax_bytes.bar([i + 0.2 for i in x], [r["bytes_written"] / 1e9 for r in rows], 0.4, label="written")
    ax_bytes.set_ylabel("GB per step")
    ax_bytes.set_title("bytes moved per step")
    ax_bytes.legend(fontsize=7)
    for ax in (ax_rate, ax_bytes):
        ax.set_xticks(x, [r["name"] for r in rows], rotation=20, ha="right")


def plot_tier_split(run: Run, ax) -> None:
    """Share of the stored subgroups on each tier, step by step."""
    tiers = sorted({t for r in run.rows for t in (r.get("subgroups_per_tier") or {})})
    steps = [r["step"] for r in run.rows]
    bottom = [0.0] * len(steps)
    for tier in tiers:
        share = []
        for r in run.rows:
            counts = r.get("subgroups_per_tier") or {}
            total = sum(counts.values())
            share.append(counts.get(tier, 0) / total if total else 0.0)
        ax.bar(steps, share, bottom=bottom, label=tier)
        bottom = [b + s for b, s in zip(bottom, share)]
    ax.set_xlabel("step")
    ax.set_ylabel("share of stored subgroups")
    ax.set_title(f"tier split per step: {run.name}")
    ax.legend(fontsize=7)


def write_figures(runs: list[Run], out_dir: str, skip: int = 1) -> list[str]:
    """Writes phases.png, io.png and one tiers_<run>.png per run with 2+ tiers; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    rows = [summarize(r, skip) for r in runs]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(runs)), 4.5))
    plot_phases(rows, ax)
    paths.append(_save(fig, out_dir, "phases.png"))
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 2 * len(runs)), 4))
    plot_io(rows, a, b)
    paths.append(_save(fig, out_dir, "io.png"))
    for run in runs:
        if len({t for r in run.rows for t in (r.get("subgroups_per_tier") or {})}) > 1:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            plot_tier_split(run, ax)
            slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in run.name)
            paths.append(_save(fig, out_dir, f"tiers_{slug}.png"))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run dirs of scripts/train.py (each with its metrics.jsonl, rank 0's); files are skipped")
    ap.add_argument("--out", default="figures", help="where the PNGs and summary.json go")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the means")
    args = ap.parse_args(argv)
    # a sweep's dir holds Hydra's multirun.yaml beside the job dirs: `multirun/<date>/<time>/*` names it too
    dirs = [p for p in args.runs if not os.path.isfile(p)]
    try:
        if not dirs:
            raise FileNotFoundError(f"no dir among {args.runs}: give the run dirs of scripts/train.py runs")
        runs = [load_run(p) for p in dirs]
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    paths = write_figures(runs, args.out, args.skip)
    table = [summarize(r, args.skip) for r in runs]
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(table, f, indent=1)
    for row in table:
        print(f"{row['name']:>24}  iteration {row['iteration_s']:.3f} s  update {row['update_s'] or 0:.3f} s  "
              f"exposed {row['exposed_update_s'] or 0:.3f} s  I/O {row['effective_io_gbps'] or 0:.2f} GB/s")  # fmt: skip
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
