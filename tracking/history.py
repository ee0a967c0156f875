"""Read back what tracking holds: the trials a proposer learns from, and the leaderboard."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlflow.entities import Run, ViewType

from contract.job import Candidate
from contract.serve import EngineCandidate
from targets.held_out import PREFIX as HELD_OUT
from targets.held_out import withheld
from tracking.schema import CEILING_METRICS, RunScope, T, Tracker
from tracking.trials import PENDING, Ceilings, EngineTrial, Trial


def _quote(v: str) -> str:
    return "'" + v.replace("'", "\\'") + "'"


def _filter(like: dict[str, str], **tags: str) -> str:
    return " AND ".join([f"tags.`{T}{k}` = {_quote(v)}" for k, v in tags.items()]
                        + [f"tags.`{T}{k}` LIKE {_quote(v)}" for k, v in like.items()])


def search(tracker: Tracker, op: str, order_by: list[str] | None = None, like: dict[str, str] | None = None,
           **tags: str) -> list[Run]:
    """Candidate runs of `op` whose tags equal `tags` and match the LIKE patterns of `like`."""
    runs, token = [], None
    while True:
        page = tracker.client.search_runs([tracker.experiment(op)], _filter(like or {}, kind="candidate", op=op, **tags),
                                          run_view_type=ViewType.ACTIVE_ONLY, max_results=1000,
                                          order_by=order_by, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def trials(tracker: Tracker, scope: RunScope, template: str | None) -> list[Trial]:
    """Every trial of this op, target, GPU class and template (None: every template and every free
    candidate), from any flow, finished or pending, with what the run recorded: what proposers
    learn from, so nothing of the held-out shapes."""
    out = []
    for run in search(tracker, scope.op, target=scope.target_key, pool_class=scope.gpu_class,
                      **({"template": template} if template else {})):
        tags = run.data.tags
        bare = json.loads(tags[f"{T}candidate"])
        if bare["kind"] == "free":
            source = tracker.free_source(run.info.run_id)
            if source is None:  # opened by a version that logged the source only when judged
                continue
            bare["source"] = source
        # What a held-out shape did stays out of the proposers' view (targets/held_out.py).
        metrics = {k: v for k, v in run.data.metrics.items() if not k.startswith(HELD_OUT)}
        out.append(Trial(Candidate.from_dict(bare), tags.get(f"{T}status", PENDING), run.data.metrics.get("score"),
                         metrics, tags.get(f"{T}failing_gate", ""),
                         withheld(tags.get(f"{T}failing_detail", "")), run.info.start_time or 0))
    return out


def ceilings(tracker: Tracker, gpu_class: str, dtype: str) -> Ceilings | None:
    """The ceilings the latest GPU-timed candidate of this GPU class and dtype measured, any op."""
    if gpu_class in ("mixed", "any", "cpu"):
        return None
    copy, matmul = CEILING_METRICS["copy_bytes_per_s"], CEILING_METRICS["matmul_flops_per_s"]
    exps = [e.experiment_id for e in tracker.client.search_experiments() if e.name.startswith("infersmith-")]
    where = (f"tags.`{T}kind` = 'candidate' AND tags.`{T}gpu_class` = {_quote(gpu_class)} AND "
             f"tags.`{T}gpu_timing` = 'true' AND tags.`{T}target` LIKE {_quote(f'%/{dtype}/%')} AND "
             f"metrics.`{copy}` > 0")
    runs = tracker.client.search_runs(exps, where, max_results=1, order_by=["attributes.start_time DESC"]) if exps else []
    if not runs:
        return None
    m, device = runs[0].data.metrics, runs[0].data.tags.get(f"{T}device", "")
    return Ceilings(gpu_class, m[copy], m[matmul], device)


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
    # timed on the held-out shapes at the end of its optimization: the score there, and the
    # status of that timing ("" where it was not timed, "pass", or what stopped it)
    held_out: float | None = None
    held_out_status: str = ""
    gpu_class: str = ""
    gpu_hours: float = 0.0  # what this run of it cost
    total_usd: float = 0.0  # GPU and proposer


def flags(run: Run) -> set[str]:
    """The verdict's screening flags (tag `infersmith.flags`; none on runs logged before it existed)."""
    return {f for f in run.data.tags.get(f"{T}flags", "").split(",") if f}


@dataclass(frozen=True)
class Board:
    entries: list[Entry]
    fallbacks: int  # passed candidates left out as `reference_fallback`: their speed is torch's


def board(tracker: Tracker, op: str, model: str | None = None, limit: int = 20, *, target: str | None = None,
          dtype: str | None = None, gpu_class: str | None = None, gpu_timing: bool = False) -> Board:
    """Passed candidates, best score first, each candidate once per target and device (its best
    run), of this model, target key, dtype and GPU class where given, timed on a GPU if
    `gpu_timing`: selected before the first `limit` are taken. A candidate flagged
    `reference_fallback` calls PyTorch's own implementation of the op; it is counted, not ranked."""
    tags = {"status": "pass"} | ({"model": model} if model else {}) | ({"target": target} if target else {})
    tags |= ({"gpu_class": gpu_class} if gpu_class else {}) | ({"gpu_timing": "true"} if gpu_timing else {})
    # A target key is model/dtype/workload: LIKE's `_` matches any one character, so the prefix is
    # checked again below.
    prefix = f"{model or '%'}/{dtype}/" if dtype else ""
    runs = search(tracker, op, order_by=["metrics.score DESC"], like={"target": prefix + "%"} if prefix else None, **tags)
    seen, out, fallbacks = set(), [], set()
    for run in runs:
        t, m = run.data.tags, run.data.metrics
        key = (t.get(f"{T}candidate_id"), t.get(f"{T}target"), t.get(f"{T}device"))
        if key in seen or "score" not in m or (dtype and (key[1] or "").split("/")[1:2] != [dtype]):
            continue
        seen.add(key)
        if "reference_fallback" in flags(run):
            fallbacks.add(key)
            continue
        if len(out) < limit:
            out.append(Entry(len(out) + 1, run.info.run_name or key[0], key[0] or "", m["score"],
                             m.get("geomean_speedup_vs_eager"), m.get("geomean_speedup_vs_compile"),
                             m.get("geomean_pct_roofline"), t.get(f"{T}device", ""),
                             t.get(f"{T}gpu_timing") == "true", t.get(f"{T}target", ""), run.info.run_id,
                             m.get("held_out_score"), t.get(f"{T}held_out", ""), t.get(f"{T}gpu_class", ""),
                             (m.get("gpu_seconds", 0.0) + m.get("held_out_gpu_seconds", 0.0)) / 3600.0,
                             _total_usd(m) + m.get("held_out_cost_usd", 0.0)))
    return Board(out, len(fallbacks))


def _total_usd(m: dict[str, float]) -> float:
    """GPU and proposer dollars; a run logged before `total_usd` existed had only `cost_usd`."""
    return m.get("total_usd", m.get("cost_usd", 0.0))


@dataclass(frozen=True)
class EngineEntry:
    rank: int
    label: str
    candidate_id: str
    score: float  # geometric mean of every metric's advantage over the baseline, every pattern
    worst_vs_baseline: float | None
    device: str
    gpu_class: str
    target: str
    run_id: str
    gpu_hours: float
    total_usd: float


def engine_board(tracker: Tracker, limit: int = 20, model: str | None = None, target: str | None = None,
                 gpu_class: str | None = None) -> list[EngineEntry]:
    """Passed engine configurations, best score first, each once per target and device (its best run)."""
    tags = {"status": "pass"} | ({"model": model} if model else {}) | ({"target": target} if target else {})
    tags |= {"gpu_class": gpu_class} if gpu_class else {}
    seen, out = set(), []
    for run in search(tracker, "engine", order_by=["metrics.score DESC"], **tags):
        t, m = run.data.tags, run.data.metrics
        key = (t.get(f"{T}candidate_id"), t.get(f"{T}target"), t.get(f"{T}device"))
        if key in seen or "score" not in m or len(out) >= limit:
            continue
        seen.add(key)
        out.append(EngineEntry(len(out) + 1, run.info.run_name or key[0] or "", key[0] or "", m["score"],
                               m.get("worst_vs_baseline"), t.get(f"{T}device", ""), t.get(f"{T}gpu_class", ""),
                               key[1] or "", run.info.run_id, m.get("gpu_seconds", 0.0) / 3600.0,
                               _total_usd(m)))
    return out


def leaderboard(tracker: Tracker, op: str, model: str | None = None, limit: int = 20, **where) -> list[Entry]:
    """board()'s entries."""
    return board(tracker, op, model, limit, **where).entries


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


def kernel_choices(tracker: Tracker, model: str, dtype: str, gpu_class: str | None, per_op: int,
                   dest: Path) -> dict[str, list[dict]]:
    """Per engine op: eager, then the best `per_op` distinct passed candidates of its leaderboard
    for this model and dtype, timed on a GPU of `gpu_class` (any class when None), as
    kernels-file choices (a free candidate's source is fetched into dest)."""
    from engine_templates.engine.kernels import ENGINE_OPS

    out = {}
    for op in ENGINE_OPS:
        choices, chosen = [{"impl": "eager"}], set()
        for entry in leaderboard(tracker, op, model, limit=1000, dtype=dtype, gpu_class=gpu_class, gpu_timing=True):
            if len(chosen) == per_op:
                break
            if entry.candidate_id in chosen:  # the same kernel's run for another workload
                continue
            chosen.add(entry.candidate_id)
            cand = json.loads(tracker.client.get_run(entry.run_id).data.tags[f"{T}candidate"])
            if cand["kind"] == "template":
                choices.append({"impl": "template", "template": cand["template"], "point": cand["point"]})
            else:  # the run's tag holds no source (Tracker.open_candidate): its artifact does
                dest.mkdir(parents=True, exist_ok=True)
                got = Path(tracker.client.download_artifacts(entry.run_id, "candidate/candidate.py", str(dest)))
                path = got.replace(dest / f"{op}-{entry.candidate_id}.py")
                choices.append({"impl": "free", "path": str(path)})
        out[op] = choices
    return out


def winners(tracker: Tracker, op: str, model: str | None = None, gpu_class: str | None = None,
            gpu_timing: bool = True) -> list[Run]:
    """The best passed run of each target and GPU class of `op` ("engine": engine configurations),
    of this model and class where given, timed on a GPU if `gpu_timing`; a candidate flagged
    `reference_fallback` is torch's own op and never a winner."""
    tags = {"status": "pass"} | ({"model": model} if model else {}) | ({"gpu_class": gpu_class} if gpu_class else {})
    tags |= {"gpu_timing": "true"} if gpu_timing else {}
    best: dict[tuple[str, str], Run] = {}
    for run in search(tracker, op, order_by=["metrics.score DESC"], **tags):
        key = (run.data.tags.get(f"{T}target", ""), run.data.tags.get(f"{T}gpu_class", ""))
        if key not in best and "score" in run.data.metrics and "reference_fallback" not in flags(run):
            best[key] = run
    return [best[k] for k in sorted(best)]
