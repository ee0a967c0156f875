"""reproduce: a logged candidate — an op's, or an engine configuration — run again with its logged
target, candidate and rules on a chosen pool, under a parent run of its own; its old and new
figures side by side. revalidate re-runs winners the same way (`rerun`)."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Run
from prefect import flow
from prefect.artifacts import create_table_artifact

from contract.serve import AIPerfError, ServerError
from flows.optimize_op import scope_for
from flows.search.engine import Session
from gpu_pool.health import HostFault
from gpu_pool.leases import ensure_limits
from gpu_pool.pool import Pool, local_pool
from gpu_pool.ssh_serve import ServeSetupError
from targets import GPUClass
from tasks.evaluate import evaluate
from tracking.compare import side_by_side
from tracking.cost import RERUN_TAG, FlowCost
from tracking.replay import Logged, NotReplayable, logged
from tracking.schema import Tracker
from tracking.store import TrackingConfig

# Why a re-run can end without a verdict: the run cannot be rebuilt or placed, every host failed,
# or the end-to-end stage's reference or baseline server failed.
RERUN_ERRORS = (NotReplayable, ValueError, HostFault, ServeSetupError, ServerError, AIPerfError)


@dataclass
class Rerun:
    old: Logged
    new: Run  # the new candidate run
    detail: str  # the new verdict's failing gate and what it said; "" when it passed
    metrics: dict[str, float]  # its parent run's: candidates, passed, cost


def class_for(old: Logged, pool: Pool, gpu_class: str | None) -> str:
    """The GPU class to re-run on: `gpu_class`, else the one the run ran on. A pool without a
    host of it is a ValueError naming what the pool has."""
    wanted = gpu_class or old.gpu_class or old.target.gpu_class
    if wanted == "mixed":  # a pending run of a mixed pool never reached a slot
        wanted = old.target.gpu_class
    if not pool.slots(wanted):
        has = ", ".join(sorted({h.gpu_class for h in pool.hosts}))
        raise ValueError(f"the pool has no host of GPU class {wanted}, which run {old.run_id} "
                         f"{'asks for' if gpu_class else 'ran on'} (its hosts' classes: {has}); "
                         "name another class (any: whichever host is free)")
    return wanted


def rerun(tracker: Tracker, old: Logged, pool: Pool, kind: str, gpu_class: str | None = None,
          model_dir: str | None = None) -> Rerun:
    """`old` once more on the pool, as the one child of a new `kind` parent run (tagged with the
    run it re-runs, so that it counts toward no target's cost of finding it)."""
    target = old.target.model_copy(update={"gpu_class": class_for(old, pool, gpu_class)})
    tags = {RERUN_TAG: old.run_id}
    if old.is_engine:
        s = Session(kind, f"{kind} of {old.run_id}", Path(model_dir or old.model_dir), target, pool,
                    {"reruns": old.run_id, "candidate_command": old.command}, tags)
        try:
            s.start()
            outcome = s.evaluate(old.candidate, old.command or None, reruns=old.run_id)
        except BaseException as e:
            s.fail(e)
            raise
        metrics = s.finish({"candidates": 1, "passed": float(outcome.verdict.status == "pass")},
                           f"{kind} of run {old.run_id}")
    else:
        scope = scope_for(old.op, target, pool)
        ensure_limits(pool)
        slots = pool.slots(target.gpu_class)
        parent = tracker.start_parent(kind, scope, f"{kind} of {old.run_id}", tags=tags, params={
            "target": target.model_dump(mode="json"), "reruns": old.run_id, "pool": [s.label for s in slots]})
        try:
            run_id = tracker.open_candidate(parent, scope, old.candidate, reruns=old.run_id)
            outcome = evaluate(old.candidate, run_id, target, slots, tracker, old.held_out, logged_rules=old.rules)
        except BaseException as e:
            tracker.fail_parent(parent, f"{type(e).__name__}: {e}")
            raise
        cost = FlowCost()
        cost.add(outcome.charge)
        metrics = {"candidates": 1, "passed": float(outcome.verdict.status == "pass"),
                   **cost.metrics(outcome.verdict.score())}
        tracker.finish_parent(parent, metrics, {})
    gate = outcome.verdict.failing_gate
    return Rerun(old, tracker.client.get_run(outcome.run_id), f"[{gate.name}] {gate.detail}" if gate else "", metrics)


@flow(name="reproduce", log_prints=True)
def reproduce(run_id: str, pool: Pool | None = None, gpu_class: GPUClass | None = None,
              model_dir: str | None = None) -> dict:
    """Candidate run `run_id` again on `pool` (default: this machine), on GPUs of `gpu_class`
    (default: the class it ran on); an engine configuration serves `model_dir` (default: the
    logged one, a path on the pool's hosts). Returns both verdicts and the side-by-side table."""
    tracker = Tracker(TrackingConfig.from_env())
    with tempfile.TemporaryDirectory(prefix="infersmith-reproduce-") as scratch:  # free sources live here
        old = logged(tracker, run_id, Path(scratch))
        key = old.target.serve_key() if old.is_engine else old.target.key()
        print(f"reproducing {old.candidate.label} ({old.op}, {key}) from run {run_id}")
        done = rerun(tracker, old, pool or local_pool(), "reproduction", gpu_class, model_dir)
    table = side_by_side(old.run, done.new, old.is_engine)
    new_status = done.new.data.tags.get("infersmith.status", "")
    create_table_artifact([{"figure": k, "then": a, "now": b} for k, a, b in table], key="reproduction",
                          description=f"run {run_id} then, and run {done.new.info.run_id} now")
    return {"run_id": run_id, "new_run_id": done.new.info.run_id, "op": old.op, "label": old.candidate.label,
            "old_verdict": old.status, "new_verdict": new_status, "same_verdict": old.status == new_status,
            "detail": done.detail, "table": table, "metrics": done.metrics}


if __name__ == "__main__":
    import sys

    print(reproduce(sys.argv[1]))
