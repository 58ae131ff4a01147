"""The fault campaign's record as markdown: its tables, and the sections of docs/reliability.md it
fills (`fault_campaign.py --doc`, or `--doc-from RECORD.json` for a record made on another machine).
A CPU record fills the `fault_campaign` and `run_faults` sections; a GPU record (train.device=cuda)
fills `gpu_campaign`, leaving the CPU sections as they were."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

RUN_COLUMNS = ["resumed_bit_exact", "refused_named", "missed", "skipped", "bad"]
TIER_BAD = ("silent_corruption", "hang", "undetected_error", "campaign_error")


def tier_table(outcomes: dict[str, dict[str, int]]) -> str:
    """The tier trials per place and fault ("place/kind" -> outcome counts)."""
    errors = any("campaign_error" in c for c in outcomes.values())  # a column only when the campaign failed somewhere
    lines = ["| place | fault | trials | exact | detected | silent corruption | hang | unnamed error |" + (" campaign error |" * errors),
             "| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" * errors)]  # fmt: skip
    for cell, c in outcomes.items():
        place, kind = cell.split("/")
        lines.append(f"| {place} | {kind} | {sum(c.values())} | {c.get('exact', 0)} | {c.get('detected', 0)} | "
                     f"{c.get('silent_corruption', 0)} | {c.get('hang', 0)} | {c.get('undetected_error', 0)} |"
                     + (f" {c.get('campaign_error', 0)} |" * errors))  # fmt: skip
    return "\n".join(lines)


def run_table(counts: dict[str, dict[str, int]], first: str = "run case") -> str:
    """Whole-run outcomes per case (or per rank count) as a markdown table."""
    cols = RUN_COLUMNS + ["campaign_error"] * any("campaign_error" in c for c in counts.values())
    rows = [f"| {first} | trials | " + " | ".join(c.replace("_", " ") for c in cols) + " |", "| --- " * (len(cols) + 2) + "|"]
    rows += [f"| {case} | {sum(c.values())} | " + " | ".join(str(c.get(col, 0)) for col in cols) + " |" for case, c in counts.items()]
    return "\n".join(rows)


def tables(record: dict) -> str:
    """Every table the record has, as the console shows them."""
    parts = [record["table"]] if record.get("trials") else []
    if record.get("kill_trials"):
        parts.append(run_table(record["kill_outcomes"], "kill/resume"))
    if record.get("run_trials"):
        parts.append(run_table(record["run_outcomes"]))
    return "\n\n".join(parts)


def _replace(doc: str, name: str, body: str) -> None:
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    text = Path(doc).read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"error: --doc {doc} has no '{begin}' ... '{end}' section to fill")
    Path(doc).write_text(text[: text.index(begin)] + f"{begin}\n{body}\n{end}" + text[text.index(end) + len(end):])


def _totals(counts: dict[str, dict[str, int]]) -> collections.Counter:
    total: collections.Counter = collections.Counter()
    for c in counts.values():
        total.update(c)
    return total


def _cut(record: dict, phase: str) -> str:
    asked, ran = record.get("asked", {}).get(phase), record.get("ran", {}).get(phase)
    return f" ({ran} of {asked} asked: the rest did not fit the time budget)" if asked is not None and ran != asked else ""


def _tier_line(record: dict) -> str:
    bad = sum(c.get(o, 0) for c in record["outcomes"].values() for o in TIER_BAD)
    return (f"{record['trials']} tier trials{_cut(record, 'tier')}, {record['faults_injected']} faults injected, "
            f"{record['faults_recovered']} of them ended bit-exact or with an error naming the file; {bad} trials lost state "
            "silently, hung or failed without saying where")  # fmt: skip


def _run_line(record: dict) -> str:
    c = _totals(record["run_outcomes"])
    return (f"{record['run_trials']} runs{_cut(record, 'run')}, {c['resumed_bit_exact']} resumed bit for bit, {c['refused_named']} refused "
            f"in one named line, {c['missed']} kills that came too late (still bit for bit), {c['skipped']} skipped, "
            f"{record['run_bad']} bad")  # fmt: skip


def _kill_line(record: dict) -> str:
    c = _totals(record["kill_outcomes"])
    return (f"{record['kill_trials']} kill/resume trials{_cut(record, 'kill')} with {record['kills']} SIGKILLs of every rank: "
            f"{c['resumed_bit_exact']} resumed bit for bit in state and in every step's loss, {c['missed']} whose kills all came "
            f"after the run ended (still bit for bit), {c['bad'] + c['campaign_error']} bad")  # fmt: skip


def fill(doc: str, json_path: str) -> None:
    """Writes the record at `json_path` into the sections of `doc` it belongs in."""
    record = json.loads(Path(json_path).read_text())
    name, commit = os.path.basename(json_path), record["commit"][:7]
    where = record.get("campaign", {"train_device": "cpu"})
    if where["train_device"] == "cuda":
        skipped = sorted({f"{r['case']}: {r['why']}" for r in record.get("run_trials_detail", []) if r["outcome"] == "skipped"})
        refs = "; ".join(f"{n} ranks: reference {r['run_s']:.1f} s, rerun bit for bit: {r.get('repeat_bit_exact')}"
                         for n, r in record.get("references", {}).items())  # fmt: skip
        head = (f"`{name}` (commit {commit}, {record['device']}: {', '.join(where.get('gpus', [])[:1])} x "
                f"{'/'.join(str(n) for n in where['nproc'])} ranks on {where['backend']}, tier `{where['tier_scheme']}:`"
                f"{', KvikIO ' + where['kvikio'] if 'kvikio' in where else ''}; {record['wall_s']:.0f} s). {refs}.")  # fmt: skip
        lines = [head, ""]
        for key, line in (("kill_trials", _kill_line), ("run_trials", _run_line), ("trials", _tier_line)):
            if record.get(key):
                lines.append(f"- {line(record)}.")
        lines += [f"- skipped: {s}" for s in skipped]
        body = "\n".join(lines) + "\n\n" + tables(record)
        _replace(doc, "gpu_campaign", body)
    else:
        if record.get("trials"):
            _replace(doc, "fault_campaign", f"`{name}` (commit {commit}): {_tier_line(record)}.\n\n{record['table']}")
        if record.get("run_trials") or record.get("kill_trials"):
            lines = [f"- {_kill_line(record)}."] if record.get("kill_trials") else []
            lines += [f"- {_run_line(record)}."] if record.get("run_trials") else []
            parts = [run_table(record["kill_outcomes"], "kill/resume")] if record.get("kill_trials") else []
            parts += [run_table(record["run_outcomes"])] if record.get("run_trials") else []
            _replace(doc, "run_faults", f"`{name}` (commit {commit}):\n" + "\n".join(lines) + "\n\n" + "\n\n".join(parts))
    print(f"updated {doc}")
