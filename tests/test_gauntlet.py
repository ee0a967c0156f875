"""The gauntlet on this machine: every red-team candidate is rejected by the gate its vector
names, and every honest candidate passes (shared/GAUNTLET.md; harness/gauntlet/manifest.toml).
Real supervisor and sandbox processes, Triton's interpreter when there is no GPU."""
from __future__ import annotations

from pathlib import Path

import pytest

from flows.gauntlet import run_case, table
from flows.target import Target
from gpu_pool.pool import local_pool
from harness.gauntlet import load_cases

TARGET = Target(model="tiny", budget={"stage_timeout_s": 120})
CASES = load_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_gets_its_expected_verdict(case):
    row = run_case(case, TARGET, local_pool().slots()[0])
    assert row.ok, f"expected {case.expected}, got {row.got}\n{row.verdict.to_json()}"
    if case.expect == "pass":
        assert row.verdict.stages == ["compile", "check", "bench"] and row.verdict.timings
        assert row.verdict.score() <= 1.0 or "reference_fallback" not in row.verdict.flags
    else:
        assert row.verdict.score() is None


def test_manifest_lists_every_file_and_every_vector():
    here = Path(__file__).resolve().parent.parent / "harness" / "gauntlet"
    listed = {f"{c.op}/{c.file}" for c in CASES if c.file}
    on_disk = {f"{p.parent.name}/{p.name}" for p in here.glob("*/*.py")}
    unused = on_disk - listed - {"rmsnorm/syntax_error.py", "rmsnorm/wrong_signature.py"}  # usage errors
    assert not unused, f"candidates not in the manifest: {sorted(unused)}"
    vectors = {c.vector for c in CASES}
    for v in ("stale output", "input mutation", "caching", "constant / low-signal output", "hidden work",
              "lazy result", "timer patching", "reference fallback", "reading the oracle", "harness editing",
              "precision downgrade", "runaway", "forged verdict", "network", "process creation", "honest"):
        assert v in vectors, v
    for op in ("rmsnorm", "silu_mul"):
        assert {c.vector for c in CASES if c.op == op and c.expect != "pass"} >= {
            "stale output", "input mutation", "caching", "constant / low-signal output", "hidden work",
            "lazy result", "timer patching", "reference fallback", "precision downgrade"}, op


def test_table_marks_a_wrong_verdict():
    from flows.gauntlet import Row
    from harness.verdict import Verdict

    case = next(c for c in CASES if c.gate == "caching")
    passed = Verdict(op=case.op, candidate_id="x")
    text = table([Row(case, passed, 1.0)], on_gpu=False)
    assert "| pass | **NO** |" in text and "red team rejected as expected: 0/1" in text
