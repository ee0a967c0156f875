"""The op description proposers that write code read (proposers/describe.py), built from what a
real MLflow store on SQLite holds: the target's shapes with bytes, FLOPs and rooflines at the GPU
class's measured ceilings, the best passed candidates' sources with per-shape figures, the last
failures with their gate; never the shapes the check stage adds or anything of the harness."""
from __future__ import annotations

from conftest import CANDIDATES

from contract.job import Candidate
from contract.verdict import ShapeTiming, Verdict
from engine_templates.ops import get_op
from engine_templates.ops.base import DTYPES
from proposers.describe import describe, render
from targets import Target
from tracking.history import ceilings, trials
from tracking.ledger import Charge
from tracking.schema import RunScope, Tracker
from tracking.store import TrackingConfig

TARGET = Target(model="tiny")
CEIL = {"copy_bytes_per_s": 4.0e12, "matmul_flops_per_s": 7.0e14}


def store(tmp_path, monkeypatch) -> Tracker:
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return Tracker(TrackingConfig.from_env())


def judged(tracker: Tracker, scope: RunScope, cand: Candidate, speedup: float | None, gate: str = "",
           detail: str = "") -> str:
    """A candidate judged on an H200: passed `speedup` times faster than eager on every shape, or
    stopped at `gate`."""
    op = get_op(cand.op)
    w = TARGET.workload
    verdict = Verdict(cand.op, cand.id, device={"gpu_timing": True, "name": "NVIDIA H200", "ceilings": CEIL})
    if gate:
        verdict.gate(gate, False, detail)
    else:
        verdict.timings = [ShapeTiming(s.label, s.dims, 10.0, 10.0, 10.0 * speedup, None, 2.0,
                                       op.bytes(s, DTYPES["bf16"]), op.flops(s))
                           for s in op.shapes(TARGET.dims, w.decode_batches, w.prefill_tokens, w.contexts)]
    parent = tracker.start_parent("optimization", scope, "describe-test", {})
    run_id = tracker.open_candidate(parent, scope, cand)
    tracker.finish_candidate(run_id, cand, verdict, Charge(gpu_class="h200"))
    return run_id


def test_the_description_holds_the_shapes_ceilings_best_sources_and_last_failures(tmp_path, monkeypatch):
    tracker = store(tmp_path, monkeypatch)
    scope = RunScope("rmsnorm", "tiny", TARGET.key(), "h200")
    honest = (CANDIDATES / "rmsnorm" / "honest_torch.py").read_text()
    slower = honest + "\n# a slower copy\n"
    judged(tracker, scope, Candidate("rmsnorm", "free", source=slower, origin="llm"), 1.1)
    judged(tracker, scope, Candidate("rmsnorm", "free", source=honest, origin="llm"), 2.5)
    rows = Candidate("rmsnorm", "template", "rows", {"block_n": 0, "rows_per_program": 1, "num_warps": 4,
                                                       "num_stages": 1}, origin="tpe")
    judged(tracker, scope, rows, 1.7)
    stale = (CANDIDATES / "rmsnorm" / "stale_buffer.py").read_text()
    judged(tracker, scope, Candidate("rmsnorm", "free", source=stale, origin="llm"), None, "accuracy",
           "decode_b1 (heavy inputs, seed 90210): rel error 1.41 > 0.01")

    history = trials(tracker, scope, None)
    assert len(history) == 4 and {t.state for t in history} == {"pass", "fail"}
    assert any(t.candidate.source == stale for t in history)  # a free candidate's source comes back
    assert [t.state for t in trials(tracker, scope, "rows")] == ["pass"]  # one template's trials only
    ceil = ceilings(tracker, "h200", "bf16")
    assert ceil is not None and ceil.copy_bytes_per_s == CEIL["copy_bytes_per_s"] and ceil.device == "NVIDIA H200"
    assert ceilings(tracker, "h200", "fp32") is None and ceilings(tracker, "h100", "bf16") is None

    d = describe("rmsnorm", TARGET, history, ceil, top=2)
    assert [b.score for b in d.best] == [2.5, 1.7] and d.best[0].source == honest and d.best[1].source is None
    assert d.best[0].shapes["decode_b1"]["speedup_vs_eager"] == 2.5
    # the seed of the inputs it failed on is the oracle's: dropped
    assert [(f.gate, f.detail) for f in d.failures] == [("accuracy", "decode_b1 (heavy inputs): rel error 1.41 > 0.01")]
    op = get_op("rmsnorm")
    assert [s.label for s in d.shapes] == ["decode_b1", "decode_b4", "prefill_40"]
    prefill = d.shapes[-1]
    assert prefill.roofline_us == max(prefill.bytes / 4.0e12, prefill.flops / 7.0e14) * 1e6

    text = render(d)
    assert honest.strip() in text and slower.strip() not in text  # only the top two
    assert "Template `rows` at point" in text and "accuracy" in text and "rel error 1.41" in text
    assert "| decode_b1 | 10.00 us | 20.0% | 2.50x | - |" in text
    assert "def reference" in text and "def eager" in text and "def build(" in text and "4 TB/s" in text
    assert "def draw(" in text and '"uniform", scale=0.5) + 1.0' in text  # how the arguments are built
    for odd in op.odd_shapes(TARGET.dims):  # checked, never shown
        assert odd.label not in text
    assert "harness" not in text and "seed" not in text and "90210" not in text


def test_an_empty_history_still_describes_the_op(tmp_path, monkeypatch):
    d = describe("silu_mul", Target(model="tiny", dtype="fp32"), [])
    text = render(d)
    assert d.best == [] and d.failures == [] and d.ceilings is None
    assert "silu_mul(gate, up)" in text and "Not measured" in text and "None yet." in text
    assert d.to_dict()["shapes"][0]["label"] == "decode_b1"
