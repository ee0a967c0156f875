"""A person's approval of a numerics change. On Prefect's test server the flow pauses with a form
on each candidate over the target's tolerance and within its approval tolerance; the test answers
as the UI would, through the Prefect client: approve, reject, and no answer until the timeout.
Nothing holds the GPU lease meanwhile. On the ephemeral API the candidate is rejected at once."""
from __future__ import annotations

import contextvars
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType

from flows.optimize_op import optimize_op
from gpu_pool.leases import free_slots
from gpu_pool.pool import local_pool
from targets import Target
from tracking.history import search
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig

ROOT = Path(__file__).resolve().parent.parent
# fp32 silu_mul is some 1e-8 off the float64 oracle: over this tolerance, within the approval one
NEAR = {"model": "tiny", "dtype": "fp32", "rtol": 1e-12, "approval_rtol": 1e-3}


def next_pause(client, seen: set[str], within_s: float):
    """The flow run that paused next (a pause not seen before), once it has."""
    paused = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED])))
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for run in client.read_flow_runs(flow_run_filter=paused):
            key = f"{run.id}/{run.state.state_details.pause_key}"
            if key not in seen:
                seen.add(key)
                return run
        time.sleep(0.5)
    raise AssertionError(f"no flow run paused within {within_s:g} s")


def test_the_flow_pauses_for_a_person_and_logs_the_decision(prefect_server, tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    target = Target(**NEAR, approval_timeout_s=20, budget={"candidates": 3})
    done: list = []
    ctx = contextvars.copy_context()  # the test server's settings, in the flow's thread too
    flow = threading.Thread(target=lambda: done.append(ctx.run(optimize_op, op="silu_mul", target=target,
                                                               proposer="random", seed=2)))
    flow.start()
    seen: set[str] = set()
    slots = local_pool().slots()
    order: list[str] = []  # the candidates in the order they asked (the flow proposes ahead: not always
    with get_client(sync_client=True) as client:  # the order their runs started)
        for answer in ({"decision": "approve", "reviewer": "ada", "note": "fp32 rounding only"},
                       {"decision": "reject", "reviewer": "bob", "note": "not this one"}):
            run = next_pause(client, seen, within_s=300)
            assert free_slots(slots) == slots, "a GPU lease is held while the flow waits for a person"
            key = f"paused-{run.state.state_details.pause_key}"
            description = client.read_flow_run_input(run.id, f"{key}-description")
            assert "needs your approval" in description
            assert "reviewer" in client.read_flow_run_input(run.id, f"{key}-schema")
            order.append(run.state.state_details.pause_key.removeprefix("approve-"))
            assert f"candidate id `{order[-1]}`" in description
            client.resume_flow_run(run.id, run_input=answer)
        run = next_pause(client, seen, within_s=300)  # the third: no one answers
        order.append(run.state.state_details.pause_key.removeprefix("approve-"))
        assert free_slots(slots) == slots
    flow.join(timeout=300)
    assert done and done[0]["candidates"] == 3, "the flow did not finish"
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run.id).state.type == StateType.COMPLETED  # the timeout failed no flow

    tracker = Tracker(TrackingConfig.from_env())
    children = sorted((r for r in search(tracker, "silu_mul")
                       if r.data.tags.get("mlflow.parentRunId") == done[0]["parent_run_id"]),
                      key=lambda r: order.index(r.data.tags[f"{T}candidate_id"]))
    got = [{k: r.data.tags.get(f"{T}{k}") for k in ("approval", "approval_by", "status", "failing_gate", "flags")}
           for r in children]
    assert got == [
        {"approval": "approved", "approval_by": "ada", "status": "pass", "failing_gate": "", "flags": "beyond_tolerance"},
        {"approval": "rejected", "approval_by": "bob", "status": "fail", "failing_gate": "approval",
         "flags": "beyond_tolerance"},
        {"approval": "timed_out", "approval_by": "infersmith", "status": "fail", "failing_gate": "approval",
         "flags": "beyond_tolerance"}]
    assert children[0].data.tags[f"{T}approval_note"] == "fp32 rounding only" and children[0].data.tags[f"{T}approval_at"]
    assert "score" in children[0].data.metrics and "score" not in children[1].data.metrics
    verdict = json.loads(Path(tracker.client.download_artifacts(children[1].info.run_id, "verdict.json",
                                                                str(tmp_path))).read_text())
    assert verdict["gates"][-1]["name"] == "approval" and "rejected by bob" in verdict["gates"][-1]["detail"]
    assert done[0]["passed"] == 1


def test_on_the_ephemeral_api_a_held_candidate_is_rejected_with_a_line(tmp_path, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    # A Prefect home of its own: the ephemeral server's database is new, and its first start
    # (creating the tables) may take past Prefect's 20 s on a busy machine.
    env |= {"INFERSMITH_HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(ROOT),
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    done = subprocess.run([sys.executable, "-m", "cli", "optimize", "--op", "silu_mul", "--model", "tiny",
                           "--dtype", "fp32", "--rtol", "1e-12", "--approval-rtol", "1e-3", "--budget", "1"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    # the flow prints it; Prefect logs what a flow prints to stderr
    assert "run against a Prefect server (`prefect server start`, then set PREFECT_API_URL) to approve" in done.stderr
    monkeypatch.setenv("INFERSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    [run] = search(Tracker(TrackingConfig.from_env()), "silu_mul")
    assert run.data.tags[f"{T}approval"] == "no_server" and run.data.tags[f"{T}status"] == "fail"
