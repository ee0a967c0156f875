"""An optimization on a priced pool, then its candidates run again, under Prefect's test server
with MLflow on SQLite: what it cost adds up from the logged seconds and the pool's price, per
candidate, per flow and per percent gained; its charts are PNGs with one series per shape;
`reproduce` gives an op candidate and an engine configuration (the tiny checkpoint, served on the
CPU) the same verdict, counting the reference server's time; `revalidate` passes, and fails on a
planted regression — a logged figure made better than it was, or a tolerance it now exceeds."""
from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
from PIL import Image
from prefect.artifacts import Artifact
from tiny_checkpoints import checkpoint

from cli.main import main
from engine_templates.ops import get_op
from flows.optimize_op import optimize_op
from flows.revalidate import Regressed, revalidate
from gpu_pool.pool_file import load_pool
from targets import Target
from tracking.charts import children
from tracking.history import winners
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig

PRICE = 36.0  # $ per hour of the CPU slot: a cent a second
TARGET = Target(model="tiny", dtype="fp32", budget={"candidates": 3})
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """This module's own tracking store (revalidate looks at every winner in it) and priced pool."""
    home = tmp_path_factory.mktemp("rerun-home")
    (home / "pool.yaml").write_text(f"usd_per_gpu_hour: {{cpu: {PRICE}}}\nhosts: [{{name: local}}]\n")
    return home


@contextlib.contextmanager
def store(home: Path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFERSMITH_HOME", str(home))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield Tracker(TrackingConfig.from_env())


@pytest.fixture
def tracker(home):
    with store(home) as t:
        yield t


@pytest.fixture(scope="module")
def optimization(home, prefect_server) -> dict:
    with store(home):
        return optimize_op(op="rmsnorm", target=TARGET, proposer="random", seed=5,
                           pool=load_pool(home / "pool.yaml"))


def cli(*argv: str) -> tuple[int, str]:
    # stdout only: Prefect's log handler keeps the stderr it first saw
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(list(argv))
    return code, out.getvalue()


def test_what_an_optimization_cost_adds_up_from_its_seconds_and_the_pools_price(tracker, optimization):
    parent = tracker.client.get_run(optimization["parent_run_id"]).data.metrics
    kids = children(tracker, optimization["parent_run_id"])
    assert len(kids) == 3
    for run in kids:
        m = run.data.metrics
        stages = sum(v for k, v in m.items() if k.startswith("stage_seconds/"))
        held = sum(end - start for _, start, end in json.loads(run.data.tags[f"{T}held"]))
        assert 0 < m["gpu_seconds"] == pytest.approx(stages) and m["gpu_seconds"] <= held
        assert m["gpu_hours"] == pytest.approx(m["gpu_seconds"] / 3600)
        assert m["cost_usd"] == pytest.approx(m["gpu_seconds"] * PRICE / 3600)
        assert m["proposer_tokens"] == 0 and m["total_usd"] == pytest.approx(m["cost_usd"] + m["proposer_usd"])
    # the held-out shapes timed in the candidates' bench stages: on their own seconds, none apart
    for name, held_out in (("gpu_seconds", "held_out_gpu_seconds"), ("cost_usd", "held_out_cost_usd"),
                           ("total_usd", "held_out_cost_usd")):
        assert parent[name] == pytest.approx(sum(r.data.metrics[name] + r.data.metrics.get(held_out, 0.0)
                                                 for r in kids)), name
    assert any("held_out_gpu_seconds" in r.data.metrics for r in kids)
    assert parent["total_usd"] == pytest.approx(parent["gpu_seconds"] * PRICE / 3600)
    best = max(r.data.metrics["score"] for r in kids if "score" in r.data.metrics)
    assert parent["best_score"] == pytest.approx(best)
    if best > 1:  # the interpreter's timings decide which: each way, the figures are what they must be
        assert parent["gain_pct"] == pytest.approx(100 * (best - 1))
        assert parent["usd_per_pct_gain"] == pytest.approx(parent["total_usd"] / parent["gain_pct"])
        assert parent["gpu_hours_per_pct_gain"] == pytest.approx(parent["gpu_hours"] / parent["gain_pct"])
    else:
        assert not {"gain_pct", "usd_per_pct_gain", "gpu_hours_per_pct_gain"} & set(parent)
    summary = Artifact.get("summary-rmsnorm")
    assert f"| total_usd | {parent['total_usd']:.4g} |" in summary.data
    assert "| candidates | 3 |" in summary.data and "spent " in summary.data
    assert "spent " in Artifact.get("leaderboard-rmsnorm").description


def test_an_optimization_charts_its_roofline_and_progress_one_series_per_shape(tracker, optimization, tmp_path):
    w = TARGET.workload
    shapes = {s.label for s in get_op("rmsnorm").shapes(TARGET.dims, w.decode_batches, w.prefill_tokens, w.contexts)}
    for name in ("roofline", "progress"):
        png = Path(tracker.client.download_artifacts(optimization["parent_run_id"], f"charts/{name}.png",
                                                     str(tmp_path)))
        assert png.read_bytes()[:8] == PNG
        with Image.open(png) as img:
            img.verify()
        data = json.loads(Path(tracker.client.download_artifacts(optimization["parent_run_id"],
                                                                 f"charts/{name}.json", str(tmp_path))).read_text())
        assert set(data["series"]) == shapes, name
    assert len(data["score"]) == len(data["status"]) == 3
    assert all(len(points) == 3 for points in data["series"].values())


def test_reproduce_runs_an_op_candidate_again_with_its_logged_target_and_rules(tracker, optimization, home):
    old = next(r for r in children(tracker, optimization["parent_run_id"]) if r.data.tags[f"{T}status"] == "pass")
    code, out = cli("reproduce", old.info.run_id, "--pool", str(home / "pool.yaml"))
    assert code == 0, out
    assert "the same verdict: pass then, pass now" in out
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert "decode_b1 µs" in rows and "torch" in rows and "cost $" in rows
    new = [r for r in tracker.client.search_runs([old.info.experiment_id], f"tags.`{T}reruns` = '{old.info.run_id}'")
           if r.data.tags.get(f"{T}kind") == "candidate"]
    assert len(new) == 1 and new[0].data.tags[f"{T}candidate_id"] == old.data.tags[f"{T}candidate_id"]
    assert new[0].data.tags[f"{T}target"] == old.data.tags[f"{T}target"]
    parent = tracker.client.get_run(new[0].data.tags["mlflow.parentRunId"])
    assert parent.data.tags[f"{T}kind"] == "reproduction"
    assert parent.data.metrics["total_usd"] == pytest.approx(new[0].data.metrics["gpu_seconds"] * PRICE / 3600)


def test_reproduce_of_no_candidate_is_one_line(tracker, optimization, capsys):
    for run_id, says in (("0123456789abcdef", "no run 0123456789abcdef in the tracking store"),
                         (optimization["parent_run_id"], "is no candidate (its kind: optimization)")):
        capsys.readouterr()
        assert main(["reproduce", run_id]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err


def _winner(tracker):
    found = winners(tracker, "rmsnorm", "tiny", gpu_timing=False)
    assert len(found) == 1  # one target, one GPU class in this store
    return found[0]


def test_revalidate_passes_when_the_winner_holds(tracker, optimization, home):
    code, out = cli("revalidate", "--op", "rmsnorm", "--model", "tiny", "--include-cpu", "--slack", "10",
                    "--pool", str(home / "pool.yaml"))
    # A loaded CPU's interpreter times vary by far more than a GPU's: the slack (1000%) allows for it.
    assert code == 0, out
    assert ": holds" in out and "0 of 1 winners regressed; 1 re-run" in out
    assert Artifact.get("revalidation").type == "table"


def test_revalidate_fails_on_a_figure_logged_better_than_it_is(tracker, optimization, home):
    won = _winner(tracker)
    latencies = {k: v for k, v in won.data.metrics.items() if k.endswith("/latency_us") or k.endswith("/spread")}
    for k, v in latencies.items():  # a thousand times faster than measured, with no spread
        tracker.client.log_metric(won.info.run_id, k, v / 1000 if k.endswith("latency_us") else 0.0, step=1)
    try:
        with pytest.raises(Regressed) as e:
            revalidate(ops=["rmsnorm"], model="tiny", engine=False, include_cpu_timed=True, slack=10.0,
                       pool=load_pool(home / "pool.yaml"))
    finally:
        for k, v in latencies.items():
            tracker.client.log_metric(won.info.run_id, k, v, step=2)
    assert e.value.result["regressed"] == 1 and "decode_b1: " in str(e.value)
    row = e.value.result["rows"][0]
    assert row["run"] == won.info.run_id and "%: spread + slack)" in row["result"]
    report = Artifact.get("revalidation-regressions").data
    assert f"run then: {won.info.run_id}, on cpu: torch {won.data.tags[f'{T}torch']}" in report
    assert f"run now: {row['rerun']}, on cpu: torch " in report and "what regressed: decode_b1: " in report


def test_revalidate_fails_on_a_tolerance_the_winner_now_exceeds(tracker, optimization, home):
    won = _winner(tracker)
    rules = json.loads(Path(tracker.client.download_artifacts(won.info.run_id, "rules.json",
                                                              str(home / "dl"))).read_text())
    tracker.client.log_dict(won.info.run_id, rules | {"rtol": 1e-30}, "rules.json")
    try:
        code, out = cli("revalidate", "--op", "rmsnorm", "--include-cpu", "--slack", "10", "--pool",
                        str(home / "pool.yaml"))
    finally:
        tracker.client.log_dict(won.info.run_id, rules, "rules.json")
    assert code == 1, out
    assert "its verdict is now fail: [accuracy] " in out and "> tolerance 1e-30" in out
    assert "1 of 1 winners regressed" in out


SERVING = {"traffic": [{"name": "chat-short", "concurrency": 1, "input_tokens_mean": 24,
                        "output_tokens_mean": 8, "request_count": 4, "warmup_requests": 1}],
           "accuracy": {"held_out": 2, "held_out_tokens": 12, "max_tokens": 6},
           # measured only for a configuration that passes the accuracy gate: never, here
           "baseline": f"{sys.executable} -c 'raise SystemExit(9)'"}


def test_reproduce_serves_an_engine_configuration_again_and_counts_the_reference(tracker, home, prefect_server,
                                                                                 tmp_path):
    from flows.optimize_engine import serve_bench

    zeros = tmp_path / "zero_silu_mul.py"  # a free kernel the accuracy gate rejects: the MLPs add nothing
    zeros.write_text("import torch\n\n\ndef silu_mul(gate, up):\n    return torch.zeros_like(up)\n")
    target = Target.model_validate({"model": "tiny", "dtype": "fp32", "serving": SERVING})
    result = serve_bench(str(checkpoint("dense")), target, {"silu_mul": {"impl": "free", "path": str(zeros)}},
                         pool=load_pool(home / "pool.yaml"))
    assert result["verdict"] == "fail" and "[accuracy]" in result["line"]
    m = result["metrics"]
    child = tracker.client.get_run(result["run_id"]).data.metrics
    assert m["reference_gpu_seconds"] > 0 and "baseline_gpu_seconds" not in m  # no candidate needed it
    assert m["gpu_seconds"] == pytest.approx(child["gpu_seconds"] + m["reference_gpu_seconds"])
    assert m["reference_cost_usd"] == pytest.approx(m["reference_gpu_seconds"] * PRICE / 3600)
    assert m["total_usd"] == pytest.approx(m["gpu_seconds"] * PRICE / 3600)

    zeros.unlink()  # the kernel's source comes back from the run's artifacts
    code, out = cli("reproduce", result["run_id"], "--pool", str(home / "pool.yaml"))
    assert code == 0, out
    assert "the same verdict: fail then, fail now [accuracy]" in out
    assert any(line.split() == ["verdict", "fail", "[accuracy]", "fail", "[accuracy]"] for line in out.splitlines())


def test_revalidate_is_deployed_beside_the_sweep_on_the_nightly_schedule():
    """Its form is the flow's typed parameters; a redeploy may leave a schedule edited in the UI as it is."""
    from prefect.utilities.callables import parameter_schema

    from flows.deployments import DeploySettings, declarations
    from flows.sweep import SweepPlan

    settings = DeploySettings(plan=SweepPlan(ops=["rmsnorm"], targets=[{"model": "tiny"}]), work_pool="infersmith",
                              cron="0 2 * * *", timezone="Europe/Paris", active=True)
    by_name = {d.name: d for d in declarations(settings)}
    nightly = {name: [(c.schedule.cron, c.schedule.timezone) for c in d.schedules or []]
               for name, d in by_name.items()}
    assert nightly["revalidate"] == nightly["sweep"] == [("0 2 * * *", "Europe/Paris")]
    form = parameter_schema(revalidate)  # what the deployment's form is made from
    assert {"ops", "model", "gpu_class", "engine", "include_cpu_timed", "slack", "engine_slack", "pool",
            "model_dir"} <= set(form.properties)
    text = json.dumps(form.model_dump())
    assert '"rmsnorm"' in text and '"qwen3-8b"' in text  # ops offered as choices, presets as examples
    assert not declarations(settings, scheduled=["sweep"])[-1].schedules
