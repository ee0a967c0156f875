"""optimize_op: propose -> compile -> check -> microbench, until the budget or a plateau."""
from __future__ import annotations

import time
from typing import Literal

from prefect import flow
from prefect.artifacts import create_table_artifact

from engine_templates.ops import get_op
from flows.pipeline import Outcome, evaluate, one_line
from flows.target import Target
from gpu_pool.pool import Pool, local_pool
from tasks.stages import propose
from tracking.history import leaderboard, trials
from tracking.schema import RunScope, Tracker
from tracking.store import TrackingConfig

ProposerName = Literal["random", "tpe"]


def scope_for(op: str, target: Target, pool: Pool) -> RunScope:
    classes = {s.host.gpu_class for s in pool.slots(target.gpu_class)}
    if not classes:
        raise ValueError(f"the pool has no host of GPU class {target.gpu_class!r}")
    return RunScope(op, target.model, target.key(), classes.pop() if len(classes) == 1 else "mixed")


class Progress:
    """Stop rules and the running best: budget, wall clock, plateau."""

    def __init__(self, target: Target):
        self.budget, self.started = target.budget, time.monotonic()
        self.done, self.passed, self.best, self.since_best = 0, 0, None, 0
        self.gpu_seconds = self.usd = 0.0

    def record(self, o: Outcome) -> None:
        self.done += 1
        self.gpu_seconds += o.charge.gpu_seconds
        self.usd += o.charge.usd
        score = o.verdict.score()
        if score is not None:
            self.passed += 1
        if score is not None and (self.best is None or score > self.best * 1.01):
            self.best, self.since_best = score, 0
        else:
            self.since_best += 1

    def stop_reason(self) -> str | None:
        if self.done >= self.budget.candidates:
            return f"budget of {self.budget.candidates} candidates spent"
        if time.monotonic() - self.started > self.budget.wall_clock_s:
            return f"wall-clock budget of {self.budget.wall_clock_s:g} s spent"
        if self.since_best >= self.budget.plateau:
            return f"plateau: {self.since_best} candidates without a 1% better score"
        return None

    def metrics(self) -> dict[str, float]:
        m = {"candidates": self.done, "passed": self.passed, "gpu_seconds": self.gpu_seconds,
             "cost_usd": self.usd, "wall_s": time.monotonic() - self.started}
        return m | ({"best_score": self.best} if self.best is not None else {})


@flow(name="optimize-op", log_prints=True)
def optimize_op(op: str = "rmsnorm", target: Target = Target(), proposer: ProposerName = "tpe",
                template: str | None = None, seed: int = 0) -> dict:
    """Optimize one op for one target: every candidate, passing or not, becomes an MLflow run."""
    spec = get_op(op)
    template = template or next(iter(spec.templates))
    if template not in spec.templates:
        raise ValueError(f"{op} has no template {template!r}; known: {', '.join(spec.templates)}")
    pool = local_pool()
    slots = pool.slots(target.gpu_class)
    scope = scope_for(op, target, pool)
    tracker = Tracker(TrackingConfig.from_env())
    parent = tracker.start_parent(
        "optimization", scope, f"optimize {op} {target.model}",
        params={"target": target.model_dump(mode="json"), "proposer": proposer, "template": template,
                "seed": seed, "pool": [s.label for s in slots]},
        tags={"infersmith.proposer": proposer, "infersmith.template": template})
    print(f"optimizing {op} for {target.key()} with {proposer} over template {template!r} "
          f"on {', '.join(s.label for s in slots)}; tracking run {parent}")
    progress = Progress(target)
    try:
        reason = progress.stop_reason()
        while reason is None:
            history = trials(tracker, scope, template)
            n = min(len(slots), target.budget.candidates - progress.done)
            batch = propose(proposer, op, template, seed, history, n)
            if not batch:
                reason = f"the template's space has nothing new ({len(history)} points tried)"
                break
            futures = [evaluate.submit(c, target, slot, tracker, parent, scope) for c, slot in zip(batch, slots)]
            for fut in futures:
                outcome = fut.result()
                progress.record(outcome)
                print(f"[{progress.done}/{target.budget.candidates}] {outcome.candidate.label}: {one_line(outcome)}")
            reason = progress.stop_reason()
    except BaseException as e:
        tracker.fail_parent(parent, f"{type(e).__name__}: {e}")
        raise
    board = [e.__dict__ for e in leaderboard(tracker, op, target.model, limit=10) if e.target == target.key()]
    print(f"stopped: {reason}. {progress.passed}/{progress.done} passed"
          + (f"; best score {progress.best:.3g}x" if progress.best else ""))
    create_table_artifact(table=board or [{"result": "no candidate passed"}],
                          key=f"leaderboard-{op.replace('_', '-')}",
                          description=f"{op} on {target.key()}: passed candidates, best score first")
    tracker.finish_parent(parent, progress.metrics() | {"stopped_early": float(progress.done < target.budget.candidates)},
                          {"leaderboard.json": board, "stop_reason.json": {"reason": reason}})
    return {"parent_run_id": parent, "stop_reason": reason, **progress.metrics()}


if __name__ == "__main__":
    optimize_op(op="rmsnorm", target=Target(model="tiny", budget={"candidates": 8}), proposer="random")
