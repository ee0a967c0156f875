"""`infersmith report`'s tables, from candidates logged to a real MLflow store (SQLite), and the
input-set rotation that the timings behind them rest on."""
from __future__ import annotations

import pytest

from contract.job import Candidate
from contract.verdict import ShapeTiming, Verdict
from harness.timing import ROTATION_CAP, rotation_count
from tracking.history import search
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
        # the candidate's figure is the mean of its two timings
        timing("decode_b8", 2.000, 2.010, 2.013),           # 0.4% faster, spread 0.5%: tie
        timing("decode_b32", 2.000, 2.004, 2.050),          # 2.5% faster, spread 0.2%
        timing("decode_b128", 2.000, 2.002, 1.990),         # 0.5% slower, spread 0.1%
        timing("prefill_2048", 10.0, 10.1, 10.0),           # 0.5% slower, spread 1%: tie
        timing("prefill_16384", 141.44, 141.44, 141.312)])  # 0.09% slower, spread 0

    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")
            for line in report(tracker, "rmsnorm").splitlines() if line.startswith("| ")}
    assert rows["decode_b8"][5] == "1.004x tie"
    assert rows["decode_b32"][5] == "1.02x"
    assert rows["decode_b128"][5] == "0.99x"
    assert rows["prefill_2048"][5] == "0.995x tie"
    assert rows["prefill_16384"][5] == "0.999x"  # not a tie, and not hidden as 1.00x


def _log(tracker: Tracker, cand: Candidate, timings: list[ShapeTiming], flags: tuple[str, ...] = (),
         torch_version: str = "2.11") -> None:
    """One more passed, GPU-timed candidate in the store `_logged` made."""
    scope = RunScope(cand.op, "qwen3-8b", "qwen3-8b/bf16/d1/p2048", "h200")
    parent = tracker.start_parent("optimization", scope, "report-test", {})
    verdict = Verdict(cand.op, cand.id, device={"gpu_timing": True, "name": "NVIDIA H200", "torch": torch_version,
                                                "triton": "3.5", "cuda": "12.8", "driver": "580.1"},
                      timings=timings, flags=list(flags))
    tracker.finish_candidate(tracker.open_candidate(parent, scope, cand), cand, verdict, Charge())


def _rows(table: str) -> dict[str, list[str]]:
    return {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines()
            if line.startswith("| ") and not line.startswith(("| shape", "| ---"))}


def _header(table: str) -> str:
    return next(line for line in table.splitlines() if "passed candidates" in line)


def _point(block: int) -> Candidate:
    return Candidate("silu_mul", "template", "flat", {"block": block, "num_warps": 4, "num_stages": 1})


def test_a_reference_fallback_is_never_a_shapes_best_candidate_and_is_counted(tmp_path, monkeypatch):
    """A candidate that calls torch's own op times torch: however fast that reads, the report shows
    the fastest real candidate, and says that one was left out and why. The flags are a tag."""
    honest = _point(1024)
    tracker = _logged(tmp_path, monkeypatch, honest, [_timing("decode_b1", 2.0, 2.5), _timing("prefill_2048", 20.0, 2.5)])
    fallback = Candidate("silu_mul", "free", source="import torch\n\ndef silu_mul(gate, up):\n"
                                                    "    return torch.nn.functional.silu(gate) * up\n")
    _log(tracker, fallback, [_timing("decode_b1", 1.0, 2.5), _timing("prefill_2048", 10.0, 2.5)],
         flags=("reference_fallback", "side_stream"))

    tagged = [r.data.tags.get("infersmith.flags") for r in search(tracker, "silu_mul", status="pass")]
    assert sorted(tagged) == ["", "reference_fallback,side_stream"]
    table = report(tracker, "silu_mul")
    rows = _rows(table)
    assert set(rows) == {"decode_b1", "prefill_2048"}
    assert all(row[1] == "`block=1024,num_stages=1,num_warps=4`" for row in rows.values())
    assert _header(table).startswith("2 passed candidates (1 flagged `reference_fallback` left out: it calls "
                                      "PyTorch's own silu_mul, so its speed is torch's); measured ")


@pytest.mark.parametrize("slow_first", [True, False])
def test_the_header_names_the_versions_of_the_rows_shown(tmp_path, monkeypatch, slow_first):
    """Whichever run the store returns first, the header's versions are those of the runs whose rows
    are shown; where the rows' runs differ, each version is named with its shapes."""
    fast, slow, mixed = _point(1024), _point(256), _point(4096)
    shapes = ("decode_b1", "decode_b8", "prefill_2048")
    logged = [(fast, [_timing(s, 1.0, 2.5) for s in shapes], "2.11"),
              (slow, [_timing(s, 5.0, 2.5) for s in shapes], "2.10")]
    if slow_first:
        logged.reverse()
    tracker = _logged(tmp_path, monkeypatch, _point(512), [_timing(s, 9.0, 2.5) for s in shapes])
    for cand, timings, version in logged:
        _log(tracker, cand, timings, torch_version=version)
    header = _header(report(tracker, "silu_mul"))
    assert "torch 2.11, triton 3.5, CUDA 12.8, driver 580.1." in header and "2.10" not in header

    _log(tracker, mixed, [_timing("decode_b1", 0.5, 2.5)], torch_version="2.12")
    header = _header(report(tracker, "silu_mul"))
    assert "torch 2.11 (decode_b8, prefill_2048) and 2.12 (decode_b1), triton 3.5," in header
