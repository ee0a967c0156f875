"""`infersmith report`'s tables, from candidates logged to a real MLflow store (SQLite), and the
input-set rotation that the timings behind them rest on."""
from __future__ import annotations

from harness.job import Candidate
from harness.timing import ROTATION_CAP, rotation_count
from harness.verdict import ShapeTiming, Verdict
from tracking.ledger import Charge
from tracking.report import report
from tracking.schema import RunScope, Tracker
from tracking.store import TrackingConfig

H200_L2 = 60 * 2**20


def test_rotation_covers_twice_the_l2_down_to_the_cap():
    assert rotation_count(134_000_000, H200_L2) == 1  # decode_attention, 32k context
    assert rotation_count(1_200_000, H200_L2) == 105  # silu_mul at qwen3-30b-a3b batch 32: 126 MB
    assert 105 * 1_200_000 >= 2 * H200_L2
    assert rotation_count(24_000, H200_L2) == ROTATION_CAP  # rmsnorm at batch 1: capped
    assert rotation_count(0, H200_L2) == 1


def _timing(label: str, us: float, l2_cover: float) -> ShapeTiming:
    return ShapeTiming(label, {}, us, us * 1.01, 3 * us, 1.2 * us, roofline_us=us / 2, bytes=1 << 20,
                       flops=0, method="graph", l2_cover=l2_cover)


def _logged(tmp_path, monkeypatch, cand: Candidate, timings: list[ShapeTiming]) -> Tracker:
    """A real tracking store under tmp_path holding one passed, GPU-timed candidate."""
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker(TrackingConfig.from_env())
    scope = RunScope(cand.op, "qwen3-8b", "qwen3-8b/bf16/d1/p2048", "h200")
    parent = tracker.start_parent("optimization", scope, "report-test", {})
    verdict = Verdict(cand.op, cand.id, device={"gpu_timing": True, "name": "NVIDIA H200", "torch": "2.11"},
                      timings=timings)
    tracker.finish_candidate(tracker.open_candidate(parent, scope, cand), cand, verdict, Charge())
    return tracker


def test_the_report_marks_shapes_whose_input_sets_fit_in_the_l2(tmp_path, monkeypatch):
    cand = Candidate("silu_mul", "template", "flat", {"block": 1024, "num_warps": 4, "num_stages": 1})
    tracker = _logged(tmp_path, monkeypatch, cand, [_timing("decode_b1", 1.2, 0.4), _timing("prefill_2048", 20.0, 2.1),
                                                    _timing("decode_b8", 1.3, 0.0)])

    table = report(tracker, "silu_mul")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "decode_b1 † (0.4x L2)" in rows  # capped: the sets were 0.4x the L2
    assert "prefill_2048" in rows and "decode_b8" in rows  # covered, or not known (a CPU, an old run)
    assert "`block=1024,num_stages=1,num_warps=4`" in rows["prefill_2048"]
    assert "† the rotated input sets total less than twice the GPU's L2" in table


def test_the_report_calls_a_difference_within_the_spread_a_tie(tmp_path, monkeypatch):
    cand = Candidate("rmsnorm", "template", "rows", {"block_n": 0, "rows_per_program": 1, "num_warps": 0,
                                                      "num_stages": 1})

    def timing(label, us, repeat, compile_us):
        return ShapeTiming(label, {}, us, repeat, 3 * us, compile_us, roofline_us=us / 2, bytes=1 << 20,
                           flops=0, method="graph", l2_cover=2.5)

    tracker = _logged(tmp_path, monkeypatch, cand, [
        timing("decode_b8", 2.000, 2.010, 2.008),           # 0.4% faster, spread 0.5%: tie
        timing("decode_b32", 2.000, 2.004, 2.050),          # 2.5% faster, spread 0.2%
        timing("decode_b128", 2.000, 2.002, 1.990),         # 0.5% slower, spread 0.1%
        timing("prefill_2048", 10.0, 10.1, 9.95),           # 0.5% slower, spread 1%: tie
        timing("prefill_16384", 141.44, 141.44, 141.312)])  # 0.09% slower, spread 0

    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
            for line in report(tracker, "rmsnorm").splitlines() if line.startswith("| ")}
    assert rows["decode_b8"][5] == "1.004x tie"
    assert rows["decode_b32"][5] == "1.02x"
    assert rows["decode_b128"][5] == "0.99x"
    assert rows["prefill_2048"][5] == "0.995x tie"
    assert rows["prefill_16384"][5] == "0.999x"  # not a tie, and not hidden as 1.00x
