"""The engine search's side of the loop: a `Session` (what every configuration of one flow
shares, from set-up to publishing), its sources (the configurations to try first, then the
engine proposer's) and where its outcomes go. serve_bench and reproduce run one configuration
through a Session without the loop."""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prefect.artifacts import create_table_artifact

from contract.serve import EngineCandidate
from flows.search.loop import Search
from flows.search.publish import summary
from flows.search.stops import Progress
from gpu_pool.health import HEALTH
from gpu_pool.leases import ensure_limits, group_size
from gpu_pool.pool import Pool, Slot, local_pool
from proposers.engine import EngineProposer
from targets import Target
from tasks.reference import reference_task
from tasks.serve import Baseline, EngineOutcome, evaluate_engine, one_line
from tracking.artifacts import Results
from tracking.cost import FlowCost, per_gain_text
from tracking.history import engine_board, engine_trials
from tracking.ledger import Charge
from tracking.schema import RunScope, Tracker
from tracking.store import TrackingConfig

OP = "engine"  # the MLflow experiment of engine runs: infersmith-engine


def groups(slots: list[Slot], replicas: int) -> int:
    """How many servers of `replicas` GPUs of one host the slots hold at once (a CPU-only host: one)."""
    hosts: dict[str, list[Slot]] = {}
    for slot in slots:
        hosts.setdefault(slot.host.name, []).append(slot)
    return sum(len(held) // group_size(held[0], replicas) for held in hosts.values())


@dataclass
class Opened:
    """A configuration with its pending child run open."""

    candidate: EngineCandidate
    run_id: str


class Session:
    """What every candidate of one flow shares: the pool's slots, tracking, the parent run, a
    scratch folder, the reference's answers and the baseline."""

    def __init__(self, kind: str, name: str, model_dir: Path, target: Target, pool: Pool | None, params: dict,
                 tags: dict | None = None):
        self.model_dir, self.target = Path(model_dir), target
        pool = pool or local_pool()
        self.slots = pool.slots(target.gpu_class)
        if not self.slots:
            raise ValueError(f"the pool has no host of GPU class {target.gpu_class!r}")
        too_small = pool.group_problem(target.gpu_class, target.serving.replicas)
        if too_small:
            raise ValueError(too_small)
        # On a pool host the directory is a path there, checked by the host's session.
        if any(s.host.is_local for s in self.slots) and not (self.model_dir / "config.json").is_file():
            raise ValueError(f"not a model directory: {model_dir} has no config.json")
        classes = {s.host.gpu_class for s in self.slots}
        self.scope = RunScope(OP, target.model, target.serve_key(), classes.pop() if len(classes) == 1 else "mixed")
        ensure_limits(pool)
        self.tracker = Tracker(TrackingConfig.from_env())
        self.results = Results(f"infersmith-{OP}")  # S3, when configured, is checked before anything runs
        self.outcomes: dict[str, dict] = {}
        self.parent = self.tracker.start_parent(kind, self.scope, name, params={
            "target": target.model_dump(mode="json"), "model_dir": str(self.model_dir), **params}, tags=tags)
        self.out = Path(tempfile.mkdtemp(prefix="infersmith-serve-"))
        self.baseline = Baseline(self.out / "baseline")
        self.reference = None
        self.reference_charge = Charge()
        self.cost = FlowCost()
        self.best: float | None = None
        self.progress = Progress(target)

    def start(self) -> None:
        self.reference = reference_task(self.target, self.model_dir, self.slots, self.baseline,
                                        self.reference_charge)

    def open(self, cand: EngineCandidate, reruns: str = "") -> Opened:
        return Opened(cand, self.tracker.open_engine_candidate(self.parent, self.scope, cand, reruns))

    def run(self, o: Opened, command: str | None = None):
        """The serve stage's task, submitted: it waits for a free group of slots of the class."""
        return evaluate_engine.submit(o.candidate, o.run_id, self.target, self.model_dir, self.slots, self.tracker,
                                      self.reference, self.baseline, self.out / o.candidate.id, command)

    def evaluate(self, cand: EngineCandidate, command: str | None = None, reruns: str = "") -> EngineOutcome:
        """One configuration, start to end, outside the loop."""
        o = self.open(cand, reruns)
        outcome = evaluate_engine(cand, o.run_id, self.target, self.model_dir, self.slots, self.tracker,
                                  self.reference, self.baseline, self.out / cand.id, command)
        self.keep(outcome)
        return outcome

    def keep(self, outcome: EngineOutcome) -> None:
        """An outcome into the results archive, the flow's cost and its best score."""
        self.outcomes[outcome.run_id] = {"candidate": outcome.candidate.to_dict(), "metrics": outcome.metrics,
                                         "verdict": json.loads(outcome.verdict.to_json())}
        self.cost.add(outcome.charge)
        if outcome.score is not None:
            self.best = outcome.score if self.best is None else max(self.best, outcome.score)

    def room(self, busy: int) -> int:
        """As many configurations at once as the healthy slots of the class make groups; the
        first always starts (it waits for a group to come free)."""
        return max(groups(HEALTH.usable(self.slots), self.target.serving.replicas) - busy, 0 if busy else 1)

    def search(self, proposer: EngineProposer, include: list[EngineCandidate]) -> Search[Opened, EngineOutcome]:
        def report(o: EngineOutcome) -> None:
            self.keep(o)
            print(f"[{self.progress.done}/{self.target.budget.candidates}] {o.candidate.label}: {one_line(o)}")

        return Search(stops=self.progress, run=self.run, room=self.room, report=report,
                      sources=[Configurations(self, proposer, include)], label=lambda o: o.candidate.label)

    def finish(self, metrics: dict[str, float], reason: str) -> dict[str, float]:
        """Totals on the parent run (the reference's and baseline's GPU time with the candidates'),
        the engine leaderboard and the summary as Prefect artifacts, and the results archive on S3
        when S3 is configured (its URI as `results`); returns the parent's metrics."""
        self.cost.add(self.reference_charge, "reference")
        self.cost.add(self.baseline.charge, "baseline")
        metrics = metrics | self.cost.metrics(self.best) | ({"best_score": self.best} if self.best else {})
        spend = f"spent {self.cost.total.text()}; {per_gain_text(self.cost.total, self.best)}"
        print(spend)
        gpu_class = None if self.scope.gpu_class == "mixed" else self.scope.gpu_class
        rows = [e.__dict__ for e in engine_board(self.tracker, limit=10, target=self.scope.target_key,
                                                 gpu_class=gpu_class)]
        create_table_artifact(table=rows or [{"result": "no configuration passed"}], key="leaderboard-engine",
                              description=f"engine on {self.scope.target_key} ({self.scope.gpu_class}): passed "
                                          f"configurations, best score first. {spend}")
        summary("engine", self.scope.target_key, self.scope.gpu_class, reason, metrics, spend)
        self.tracker.finish_parent(self.parent, metrics | {f"baseline/{k}": v for k, v in self.baseline.metrics().items()},
                                   {"leaderboard.json": rows, "stop_reason.json": {"reason": reason}})
        if (self.out / "baseline").is_dir():
            self.tracker.client.log_artifacts(self.parent, str(self.out / "baseline"), "baseline")
        shutil.rmtree(self.out, ignore_errors=True)
        archive = self.results.publish(self.parent, {"metrics.json": metrics, "candidates.json": self.outcomes,
                                                     "stop_reason.json": {"reason": reason},
                                                     "target.json": self.target.model_dump(mode="json")})
        return metrics | ({"results": archive} if archive else {})

    def fail(self, e: BaseException) -> None:
        self.tracker.fail_parent(self.parent, f"{type(e).__name__}: {e}")
        shutil.rmtree(self.out, ignore_errors=True)


class Configurations:
    """The configurations to try first (`include`), then the proposer's over the op leaderboards'
    kernels and the engine's knobs; history is read again on each take, so the scores of this
    flow's runs and other flows' pending ones count."""

    def __init__(self, s: Session, proposer: EngineProposer, include: list[EngineCandidate]):
        self.s, self.proposer, self.queue, self.exhausted = s, proposer, include, None

    def take(self, n: int) -> list[Opened]:
        history = engine_trials(self.s.tracker, self.s.scope)
        tried = {t.id for t in history}
        first = [c for c in self.queue if c.id not in tried][:n]
        taken = {c.id for c in first}
        self.queue = [c for c in self.queue if c.id not in taken]
        more = self.proposer.propose(history, n - len(first)) if len(first) < n else []
        fresh = first + [c for c in more if c.id not in taken]
        self.exhausted = None if fresh else "the proposer has nothing new"
        return [self.s.open(c) for c in fresh]
