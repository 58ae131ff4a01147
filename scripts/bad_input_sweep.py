"""Runs every bad-input test (pytest marker `bad_input`: the public API, the CLI and recipes, token
files, checkpoints missing, damaged, pickled or from another model or world size, tier and lock dirs)
and records each case and its outcome. A case passes when its bad input was refused with a message
naming the option or path and the fix, and nothing on disk changed (what each test asserts).

    python scripts/bad_input_sweep.py --device-kind cpu

One JSON under --out (result keys: bad_inputs_tested, bad_inputs_failed, cases, command, device, commit).
Exits 1 when a case failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest

from fsdp_offload.results import record

TESTS = Path(__file__).resolve().parents[1] / "tests"


class Outcomes:
    """A pytest plugin that keeps each test's outcome."""

    def __init__(self) -> None:
        self.cases: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or report.outcome != "passed":  # a setup error or a skip counts too
            self.cases.setdefault(report.nodeid, report.outcome)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device-kind", default="cpu", help="machine kind for the record")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    outcomes = Outcomes()
    start = time.perf_counter()
    code = pytest.main(["-q", "-m", "bad_input", "-p", "no:cacheprovider", str(TESTS)], plugins=[outcomes])
    cases = [{"case": nodeid, "outcome": outcome} for nodeid, outcome in sorted(outcomes.cases.items())]
    passed = sum(c["outcome"] == "passed" for c in cases)
    failed = [c["case"] for c in cases if c["outcome"] == "failed"]
    path = record("bad_input_sweep", args.device_kind, args.out, {
        "bad_inputs_tested": passed, "bad_inputs_failed": len(failed), "bad_inputs_skipped": len(cases) - passed - len(failed),
        "pytest_exit_code": int(code), "wall_s": time.perf_counter() - start, "cases": cases,
    })  # fmt: skip
    print(f"{passed} bad inputs refused as they should be, {len(failed)} failed; wrote {path}")
    for case in failed:
        print(f"failed: {case}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
