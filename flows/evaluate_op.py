"""evaluate_candidate: one free candidate through the same stages, logged like any other."""
from __future__ import annotations

import json

from prefect import flow

from contract.job import Candidate
from engine_templates.ops import get_op
from flows.approval import decide
from gpu_pool.executors import prewarm
from gpu_pool.leases import ensure_limits
from gpu_pool.pool import Pool, local_pool
from targets import Target
from tasks.evaluate import evaluate, one_line
from tracking.cost import FlowCost
from tracking.ledger import Charge
from tracking.schema import RunScope, Tracker
from tracking.store import TrackingConfig


@flow(name="evaluate-candidate", log_prints=True)
def evaluate_candidate(op: str, source: str, target: Target = Target(), name: str = "candidate.py",
                       pool: Pool | None = None, origin: str = "cli", charge: Charge | None = None) -> dict:
    """Compile, check and time one candidate module on the first free slot; returns its verdict.
    It is checked on held-out shapes (targets/held_out.py) drawn for this run too. `origin` names
    who proposed it; `charge`, what proposing it cost (an agent's tokens)."""
    candidate = Candidate(op=op, kind="free", source=source, origin=origin)
    pool = pool or local_pool()
    prewarm(pool.slots(target.gpu_class))
    scope = RunScope.on(op, target, pool.slots(target.gpu_class))  # no search module: no proposer imported
    ensure_limits(pool)
    tracker = Tracker(TrackingConfig.from_env())
    parent = tracker.start_parent("evaluation", scope, f"evaluate {name}",
                                  params={"target": target.model_dump(mode="json"), "file": name},
                                  tags={"infersmith.proposer": origin})
    try:
        run_id = tracker.open_candidate(parent, scope, candidate)
        outcome = evaluate(candidate, run_id, target, pool.slots(target.gpu_class), tracker,
                           target.held_out_shapes(get_op(op, target.dtype)), charge)
        if outcome.held:  # the stages are done and their lease released: a person decides now
            outcome = decide(outcome, target, tracker)
    except BaseException as e:
        tracker.fail_parent(parent, f"{type(e).__name__}: {e}")
        raise
    print(f"{name}: {one_line(outcome)}")
    cost = FlowCost()
    cost.add(outcome.charge)
    tracker.finish_parent(parent, {"candidates": 1, "passed": float(outcome.verdict.status == "pass"),
                                   **cost.metrics(outcome.verdict.score()), **outcome.charge.token_metrics()}, {})
    verdict = json.loads(outcome.verdict.to_json())
    return {"verdict": verdict, "run_id": outcome.run_id, "parent_run_id": parent, **outcome.charge.metrics()}
