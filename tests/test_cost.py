"""What a gain cost, read back from a real MLflow store (SQLite): prices per GPU class from the
pool file; per target the candidates' GPU time and proposer spend with the end-to-end stage's
reference and baseline; $ and GPU-hours per percent gained in `leaderboard` (ops and engine) and
`report`; a sweep's totals; the engine chart; and what revalidate counts as a regression."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from cli.main import main
from contract.job import Candidate
from contract.serve import METRICS, EngineCandidate
from contract.verdict import ShapeTiming, Verdict
from engine_templates.ops.rmsnorm import ROWS_TEMPLATE
from gpu_pool.pool_file import load_pool
from tracking.charts import log_engine_chart
from tracking.compare import regressions
from tracking.cost import spent, sweep_totals
from tracking.ledger import Charge
from tracking.report import report
from tracking.schema import RunScope, Tracker
from tracking.store import TrackingConfig

TARGET = "qwen3-8b/bf16/d1/p2048/c4096"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def tracker(tmp_path, monkeypatch) -> Tracker:
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return Tracker(TrackingConfig.from_env())


def charge(gpu_seconds: float, usd_per_hour: float, tokens: int = 0, proposer_usd: float = 0.0) -> Charge:
    c = Charge(gpu_class="h200", input_tokens=tokens, proposer_usd=proposer_usd)
    c.add_stage("bench", gpu_seconds, usd_per_hour / 3600)
    return c


def log_op(tracker: Tracker, parent: str, point: dict, score: float, spent_: Charge) -> str:
    """A passed rmsnorm candidate, GPU-timed on an H200, `score` times faster than eager on its one shape."""
    cand = Candidate("rmsnorm", "template", ROWS_TEMPLATE.name, ROWS_TEMPLATE.default | point)
    scope = RunScope("rmsnorm", "qwen3-8b", TARGET, "h200")
    verdict = Verdict("rmsnorm", cand.id, device={"gpu_timing": True, "name": "NVIDIA H200", "torch": "2.9.0"},
                      timings=[ShapeTiming("decode_b1", {}, 10.0, 10.0, 10.0 * score, None, roofline_us=5.0,
                                           bytes=1, flops=0)])
    run_id = tracker.open_candidate(parent, scope, cand)
    tracker.finish_candidate(run_id, cand, verdict, spent_)
    return run_id


def test_a_pool_prices_each_gpu_class_and_a_host_may_set_its_own(tmp_path):
    (tmp_path / "pool.yaml").write_text(
        "usd_per_gpu_hour: {h100: 2.0, h200: 3.6}\nhosts:\n"
        "  - {name: a, address: 10.0.0.1, gpus: [0, 1], gpu_class: h100}\n"
        "  - {name: b, address: 10.0.0.2, gpus: [0], gpu_class: h100, usd_per_gpu_hour: 1.5}\n"
        "  - {name: c, address: 10.0.0.3, gpus: [0], gpu_class: h200}\n"
        "  - {name: d, address: 10.0.0.4, gpus: [0], gpu_class: b200}\n")
    pool = load_pool(tmp_path / "pool.yaml")
    assert [(s.label, s.usd_per_gpu_hour) for s in pool.slots()] == [
        ("a:gpu0", 2.0), ("a:gpu1", 2.0), ("b:gpu0", 1.5), ("c:gpu0", 3.6), ("d:gpu0", 0.0)]
    assert pool.slots("h200")[0].usd_per_second == pytest.approx(0.001)
    (tmp_path / "bad.yaml").write_text("usd_per_gpu_hour: {h300: 1}\nhosts: [{name: a}]\n")
    assert main(["pool", "release", "--pool", str(tmp_path / "bad.yaml")]) == 2


def test_a_pool_without_prices_costs_the_shipped_ones_and_a_run_price_wins_over_every_other(tmp_path):
    from gpu_pool.pool import DEFAULT_USD_PER_GPU_HOUR

    (tmp_path / "pool.yaml").write_text(
        "hosts:\n  - {name: a, address: 10.0.0.1, gpus: [0], gpu_class: h100}\n"
        "  - {name: b, address: 10.0.0.2, gpus: [0], gpu_class: b200, usd_per_gpu_hour: 4.0}\n  - {name: c}\n")
    pool = load_pool(tmp_path / "pool.yaml")
    assert [(s.label, s.usd_per_gpu_hour) for s in pool.slots()] == [
        ("a:gpu0", DEFAULT_USD_PER_GPU_HOUR["h100"]), ("b:gpu0", 4.0), ("c:cpu", 0.0)]
    assert DEFAULT_USD_PER_GPU_HOUR["h100"] > 0 and DEFAULT_USD_PER_GPU_HOUR["cpu"] == 0
    assert {s.usd_per_gpu_hour for s in pool.priced(1.25).slots()} == {1.25}


def test_per_target_spend_and_cost_per_gain_in_leaderboard_and_report(tracker, capsys):
    scope = RunScope("rmsnorm", "qwen3-8b", TARGET, "h200")
    first = tracker.start_parent("optimization", scope, "first", {})
    log_op(tracker, first, {"num_warps": 2}, 1.10, charge(1800.0, 3.6))  # half an hour at $3.60/h: $1.80
    log_op(tracker, first, {"num_warps": 4}, 1.25, charge(900.0, 3.6, tokens=5000, proposer_usd=0.45))
    second = tracker.start_parent("optimization", scope, "second", {})
    log_op(tracker, second, {"num_warps": 8}, 0.90, charge(900.0, 3.6))
    # A re-run of a winner (reproduce, revalidate) is no spend on finding it.
    rerun = tracker.start_parent("reproduction", scope, "again", {}, tags={"infersmith.reruns": "x"})
    cand = Candidate("rmsnorm", "template", ROWS_TEMPLATE.name, ROWS_TEMPLATE.default | {"num_warps": 4})
    rerun_id = tracker.open_candidate(rerun, scope, cand, reruns="x")
    tracker.finish_candidate(rerun_id, cand, Verdict("rmsnorm", cand.id, status="fail"), charge(3600.0, 3.6))

    cost, n = spent(tracker, "rmsnorm", TARGET, "h200")
    assert n == 3 and cost.gpu_seconds == pytest.approx(3600.0) and cost.gpu_usd == pytest.approx(3.60)
    assert cost.proposer_tokens == 5000 and cost.usd == pytest.approx(4.05)
    line = "spent on qwen3-8b/bf16/d1/p2048/c4096 (h200): 3 candidates, 1 GPU-h, $4.05 (proposer: 5000 tokens, " \
           "$0.45); best +25% over the baseline: $0.162 and 0.04 GPU-h per 1%"

    assert main(["leaderboard", "--op", "rmsnorm"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["#", "score", "held-out", "vs", "eager", "vs", "compile", "%roof", "GPU-h", "$",
                              "device", "candidate", "[target]", "run"]
    first_row = out[1].split()
    assert first_row[:3] == ["1", "1.25x", "-"] and first_row[6:8] == ["0.25", "1.35"]  # its own GPU-hours and $
    assert out[-1] == line
    assert "Cost on h200: 3 candidates, 1 GPU-h, $4.05 (proposer: 5000 tokens, $0.45); best +25% over the " \
           "baseline: $0.162 and 0.04 GPU-h per 1%." in report(tracker, "rmsnorm")

    for parent, runs in ((first, 2), (second, 1)):
        tracker.finish_parent(parent, {"gpu_seconds": 900.0 * (runs + 1), "cost_usd": 0.9 * (runs + 1),
                                       "proposer_tokens": 0.0, "proposer_usd": 0.0}, {})
    totals = sweep_totals(tracker, [first, second])
    assert totals["gpu_hours"] == pytest.approx(1.25) and totals["total_usd"] == pytest.approx(4.5)
    assert totals["optimizations"] == 2


def test_engine_leaderboard_counts_the_reference_and_baseline_and_charts_each_pattern(tracker, capsys, tmp_path):
    scope = RunScope("engine", "qwen3-8b", "qwen3-8b/bf16/serve-abc", "h200")
    parent = tracker.start_parent("engine-optimization", scope, "engine", {})
    free = tmp_path / "silu.py"
    free.write_text("def silu_mul(gate, up):\n    return gate\n")
    cand = EngineCandidate(kernels={"silu_mul": {"impl": "free", "path": str(free)}}, origin="tpe")
    run_id = tracker.open_engine_candidate(parent, scope, cand)
    patterns = ("chat-short", "long-prompt")
    metrics = {f"{p}/vs_baseline_{m}": 1.1 + 0.1 * i for i, p in enumerate(patterns) for m in METRICS}
    metrics |= {"score": 1.15, "worst_vs_baseline": 1.1}
    verdict = Verdict("engine", cand.id, device={"name": "NVIDIA H200", "torch": "2.9.0"})
    tracker.finish_engine_candidate(run_id, verdict, metrics, charge(1800.0, 3.6), None)
    # The flow's reference and baseline servers held two GPUs a quarter of an hour each: the flow's cost.
    tracker.finish_parent(parent, {"reference_gpu_seconds": 900.0, "reference_cost_usd": 0.9,
                                   "baseline_gpu_seconds": 900.0, "baseline_cost_usd": 0.9}, {})

    assert main(["leaderboard", "--op", "engine"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:5] == ["1", "1.15x", "1.10x", "0.5", "1.8"]
    assert out[-1] == ("spent on qwen3-8b/bf16/serve-abc (h200): 1 candidate, 1 GPU-h, $3.60; best +15% over the "
                       "baseline: $0.24 and 0.0667 GPU-h per 1%")
    # The free kernel's source is kept with the run: its path was a scratch file of the flow.
    assert Path(tracker.client.download_artifacts(run_id, "kernels/silu_mul.py", str(tmp_path / "dl"))).read_text() \
        == free.read_text()

    assert log_engine_chart(tracker, run_id, "engine vs reference", 0.02)
    png = Path(tracker.client.download_artifacts(run_id, "charts/vs_baseline.png", str(tmp_path / "dl")))
    assert png.read_bytes()[:8] == PNG
    with Image.open(png) as img:
        img.verify()
    data = json.loads(Path(tracker.client.download_artifacts(run_id, "charts/vs_baseline.json",
                                                             str(tmp_path / "dl"))).read_text())
    assert list(data["series"]) == list(patterns) and data["series"]["long-prompt"]["output_tps"] == pytest.approx(1.2)


def _shape(us: float, spread: float) -> dict[str, float]:
    return {"decode_b1/latency_us": us, "decode_b1/spread": spread}


@pytest.mark.parametrize("old, new, status, engine, says", [
    (_shape(10.0, 0.01), _shape(10.5, 0.01), "pass", False, []),  # within spread + 5%
    (_shape(10.0, 0.01), _shape(10.8, 0.02), "pass", False, ["decode_b1: 10 µs -> 10.8 µs (+8.0%; allowed +7.0%"]),
    (_shape(10.0, 0.01), {}, "pass", False, ["decode_b1: no longer measured"]),
    (_shape(10.0, 0.01), _shape(1.0, 0.0), "fail", False, ["its verdict is now fail"]),
    ({"score": 1.2, "p/ttft_p50_ms": 10.0, "p/output_tps": 100.0},
     {"score": 1.19, "p/ttft_p50_ms": 10.4, "p/output_tps": 96.0}, "pass", True, []),
    ({"score": 1.2, "p/ttft_p50_ms": 10.0, "p/output_tps": 100.0, "p/baseline_output_tps": 90.0},
     {"score": 1.0, "p/ttft_p50_ms": 12.0, "p/output_tps": 80.0, "p/baseline_output_tps": 40.0}, "pass", True,
     ["score vs baseline 1.2 -> 1", "p/output_tps: 100 -> 80", "p/ttft_p50_ms: 10 -> 12"]),
])
def test_what_revalidate_calls_a_regression(old, new, status, engine, says):
    found = regressions(old, new, status, engine, slack=0.05)
    assert len(found) == len(says) and all(line.startswith(s) for line, s in zip(found, says)), found


def test_reproduce_of_what_cannot_be_rebuilt_or_placed_is_one_line(tracker, capsys):
    from targets import Target

    scope = RunScope("rmsnorm", "tiny", "tiny/fp32/d1-4/p40/c48", "h200")
    untargeted = tracker.start_parent("optimization", scope, "no target.json", {})
    targeted = tracker.start_parent("optimization", scope, "with target.json",
                                    {"target": Target(model="tiny", dtype="fp32").model_dump(mode="json")})
    cand = Candidate("rmsnorm", "template", ROWS_TEMPLATE.name, ROWS_TEMPLATE.default)
    runs = {}
    for name, parent in (("untargeted", untargeted), ("targeted", targeted)):
        runs[name] = tracker.open_candidate(parent, scope, cand)
        tracker.finish_candidate(runs[name], cand, Verdict("rmsnorm", cand.id), charge(1.0, 3.6))
    for run_id, says in (
            (runs["untargeted"], f"run {runs['untargeted']}'s flow (run {untargeted}) has no artifact target.json, "
                                 "which re-running it needs"),
            (runs["targeted"], f"the pool has no host of GPU class h200, which run {runs['targeted']} ran on (its "
                               "hosts' classes: cpu); name another class (any: whichever host is free)")):
        capsys.readouterr()
        assert main(["reproduce", run_id]) == 2
        assert capsys.readouterr().err == f"infersmith: {says}\n"
    assert main(["reproduce", runs["targeted"], "--gpu-class", "h300"]) == 2
    assert "unknown GPU class 'h300'" in capsys.readouterr().err
