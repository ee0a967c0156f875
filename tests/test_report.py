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


def test_the_report_marks_shapes_whose_input_sets_fit_in_the_l2(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker(TrackingConfig.from_env())
    scope = RunScope("silu_mul", "qwen3-8b", "qwen3-8b/bf16/d1/p2048", "h200")
    parent = tracker.start_parent("optimization", scope, "report-test", {})
    cand = Candidate("silu_mul", "template", "flat", {"block": 1024, "num_warps": 4, "num_stages": 1})
    verdict = Verdict("silu_mul", cand.id, device={"gpu_timing": True, "name": "NVIDIA H200", "torch": "2.11"},
                      timings=[_timing("decode_b1", 1.2, 0.4), _timing("prefill_2048", 20.0, 2.1),
                               _timing("decode_b8", 1.3, 0.0)])
    tracker.finish_candidate(tracker.open_candidate(parent, scope, cand), cand, verdict, Charge())

    table = report(tracker, "silu_mul")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "decode_b1 † (0.4x L2)" in rows  # capped: the sets were 0.4x the L2
    assert "prefill_2048" in rows and "decode_b8" in rows  # covered, or not known (a CPU, an old run)
    assert "`block=1024,num_stages=1,num_warps=4`" in rows["prefill_2048"]
    assert "† the rotated input sets total less than twice the GPU's L2" in table
