"""After the loop: what the op search's best candidates did on the held-out shapes, then what every
search leaves behind — the leaderboard and summary artifacts, the parent run's totals, the
knowledge drafts and the results archive."""
from __future__ import annotations

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.search.loop import Stopped
from flows.search.op import OpSession
from tracking.charts import log_optimization_charts
from tracking.cost import per_gain_text
from tracking.history import board
from tracking.knowledge.derive import write_drafts
from tracking.mlflow_ui import compare_best


def time_on_held_out(s: OpSession) -> None:
    """The best `target.held_out.timed` passed candidates of this run, each printed with what its
    bench stage timed on the held-out shapes (tasks/evaluate.py) beside its searched score."""
    held_out = s.held_out
    best = sorted(s.passed, key=lambda o: -o.verdict.score())[:s.target.held_out.timed] if held_out else []
    for o in best:
        got = f"{o.held_out.score():.3g}x" if o.held_out and o.held_out.score() else "not timed"
        print(f"held-out shapes ({', '.join(sh.label for sh in held_out)}): {o.candidate.label}: "
              f"searched {o.verdict.score():.3g}x, held-out {got}")


def publish_op(s: OpSession, stopped: Stopped) -> dict:
    """The op search's leaderboard, summary, drafts, charts, parent run and results archive;
    returns the flow's result."""
    op, target, progress, reason = s.op, s.target, s.progress, stopped.reason
    ranked = board(s.tracker, op, target.model, limit=10, target=target.key(),
                   gpu_class=None if s.scope.gpu_class == "mixed" else s.scope.gpu_class)
    rows = [e.__dict__ for e in ranked.entries]
    compare = compare_best(s.tracker.cfg, s.tracker.experiment(op), [e.run_id for e in ranked.entries])
    left_out = f"{ranked.fallbacks} reference_fallback candidates left out (torch's own implementation)"
    spend = f"spent {progress.cost.text()} on {progress.done} candidates; {per_gain_text(progress.cost, progress.top)}"
    print(spend)
    if compare:
        print(f"compare the best candidates in MLflow: {compare}")
    create_table_artifact(table=rows or [{"result": left_out if ranked.fallbacks else "no candidate passed"}],
                          key=f"leaderboard-{op.replace('_', '-')}",
                          description=f"{op} on {target.key()} ({s.scope.gpu_class}): passed candidates, best "
                                      "score first" + (f"; {left_out}" if ranked.fallbacks else "") + f". {spend}")
    drafts = write_drafts(s.tracker, s.scope, s.kb)
    if drafts:
        print(f"knowledge: draft entries {', '.join(drafts)}; a person publishes them with `infersmith kb publish ID`")
    metrics = progress.metrics() | {"stopped_early": float(progress.done < target.budget.candidates)}
    summary(f"optimize {op}", target.key(), s.scope.gpu_class, reason, metrics, spend, compare)
    log_optimization_charts(s.tracker, s.parent, f"{op} {target.key()} ({s.scope.gpu_class})")
    s.tracker.finish_parent(s.parent, metrics, {
        "leaderboard.json": rows, "stop_reason.json": {"reason": reason},
        "held_out.json": [sh.to_dict() for sh in s.held_out],
        "knowledge.json": {"drafts": drafts, "warm_start": s.warm.to_dict()}})
    archive = s.results.publish(s.parent, {"leaderboard.json": rows, "metrics.json": metrics,
                                           "stop_reason.json": {"reason": reason}, "verdicts.json": s.verdicts,
                                           "target.json": target.model_dump(mode="json")})
    if archive:
        print(f"results archive: {archive}")
    return {"parent_run_id": s.parent, "stop_reason": reason, "endpoint_down": stopped.down, "drafts": drafts,
            "results": archive, **metrics}


def summary(what: str, target_key: str, gpu_class: str, reason: str, metrics: dict[str, float], spend: str,
            compare: str = "") -> None:
    """The flow's summary artifact: what it ran, why it stopped, what it cost and what that bought,
    and the link to MLflow's comparison of its best candidates."""
    def row(name: str) -> str:
        return f"| {name} | {f'{metrics[name]:.4g}' if name in metrics else '-'} |"

    lines = [f"## {what}: {target_key} ({gpu_class})", "", f"Stopped: {reason}.", "", spend, "",
             *([f"[Compare the best candidates in MLflow]({compare}): per-shape speed-ups, % of roofline, "
                "GPU-hours, $ and tokens side by side.", ""] if compare else []),
             "| metric | value |", "| --- | --- |"]
    lines += [row(n) for n in ("candidates", "passed", "best_score", "gpu_hours", "cost_usd", "proposer_tokens",
                               "proposer_usd", "total_usd", "reference_gpu_hours", "baseline_gpu_hours", "gain_pct",
                               "usd_per_pct_gain", "gpu_hours_per_pct_gain")]
    create_markdown_artifact("\n".join(lines), key=f"summary-{what.split()[-1].replace('_', '-')}",
                             description=f"{what} on {target_key}: cost and cost per gain")
