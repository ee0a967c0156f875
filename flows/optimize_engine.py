"""optimize_engine: propose engine configurations -> serve each end to end (accuracy, AIPerf on
every traffic pattern, every metric against the baseline) until the budget; serve_bench: the
stage once, for one configuration or one server command."""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_table_artifact

from contract.serve import METRICS, EngineCandidate
from contract.verdict import PASS
from flows.optimize_op import ProposerName, summary
from gpu_pool.leases import ensure_limits
from gpu_pool.pool import Pool, local_pool
from proposers.engine import EngineProposer
from proposers.engine_spec import SpecProposer
from targets import Target
from targets.engine_spec import load_spec, spec_path
from tasks.reference import reference_task
from tasks.serve import Baseline, EngineOutcome, evaluate_engine, one_line
from tracking.artifacts import Results
from tracking.cost import FlowCost, per_gain_text
from tracking.history import engine_board, engine_trials, kernel_choices
from tracking.ledger import Charge
from tracking.schema import RunScope, Tracker
from tracking.store import TrackingConfig

OP = "engine"  # the MLflow experiment of engine runs: infersmith-engine


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

    def start(self) -> None:
        self.reference = reference_task(self.target, self.model_dir, self.slots, self.baseline,
                                        self.reference_charge)

    def evaluate(self, cand: EngineCandidate, command: str | None = None, reruns: str = "") -> EngineOutcome:
        run_id = self.tracker.open_engine_candidate(self.parent, self.scope, cand, reruns)
        outcome = evaluate_engine(cand, run_id, self.target, self.model_dir, self.slots, self.tracker, self.reference,
                                  self.baseline, self.out / cand.id, command)
        self.outcomes[run_id] = {"candidate": cand.to_dict(), "metrics": outcome.metrics,
                                 "verdict": json.loads(outcome.verdict.to_json())}
        self.cost.add(outcome.charge)
        score = outcome.metrics.get("score") if outcome.verdict.status == PASS else None
        if score is not None:
            self.best = score if self.best is None else max(self.best, score)
        return outcome

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
                                   {"leaderboard.json": rows})
        if (self.out / "baseline").is_dir():
            self.tracker.client.log_artifacts(self.parent, str(self.out / "baseline"), "baseline")
        shutil.rmtree(self.out, ignore_errors=True)
        archive = self.results.publish(self.parent, {"metrics.json": metrics, "candidates.json": self.outcomes,
                                                     "target.json": self.target.model_dump(mode="json")})
        return metrics | ({"results": archive} if archive else {})

    def fail(self, e: BaseException) -> None:
        self.tracker.fail_parent(self.parent, f"{type(e).__name__}: {e}")
        shutil.rmtree(self.out, ignore_errors=True)


@flow(name="optimize-engine", log_prints=True)
def optimize_engine(model_dir: str, target: Target = Target(), seed: int = 0, kernels_per_op: int = 2,
                    include: list[dict] | None = None, pool: Pool | None = None,
                    proposer: ProposerName = "tpe", engine_spec: str | None = None) -> dict:
    """Engine configurations for one model directory, one at a time through the serve stage, each
    a child run of `infersmith-engine`. `include`: configurations (EngineCandidate fields) to try
    first; then the proposer's over the op leaderboards' kernels and the engine's knobs. With
    `engine_spec` (a shipped spec's name — vllm, sglang, infersmith — or a spec file's path): that
    server's knobs instead, against its defaults as the baseline (docs/end-to-end.md)."""
    spec = load_spec(engine_spec) if engine_spec else None
    if spec:
        if include:
            raise ValueError("include names kernels files of this project's engine; an engine spec search has none")
        target = target.model_copy(update={"serving": spec.serving(target.serving)})
    s = Session("engine-optimization", f"optimize {spec.engine if spec else 'engine'} {Path(model_dir).name}",
                Path(model_dir), target, pool, {"proposer": proposer, "seed": seed, "kernels_per_op": kernels_per_op,
                                                "include": include or [], "engine_spec": engine_spec or ""})
    queue = [EngineCandidate.from_dict({"origin": "include", **d}) for d in include or []]
    done, passed, started = 0, 0, time.monotonic()
    try:
        s.start()
        if spec:
            s.tracker.client.log_text(s.parent, spec_path(engine_spec).read_text(), "engine_spec.yaml")
            search = SpecProposer(spec, proposer, seed)
        else:
            options = kernel_choices(s.tracker, target.model, target.activation_dtype,
                                     None if s.scope.gpu_class == "mixed" else s.scope.gpu_class, kernels_per_op,
                                     s.out / "kernels")
            search = EngineProposer(proposer, options, any(slot.gpu is not None for slot in s.slots), seed)
        print(f"optimizing the engine on {model_dir} for {s.scope.target_key} against {target.serving.baseline} "
              f"with {proposer} on {', '.join(slot.label for slot in s.slots)}; tracking run {s.parent}")
        while done < target.budget.candidates and time.monotonic() - started < target.budget.wall_clock_s:
            # Read again each time: the scores of this flow's own runs and other flows' pending ones.
            history = engine_trials(s.tracker, s.scope)
            tried = {t.id for t in history}
            fresh = [c for c in queue if c.id not in tried][:1] or search.propose(history, 1)
            if not fresh:
                break
            cand = fresh[0]
            queue = [c for c in queue if c.id != cand.id]
            outcome = s.evaluate(cand)
            done += 1
            passed += outcome.verdict.status == PASS
            print(f"[{done}/{target.budget.candidates}] {cand.label}: {one_line(outcome)}")
    except BaseException as e:
        s.fail(e)
        raise
    reason = (f"budget of {target.budget.candidates} candidates spent" if done >= target.budget.candidates
              else "wall-clock budget spent" if time.monotonic() - started >= target.budget.wall_clock_s
              else "the proposer has nothing new")
    metrics = s.finish({"candidates": done, "passed": passed}, reason)
    archive = metrics.pop("results", None)
    print(f"stopped after {done} candidates; {passed} passed" + (f", best score {s.best:.3g}x" if s.best else "")
          + (f"; results archive: {archive}" if archive else ""))
    return {"parent_run_id": s.parent, "results": archive, **metrics}


@flow(name="serve-bench", log_prints=True)
def serve_bench(model_dir: str, target: Target = Target(), kernels: dict | None = None,
                candidate_command: str | None = None, pool: Pool | None = None,
                engine: dict | None = None) -> dict:
    """The serve stage once: the engine with `kernels` and the settings `engine` names
    (EngineCandidate fields, e.g. spec_tokens) — or the server `candidate_command` starts — against
    the baseline. Returns the verdict, the metrics and a side-by-side table."""
    cand = EngineCandidate(kernels=kernels or {}, origin="serve-bench", **(engine or {}))
    s = Session("serve-bench", f"serve-bench {Path(model_dir).name}", Path(model_dir), target, pool,
                {"kernels": kernels or {}, "candidate_command": candidate_command or "", "engine": engine or {}})
    try:
        s.start()
        outcome = s.evaluate(cand, candidate_command)
    except BaseException as e:
        s.fail(e)
        raise
    metrics = s.finish({"candidates": 1, "passed": float(outcome.verdict.status == PASS)}, "one configuration served")
    return {"metrics": metrics, "verdict": outcome.verdict.status, "line": one_line(outcome), "run_id": outcome.run_id,
            "parent_run_id": s.parent, "gates": [g.__dict__ for g in outcome.verdict.gates],
            "table": side_by_side(outcome, target)}


def side_by_side(o: EngineOutcome, target: Target) -> list[dict]:
    """One row per pattern and metric: candidate, baseline, candidate's advantage (>1: better); and
    with speculative decoding the pattern's acceptance rate (the candidate's alone)."""
    rows = []
    for p in target.serving.traffic:
        for name, (_, _, higher) in METRICS.items():
            c, b = o.metrics.get(f"{p.name}/{name}"), o.metrics.get(f"{p.name}/baseline_{name}")
            rows.append({"pattern": p.name, "metric": name, "better": "higher" if higher else "lower",
                         "candidate": c, "baseline": b, "vs_baseline": o.metrics.get(f"{p.name}/vs_baseline_{name}")})
        if f"{p.name}/spec_drafted_tokens" in o.metrics:
            rows.append({"pattern": p.name, "metric": "spec_acceptance_rate", "better": "higher",
                         "candidate": o.metrics.get(f"{p.name}/spec_acceptance_rate"), "baseline": None,
                         "vs_baseline": None})
    return rows
