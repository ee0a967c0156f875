"""Draft entries from verified runs: per GPU class and shape class of one optimization's scope,
the best passed candidate over those shapes, its margin over torch.compile, and every gate that
stopped a candidate. Nothing unverified goes in: pending runs, runs waiting for a person's
approval, and reference_fallback candidates (torch's own speed) are left out."""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict

from mlflow.entities import Run

from tracking.history import flags, search
from tracking.knowledge.entries import DRAFT, Entry, KnowledgeBase, now
from tracking.schema import RunScope, T, Tracker

VERIFIED = ("pass", "fail", "crash")


def shape_class(label: str) -> str:
    return label.split("_", 1)[0]


def _geomean(values: list[float | None]) -> float | None:
    if not values or not all(values):
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def class_speed(run: Run, labels: list[str]) -> tuple[float, float | None, float | None] | None:
    """(score, vs torch.compile, vs eager) over `labels`; None when a shape was not timed."""
    m = run.data.metrics
    if not all(f"{label}/latency_us" in m for label in labels):
        return None
    score = _geomean([min(x for x in (m[f"{label}/eager_us"], m.get(f"{label}/compile_us")) if x)
                      / m[f"{label}/latency_us"] for label in labels])
    return (score, _geomean([m.get(f"{label}/speedup_vs_compile") for label in labels]),
            _geomean([m.get(f"{label}/speedup_vs_eager") for label in labels]))


def _winner(run: Run, tracker: Tracker) -> dict:
    tags, params = run.data.tags, run.data.params
    cand = json.loads(tags[f"{T}candidate"])
    # A free module's source travels in the entry: an exported entry reaches a store without its run.
    source = (tracker.free_source(run.info.run_id) or "") if cand["kind"] == "free" else ""
    return {"candidate_id": tags.get(f"{T}candidate_id", ""), "kind": cand["kind"], "template": cand.get("template"),
            "point": cand.get("point") or {}, "source_sha256": params.get("candidate.source_sha256", ""),
            "proposer": tags.get(f"{T}proposer", ""), "summary": tags.get(f"{T}summary", ""),
            "run_id": run.info.run_id, "source": source}


def derive(tracker: Tracker, scope: RunScope) -> list[Entry]:
    """Unsaved draft entries for the scope's verified runs, per GPU class that ran them and shape class."""
    by_class: dict[str, list[Run]] = defaultdict(list)
    for run in search(tracker, scope.op, target=scope.target_key, pool_class=scope.gpu_class):
        t = run.data.tags
        if t.get(f"{T}status") in VERIFIED and t.get(f"{T}approval") != "waiting":
            by_class[t.get(f"{T}gpu_class", scope.gpu_class)].append(run)
    model, dtype = scope.target_key.split("/")[:2]
    out = []
    for gpu_class, runs in sorted(by_class.items()):
        failures = Counter(r.data.tags.get(f"{T}failing_gate") or "unknown" for r in runs
                           if r.data.tags[f"{T}status"] != "pass")
        passed = [r for r in runs if r.data.tags[f"{T}status"] == "pass" and "score" in r.data.metrics
                  and "reference_fallback" not in flags(r)]
        labels = sorted({k.split("/")[0] for r in passed for k in r.data.metrics if k.endswith("/latency_us")})
        classes: dict[str, list[str]] = defaultdict(list)
        for label in labels:
            classes[shape_class(label)].append(label)
        for cls, shapes in sorted(classes.items()):
            timed = [(speed, r) for r in passed if (speed := class_speed(r, shapes)) is not None]
            if not timed:
                continue
            (score, vs_compile, vs_eager), best = max(timed, key=lambda x: x[0][0])
            tags = best.data.tags
            entry = Entry(op=scope.op, shape_class=cls, gpu_class=gpu_class, target=scope.target_key, model=model,
                          dtype=dtype, shapes=shapes, winner=_winner(best, tracker), score=score, vs_compile=vs_compile,
                          vs_eager=vs_eager, gpu_timing=tags.get(f"{T}gpu_timing") == "true",
                          device=tags.get(f"{T}device", ""), failures=dict(sorted(failures.items())),
                          runs=sorted(r.info.run_id for r in runs))
            entry.body = describe(entry)
            out.append(entry)
    return out


def write_drafts(tracker: Tracker, scope: RunScope, kb: KnowledgeBase) -> list[str]:
    """Derive the scope's entries and write those that say something new, as drafts: over the
    subject's draft if it has one; beside its published or retired entry when the winner changed."""
    written = []
    for entry in derive(tracker, scope):
        same = [e for e in kb.entries(op=entry.op) if e.subject == entry.subject]
        latest = max(same, key=lambda e: e.revision, default=None)
        if latest is not None and latest.state != DRAFT and latest.winner["candidate_id"] == entry.winner["candidate_id"]:
            continue
        entry.history = [{"state": DRAFT, "at": now(), "by": "infersmith", "note": f"derived from {len(entry.runs)} verified runs"}]
        if latest is not None and latest.state == DRAFT:
            entry.id = latest.id
            kb.save(entry)
        else:
            kb.add(entry)
        written.append(entry.id)
    return written


def _point(winner: dict) -> str:
    if winner["kind"] == "template":
        point = ", ".join(f"{k}={v}" for k, v in sorted(winner["point"].items()))
        return f"template `{winner['template']}` at {point}"
    return f"a free module (source sha256 {winner['source_sha256']})"


def describe(e: Entry) -> str:
    """The entry's text: what a reviewer reads before publishing, and what a prompt shows."""
    w = e.winner
    speed = f"{e.score:.3g}x the best baseline over {', '.join(e.shapes)}"
    if e.vs_compile:
        speed += f"; {e.vs_compile:.3g}x torch.compile ({100 * (e.vs_compile - 1):+.0f}%)"
    timed = f"timed on {e.device}" if e.gpu_timing else "timed by the CPU interpreter: says nothing about a GPU"
    failed = ", ".join(f"{gate} x{n}" for gate, n in e.failures.items()) or "none"
    lines = [f"## {e.op}, {e.shape_class} shapes, {e.gpu_class}: {e.target}", "",
             f"Winning idea: {_point(w)} (candidate {w['candidate_id']}, proposed by {w['proposer'] or 'unknown'}).",
             *([f"> {w['summary']}"] if w.get("summary") else []), "",
             f"Speed: {speed}; {timed}.", "",
             f"Failure modes seen in {len(e.runs)} verified candidates: {failed}.", "",
             f"Provenance: MLflow run {w['run_id']} (the winner); every verified run is listed in `runs`.", ""]
    return "\n".join(lines)
