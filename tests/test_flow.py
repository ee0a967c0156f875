"""optimize_op under Prefect's test server, tracked in MLflow on SQLite: the runs it leaves."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect.artifacts import Artifact

from flows.optimize_op import optimize_op
from targets import Target
from tracking.history import leaderboard, search
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig


def children_of(tracker: Tracker, parent_id: str, op: str):
    return [r for r in search(tracker, op) if r.data.tags.get("mlflow.parentRunId") == parent_id]


def test_optimize_leaves_a_parent_and_one_child_per_candidate(prefect_server, tracking_home, tmp_path):
    target = Target(model="tiny", budget={"candidates": 3})
    result = optimize_op(op="silu_mul", target=target, proposer="random", seed=7)
    tracker = Tracker(TrackingConfig.from_env())
    parent = tracker.client.get_run(result["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags[f"{T}kind"] == "optimization"
    assert parent.data.params["target.model"] == "tiny" and parent.data.params["proposer"] == "random"
    assert parent.data.metrics["candidates"] == 3 and result["stop_reason"].startswith("budget")

    children = children_of(tracker, parent.info.run_id, "silu_mul")
    assert len(children) == 3
    assert len({c.data.tags[f"{T}candidate_id"] for c in children}) == 3
    for run in children:
        tags, metrics = run.data.tags, run.data.metrics
        # every point of the shipped template computes silu_mul correctly: each candidate passes
        assert tags[f"{T}status"] == "pass", (run.data.params, tags.get(f"{T}failing_gate"))
        assert tags[f"{T}op"] == "silu_mul" and tags[f"{T}model"] == "tiny" and tags[f"{T}proposer"] == "random"
        assert tags[f"{T}gpu"].startswith("local:") and metrics["gpu_seconds"] > 0
        assert {"point.block", "point.num_warps", "point.num_stages"} <= set(run.data.params)
        files = {f.path for f in tracker.client.list_artifacts(run.info.run_id)}
        assert "verdict.json" in files
        local = tracker.client.download_artifacts(run.info.run_id, "verdict.json", str(tmp_path))
        verdict = json.loads(Path(local).read_text())
        assert verdict["status"] == "pass" and verdict["op"] == "silu_mul"
        assert metrics["score"] > 0 and metrics["decode_b1/latency_us"] > 0
        assert metrics["prefill_40/speedup_vs_eager"] > 0 and "max_rel_error" in metrics
    board = Artifact.get("leaderboard-silu-mul")
    assert board is not None and board.type == "table"


def test_a_resumed_optimization_never_repeats_a_candidate(prefect_server, tracking_home):
    # One candidate each (CI time): the same proposer and seed would propose the same first point
    target = Target(model="tiny", dtype="fp32", budget={"candidates": 1})
    first = optimize_op(op="rmsnorm", target=target, proposer="tpe", seed=3)
    second = optimize_op(op="rmsnorm", target=target, proposer="tpe", seed=3)
    tracker = Tracker(TrackingConfig.from_env())
    ids = [r.data.tags[f"{T}candidate_id"] for p in (first, second)
           for r in children_of(tracker, p["parent_run_id"], "rmsnorm")]
    assert len(ids) == 2 and len(set(ids)) == 2
    board = leaderboard(tracker, "rmsnorm", "tiny")
    assert board and all(b.score > 0 for b in board)
    assert [b.rank for b in board] == list(range(1, len(board) + 1))


def test_no_candidate_starts_that_would_end_after_the_wall_clock():
    from contract.job import Candidate
    from contract.verdict import Verdict
    from flows.optimize_op import Progress
    from tasks.evaluate import Outcome
    from tracking.ledger import Charge

    progress = Progress(Target(model="tiny", budget={"candidates": 10, "wall_clock_s": 100.0}))
    assert progress.may_launch(0)  # nothing measured yet: the first always starts
    cand = Candidate("silu_mul", "template", template="flat", point={"block": 256})
    charge = Charge()
    charge.add_stage("compile", 40.0, 0.0)
    progress.record(Outcome(cand, Verdict(op="silu_mul", candidate_id=cand.id), charge, "run"))
    assert progress.may_launch(0)  # 40 s each, and nearly all of the 100 s left
    progress.started -= 61  # 61 s gone: another 40 s candidate would end at 101 s
    assert not progress.may_launch(0)
    assert "would end after it" in progress.stop_reason()


def test_a_gpu_hour_budget_stops_an_optimization_with_its_reason_and_a_run_priced_on_the_command_line(
        prefect_server, tracking_home, capsys, tmp_path):
    from cli.main import main

    # An unpriced pool file of one CPU host, priced by the run: $ is counted without a price table
    (tmp_path / "pool.yaml").write_text("hosts: [{name: local}]\n")
    code = main(["optimize", "--op", "silu_mul", "--model", "tiny", "--proposer", "random", "--budget", "6",
                 "--max-gpu-hours", "1e-6", "--usd-per-gpu-hour", "3", "--pool", str(tmp_path / "pool.yaml")])
    assert code == 0, capsys.readouterr().err
    tracker = Tracker(TrackingConfig.from_env())
    [parent] = tracker.client.search_runs([tracker.experiment("silu_mul")], "tags.`infersmith.kind` = 'optimization'",
                                          order_by=["attributes.start_time DESC"], max_results=1)  # this one
    reason = json.loads(Path(tracker.client.download_artifacts(parent.info.run_id, "stop_reason.json")).read_text())
    assert reason["reason"].startswith("GPU-hour budget of 1e-06: ")
    m = parent.data.metrics
    assert 1 <= m["candidates"] < 6 and m["stopped_early"] == 1.0  # those in flight finished, nothing new started
    assert m["cost_usd"] == pytest.approx(m["gpu_seconds"] * 3 / 3600)
