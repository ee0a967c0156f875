"""optimize_op: propose -> compile -> check -> microbench, until the budget or a plateau."""
from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from typing import Literal

from prefect import flow
from prefect.artifacts import create_table_artifact
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run

from contract.job import Candidate
from engine_templates.ops import get_op
from gpu_pool.health import HEALTH
from gpu_pool.leases import ensure_limits, free_slots
from gpu_pool.pool import Pool, Slot, local_pool
from targets import Target
from tasks.evaluate import Outcome, evaluate, one_line
from tasks.propose import propose
from tracking.history import board, trials
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
        self.host_seconds: dict[str, float] = defaultdict(float)

    def record(self, o: Outcome) -> None:
        self.done += 1
        self.gpu_seconds += o.charge.gpu_seconds
        self.usd += o.charge.usd
        self.host_seconds[o.charge.host] += o.charge.gpu_seconds
        score = o.verdict.score()
        if score is not None:
            self.passed += 1
        if score is not None and (self.best is None or score > self.best * 1.01):
            self.best, self.since_best = score, 0
        else:
            self.since_best += 1

    def may_launch(self, in_flight: int) -> bool:
        return self.stop_reason() is None and self.done + in_flight < self.budget.candidates

    def stop_reason(self) -> str | None:
        if self.done >= self.budget.candidates:
            return f"budget of {self.budget.candidates} candidates spent"
        elapsed = time.monotonic() - self.started
        if elapsed > self.budget.wall_clock_s:
            return f"wall-clock budget of {self.budget.wall_clock_s:g} s spent"
        if self.done and elapsed + self.gpu_seconds / self.done > self.budget.wall_clock_s:
            return (f"wall-clock budget of {self.budget.wall_clock_s:g} s: another candidate (about "
                    f"{self.gpu_seconds / self.done:.0f} s each so far) would end after it")
        if self.since_best >= self.budget.plateau:
            return f"plateau: {self.since_best} candidates without a 1% better score"
        return None

    def metrics(self) -> dict[str, float]:
        m = {"candidates": self.done, "passed": self.passed, "gpu_seconds": self.gpu_seconds,
             "cost_usd": self.usd, "wall_s": time.monotonic() - self.started}
        m |= {f"gpu_seconds/{host}": v for host, v in self.host_seconds.items()}
        return m | ({"best_score": self.best} if self.best is not None else {})


def flow_seed(seed: int) -> int:
    """The proposer's seed: the user's, folded with this flow run's id, so two flows started
    with the same seed at the same moment do not propose the same batch."""
    return int(hashlib.sha256(f"{seed}/{flow_run.id}".encode()).hexdigest()[:8], 16)


def room(slots: list[Slot], in_flight: int) -> int:
    """How many more candidates can start now: healthy slots that are free, less those
    already submitted but not yet holding a lease. At least one when none is in flight."""
    usable = HEALTH.usable(slots)
    n = min(len(usable) - in_flight, len(free_slots(usable))) if usable else 0
    return max(n, 0 if in_flight else 1)


def claim_orphan(tracker: Tracker, parent: str, scope: RunScope, old_run: str, candidate: Candidate) -> str:
    """Re-queue a candidate a stopped flow left pending: a new pending child here, the old one retired."""
    run_id = tracker.open_candidate(parent, scope, candidate, requeued_from=old_run)
    tracker.retire_orphan(old_run, run_id)
    return run_id


@flow(name="optimize-op", log_prints=True)
def optimize_op(op: str = "rmsnorm", target: Target = Target(), proposer: ProposerName = "tpe",
                template: str | None = None, seed: int = 0, pool: Pool | None = None) -> dict:
    """Optimize one op for one target: every candidate, passing or not, becomes an MLflow run.
    As many candidates run at once as the pool has free GPUs of the target's class."""
    spec = get_op(op)
    template = template or next(iter(spec.templates))
    if template not in spec.templates:
        raise ValueError(f"{op} has no template {template!r}; known: {', '.join(spec.templates)}")
    pool = pool or local_pool()
    slots = pool.slots(target.gpu_class)
    scope = scope_for(op, target, pool)
    ensure_limits(pool)
    tracker = Tracker(TrackingConfig.from_env())
    proposer_seed = flow_seed(seed)
    parent = tracker.start_parent(
        "optimization", scope, f"optimize {op} {target.model}",
        params={"target": target.model_dump(mode="json"), "proposer": proposer, "template": template,
                "seed": seed, "proposer_seed": proposer_seed, "pool": [s.label for s in slots]},
        tags={"infersmith.proposer": proposer, "infersmith.template": template})
    print(f"optimizing {op} for {target.key()} with {proposer} over template {template!r} "
          f"on {', '.join(s.label for s in slots)}; tracking run {parent}")
    progress = Progress(target)
    orphans = tracker.orphaned_pending(scope, template)
    if orphans:
        print(f"re-queueing {len(orphans)} candidates a stopped flow left pending")
    in_flight: dict[PrefectFuture, Candidate] = {}
    exhausted = None
    try:
        while True:
            n = min(room(slots, len(in_flight)), target.budget.candidates - progress.done - len(in_flight))
            if progress.may_launch(len(in_flight)) and n > 0:
                batch = [(c, claim_orphan(tracker, parent, scope, old, c)) for old, c in orphans[:n]]
                orphans = orphans[n:]
                if len(batch) < n:  # open the pending runs first: the next proposal, here or in
                    # another flow, sees them in its history and proposes something else
                    history = trials(tracker, scope, template)
                    fresh = propose(proposer, op, template, proposer_seed, history, n - len(batch))
                    batch += [(c, tracker.open_candidate(parent, scope, c)) for c in fresh]
                    exhausted = None if batch else f"the template's space has nothing new ({len(history)} points tried)"
                for c, run_id in batch:
                    in_flight[evaluate.submit(c, run_id, target, slots, tracker)] = c
            if not in_flight:
                break
            fut = next(as_completed(list(in_flight)))
            in_flight.pop(fut)
            outcome = fut.result()
            progress.record(outcome)
            print(f"[{progress.done}/{target.budget.candidates}] {outcome.candidate.label} on "
                  f"{outcome.charge.gpu}: {one_line(outcome)}")
    except BaseException as e:
        tracker.fail_parent(parent, f"{type(e).__name__}: {e}")
        raise
    reason = progress.stop_reason() or exhausted or "no candidate left to run"
    ranked = board(tracker, op, target.model, limit=10, target=target.key(),
                   gpu_class=None if scope.gpu_class == "mixed" else scope.gpu_class)
    rows = [e.__dict__ for e in ranked.entries]
    left_out = f"{ranked.fallbacks} reference_fallback candidates left out (torch's own implementation)"
    print(f"stopped: {reason}. {progress.passed}/{progress.done} passed"
          + (f"; best score {progress.best:.3g}x" if progress.best else ""))
    create_table_artifact(table=rows or [{"result": left_out if ranked.fallbacks else "no candidate passed"}],
                          key=f"leaderboard-{op.replace('_', '-')}",
                          description=f"{op} on {target.key()} ({scope.gpu_class}): passed candidates, best "
                                      "score first" + (f"; {left_out}" if ranked.fallbacks else ""))
    tracker.finish_parent(parent, progress.metrics() | {"stopped_early": float(progress.done < target.budget.candidates)},
                          {"leaderboard.json": rows, "stop_reason.json": {"reason": reason}})
    return {"parent_run_id": parent, "stop_reason": reason, **progress.metrics()}


if __name__ == "__main__":
    optimize_op(op="rmsnorm", target=Target(model="tiny", budget={"candidates": 8}), proposer="random")
