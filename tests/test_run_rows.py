"""A fresh run's rows are its own: every earlier run's metrics files in the run dir, those of ranks this
run does not have too, are moved aside by rank 0 before any rank writes; a resumed run appends as before;
the report reads the current run's file alone."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from fsdp_offload import report, run_rows
from fsdp_offload.job_errors import JobError
from fsdp_offload.run_rows import rows_file, set_aside_all, start_fresh

from dist_utils import run_ranks

STAMPED = r"\.\d{8}-\d{6}(-\d+)?\.jsonl"  # (set_aside's names: the file's last write)


def earlier_run(folder: Path, ranks: int, name: str = "metrics.jsonl") -> None:
    """What an earlier run of `ranks` ranks left: one row a rank."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        Path(rows_file(str(folder), name, rank)).write_text(json.dumps({"step": 0, "rank": rank, "run": "earlier"}) + "\n")


def test_every_rank_s_rows_of_an_earlier_run_are_moved_aside(tmp_path):
    earlier_run(tmp_path, 4)
    (tmp_path / "metrics.20200101-000000.jsonl").write_text('{"step": 0}\n')  # set aside by a run before: left alone
    (tmp_path / "rank1.metrics.jsonl.tmp").write_text("")  # not a metrics file
    (tmp_path / "train.log").write_text("")
    (tmp_path / "rank5.metrics.jsonl").write_text("")  # empty: nothing to keep, left for a run to append to
    moved = set_aside_all(str(tmp_path), "metrics.jsonl")
    assert [Path(p).name for p, _ in moved] == ["metrics.jsonl", *[f"rank{r}.metrics.jsonl" for r in (1, 2, 3)]]
    for path, aside in moved:
        assert re.fullmatch(re.escape(Path(path).name.removesuffix(".jsonl")) + STAMPED, Path(aside).name), aside
        assert json.loads(Path(aside).read_text())["run"] == "earlier"
    assert sorted(p.name for p in tmp_path.glob("*metrics.jsonl")) == ["rank5.metrics.jsonl"]
    assert set_aside_all(str(tmp_path / "none"), "metrics.jsonl") == []  # a dir not made yet: nothing to move


def _fresh_on_each_rank(rank: int, world: int, out_dir: str) -> None:
    """As train.py: a fresh start, then each rank appends its first row at once. Rank 0 is slow to begin:
    a rank that did not wait for it would write a row that rank 0 then moves aside."""
    import torch.distributed as dist

    if rank == 0:
        time.sleep(1.0)
    moved = start_fresh(out_dir, "metrics.jsonl", dist.group.WORLD)
    with open(rows_file(out_dir, "metrics.jsonl", rank), "a") as f:
        f.write(json.dumps({"step": 0, "rank": rank, "run": "this"}) + "\n")
    with open(os.path.join(out_dir, f"moved.{rank}"), "w") as f:
        json.dump(moved, f)


def test_a_fresh_run_with_fewer_ranks_moves_aside_the_extra_ranks_rows_before_any_rank_writes(tmp_path):
    out = tmp_path / "run"
    earlier_run(out, 4)
    run_ranks(2, _fresh_on_each_rank, str(out))
    current = sorted(p.name for p in out.glob("*metrics.jsonl"))
    assert current == ["metrics.jsonl", "rank1.metrics.jsonl"]  # no rank2/rank3 file of the earlier run beside them
    for name in current:
        assert [json.loads(line)["run"] for line in (out / name).read_text().splitlines()] == ["this"]
    asides = sorted(p.name for p in out.iterdir() if re.search(STAMPED + "$", p.name))
    assert len(asides) == 4 and all(json.loads((out / a).read_text())["run"] == "earlier" for a in asides)
    moved = [json.loads((out / f"moved.{r}").read_text()) for r in range(2)]
    assert len(moved[0]) == 4 and moved[1] == []  # rank 0 moved them all (and says so); rank 1 found its own gone


def _failing_on_rank0(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    if rank == 0:  # (as a dir the user may not write in would)
        def refuse(*_):
            raise PermissionError(13, "Permission denied", os.path.join(out_dir, "metrics.jsonl"))

        run_rows.set_aside_all = refuse
    try:
        start_fresh(out_dir, "metrics.jsonl", dist.group.WORLD)
    except (OSError, JobError) as exc:
        with open(os.path.join(out_dir, f"error.{rank}"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")


@pytest.mark.bad_input
def test_rank_0_failing_to_move_them_ends_every_rank(tmp_path):
    run_ranks(2, _failing_on_rank0, str(tmp_path))
    assert (tmp_path / "error.0").read_text().startswith("PermissionError: [Errno 13] Permission denied")  # its line names the option
    assert (tmp_path / "error.1").read_text() == (
        f"JobError: moving an earlier run's rows aside in {tmp_path} failed on rank 0: [Errno 13] Permission denied: "
        f"'{tmp_path}/metrics.jsonl'")  # fmt: skip


def test_train_moves_aside_an_earlier_larger_run_s_rows_and_the_report_reads_its_own(tmp_path):
    from test_train import rows, train

    out = tmp_path / "run"
    earlier_run(out, 3)  # an earlier run of 3 ranks in this dir
    done = train(out, "train.steps=2", "offload=host")
    assert sorted(p.name for p in out.glob("*metrics.jsonl")) == ["metrics.jsonl"]
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [0, 1]
    assert done.stdout.count("an earlier run's rows in") + done.stderr.count("an earlier run's rows in") == 3
    assert [r["step"] for r in report.load_run(str(out)).rows] == [0, 1]

    # a run writing another metrics file: the report reads the one the run's config names, not metrics.jsonl above
    train(out, "train.steps=3", "offload=host", "train.metrics_file=m.jsonl")
    assert [r["step"] for r in report.load_run(str(out)).rows] == [0, 1, 2]
