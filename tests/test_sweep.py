"""The sweep: a plan's every op on every target, each an optimize-op subflow; its file's errors."""
from __future__ import annotations

import json

import pytest

# Prefect sets its log handlers up on this import, each keeping the sys.stderr of the moment: here,
# not the capsys stream of whichever test would import it first (closed after that test).
from prefect import flow  # noqa: F401
from prefect.artifacts import Artifact

from cli.main import main
from flows.sweep import SweepPlan, load_plan, sweep
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig


@pytest.mark.parametrize("body, message", [
    ("ops: [rmsnorm, nope]\ntargets: [{model: tiny}]\n", "ops.1: Input should be 'rmsnorm', 'silu_mul'"),
    ("ops: [rmsnorm]\ntargets: [{model: qwen9}]\n", "targets.0.model: 'qwen9' is neither a model preset ("),
    ("ops: [fused_moe]\ntargets: [{model: tiny}]\n", "targets[0] (tiny) cannot take fused_moe: fused_moe needs a "
                                                      "mixture-of-experts preset; tiny is dense"),
    ("ops: [rmsnorm]\ntargets: []\n", "targets: List should have at least 1 item"),
    ("ops: [rmsnorm]\ntargets: [{model: tiny}]\nbudget: 3\n", "budget: Extra inputs are not permitted"),
    ("- rmsnorm\n", "expected a mapping with `ops:` and `targets:`"),
    ("ops: [rmsnorm\n", "not a YAML file"),
])
def test_a_bad_sweep_file_is_one_line_and_exit_2(tmp_path, capsys, body, message):
    path = tmp_path / "plan.yaml"
    path.write_text(body)
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"infersmith: {path}: {message}") and err.count("\n") == 1


def test_a_missing_sweep_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["sweep", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err == f"infersmith: {tmp_path / 'none.yaml'}: cannot read: No such file or directory\n"


def test_the_shipped_nightly_plan_is_valid():
    from cli.platform import DEFAULT_SWEEP

    plan = load_plan(DEFAULT_SWEEP)
    assert plan.ops and {t.model for t in plan.targets} >= {"qwen3-8b"}


def test_every_op_runs_on_every_target_as_subflows_and_a_failed_one_does_not_stop_the_rest(
        prefect_server, tmp_path, monkeypatch):
    # a store of its own: other tests of the session leave optimizations of the same targets
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    # the first target asks for a GPU class this machine lacks: both its optimizations fail at once
    plan = SweepPlan(ops=["silu_mul", "rmsnorm"], proposer="random", targets=[
        {"model": "tiny", "gpu_class": "h100"}, {"model": "tiny", "dtype": "fp32", "budget": {"candidates": 1}}])
    state = sweep(plan, return_state=True)
    assert state.is_failed()
    assert state.message.endswith(
        "2 optimizations failed: silu_mul tiny bf16: Flow run encountered an exception: ValueError: the pool has "
        "no host of GPU class 'h100'; rmsnorm tiny bf16: Flow run encountered an exception: ValueError: the pool "
        "has no host of GPU class 'h100'")

    with get_client(sync_client=True) as client:
        subflows = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[state.state_details.flow_run_id])))
    by_name = {r.name: r.state.type.value for r in subflows}
    assert by_name == {"silu_mul tiny bf16": "FAILED", "rmsnorm tiny bf16": "FAILED",
                       "silu_mul tiny fp32": "COMPLETED", "rmsnorm tiny fp32": "COMPLETED"}

    tracker = Tracker(TrackingConfig.from_env())
    parents = []
    for op in ("silu_mul", "rmsnorm"):
        [parent] = tracker.client.search_runs([tracker.experiment(op)], f"tags.`{T}kind` = 'optimization' and "
                                              f"tags.`{T}target` LIKE 'tiny/fp32/%' and params.proposer = 'random'")
        assert parent.info.status == "FINISHED" and parent.data.metrics["candidates"] == 1
        parents.append(parent.data.metrics)

    # What the sweep cost: its completed optimizations', and their sum as the last row.
    rows = Artifact.get("sweep-cost").data
    rows = json.loads(rows) if isinstance(rows, str) else rows
    assert [r["optimization"].split()[0] for r in rows] == ["silu_mul", "rmsnorm", "sweep:"]
    for name in ("gpu_hours", "total_usd"):
        assert [r[name] for r in rows[:2]] == pytest.approx([m[name] for m in parents])
        assert rows[-1][name] == pytest.approx(sum(m[name] for m in parents))
    assert rows[-1]["gpu_hours"] > 0  # (this machine has no price: no dollars)


def test_the_sweeps_gpu_hours_cap_each_optimization_by_what_is_left():
    from flows.sweep import within

    plan = SweepPlan.model_validate({"ops": ["rmsnorm"], "max_gpu_hours": 3.0, "targets": [
        {"model": "tiny"}, {"model": "tiny", "budget": {"max_gpu_hours": 0.5}}]})
    free, own = plan.targets
    assert within(plan, free, 1.0).budget.max_gpu_hours == 2.0
    assert within(plan, own, 1.0).budget.max_gpu_hours == 0.5  # its own is less
    assert within(plan, free, 3.0) is None
    assert within(plan.model_copy(update={"max_gpu_hours": None}), free, 9.0) is free
