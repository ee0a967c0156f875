"""Read back what tracking holds: the trials a proposer learns from, and the leaderboard."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Run, ViewType

from harness.job import Candidate
from harness.serve.job import EngineCandidate
from proposers.base import PENDING, Trial
from proposers.engine import EngineTrial
from tracking.schema import T, RunScope, Tracker


def _quote(v: str) -> str:
    return "'" + v.replace("'", "\\'") + "'"


def _filter(**tags: str) -> str:
    return " AND ".join(f"tags.`{T}{k}` = {_quote(v)}" for k, v in tags.items())


def search(tracker: Tracker, op: str, order_by: list[str] | None = None, **tags: str) -> list[Run]:
    runs, token = [], None
    while True:
        page = tracker.client.search_runs([tracker.experiment(op)], _filter(kind="candidate", op=op, **tags),
                                          run_view_type=ViewType.ACTIVE_ONLY, max_results=1000,
                                          order_by=order_by, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def trials(tracker: Tracker, scope: RunScope, template: str) -> list[Trial]:
    """Every trial of this op, target, GPU class and template, from any flow, finished or pending."""
    out = []
    for run in search(tracker, scope.op, target=scope.target_key, template=template,
                      pool_class=scope.gpu_class):
        cand = Candidate.from_dict(json.loads(run.data.tags[f"{T}candidate"]))
        out.append(Trial(cand, run.data.tags.get(f"{T}status", "pending"), run.data.metrics.get("score")))
    return out


@dataclass(frozen=True)
class Entry:
    rank: int
    label: str
    candidate_id: str
    score: float
    vs_eager: float | None
    vs_compile: float | None
    pct_roofline: float | None
    device: str
    gpu_timing: bool
    target: str
    run_id: str


def leaderboard(tracker: Tracker, op: str, model: str | None = None, limit: int = 20) -> list[Entry]:
    """Passed candidates, best score first, each candidate once (its best run)."""
    tags = {"status": "pass"} | ({"model": model} if model else {})
    runs = search(tracker, op, order_by=["metrics.score DESC"], **tags)
    seen, out = set(), []
    for run in runs:
        t, m = run.data.tags, run.data.metrics
        key = (t.get(f"{T}candidate_id"), t.get(f"{T}target"), t.get(f"{T}device"))
        if key in seen or "score" not in m:
            continue
        seen.add(key)
        out.append(Entry(len(out) + 1, run.info.run_name or key[0], key[0] or "", m["score"],
                         m.get("geomean_speedup_vs_eager"), m.get("geomean_speedup_vs_compile"),
                         m.get("geomean_pct_roofline"), t.get(f"{T}device", ""),
                         t.get(f"{T}gpu_timing") == "true", t.get(f"{T}target", ""), run.info.run_id))
        if len(out) >= limit:
            break
    return out


def engine_trials(tracker: Tracker, scope: RunScope) -> list[EngineTrial]:
    """Every engine configuration tried for this target and pool class, from any flow, finished
    or pending, with its score where it has one (passed, or failed only the all-metrics gate)."""
    out = []
    for run in search(tracker, scope.op, target=scope.target_key, template="engine", pool_class=scope.gpu_class):
        tags = run.data.tags
        state = tags.get(f"{T}status", PENDING)
        scored = state == "pass" or (state == "fail" and tags.get(f"{T}failing_gate") == "all_metrics")
        out.append(EngineTrial(EngineCandidate.from_dict(json.loads(tags[f"{T}candidate"])),
                               tags.get(f"{T}candidate_id", ""), state,
                               run.data.metrics.get("score") if scored else None))
    return out


def kernel_choices(tracker: Tracker, model: str, per_op: int, dest: Path) -> dict[str, list[dict]]:
    """Per engine op: eager, then the best `per_op` passed candidates of its leaderboard that were
    timed on a GPU, as kernels-file choices (a free candidate's source is fetched into dest)."""
    from engine_templates.engine.kernels import ENGINE_OPS

    out = {}
    for op in ENGINE_OPS:
        choices = [{"impl": "eager"}]
        for entry in [e for e in leaderboard(tracker, op, model, limit=50) if e.gpu_timing][:per_op]:
            cand = Candidate.from_dict(json.loads(tracker.client.get_run(entry.run_id).data.tags[f"{T}candidate"]))
            if cand.kind == "template":
                choices.append({"impl": "template", "template": cand.template, "point": cand.point})
            else:
                path = dest / f"{op}-{cand.id}.py"
                dest.mkdir(parents=True, exist_ok=True)
                path.write_text(cand.source)
                choices.append({"impl": "free", "path": str(path)})
        out[op] = choices
    return out
