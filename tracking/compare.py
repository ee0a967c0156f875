"""A candidate's figures then and now: side by side for `reproduce`, and what counts as a
regression for `revalidate`.

An op candidate regressed when its new verdict does not pass, or when on any shape its time
grew by more than the spread of its two timings (the larger of the old and the new run's) plus
`slack`. An engine configuration regressed when its new verdict does not pass (on every pattern
every metric must still beat a freshly measured baseline by the margin), when its score fell by
more than `slack`, or when any pattern's metric got worse than it was by more than `slack`.
"""
from __future__ import annotations

from mlflow.entities import Run

from contract.serve import METRICS
from tracking.charts import per_shape
from tracking.replay import versions
from tracking.schema import T

SHAPE_FIGURES = (("latency_us", "µs"), ("speedup_vs_eager", "vs eager"), ("speedup_vs_compile", "vs compile"),
                 ("pct_roofline", "% roofline"))


def _fmt(v) -> str:
    return "-" if v is None else v if isinstance(v, str) else f"{v:.4g}"


def per_pattern(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """An engine run's `<pattern>/<metric>` figures (the candidate's own, not the baseline's)."""
    out: dict[str, dict[str, float]] = {}
    for k, v in metrics.items():
        pattern, _, name = k.partition("/")
        if name and pattern not in ("accuracy", "stage_seconds", "baseline") and "baseline" not in name:
            out.setdefault(pattern, {})[name] = v
    return out


def figures(run: Run, is_engine: bool) -> dict[str, object]:
    """What a person compares: verdict, score, per shape (or pattern) figures, versions, cost."""
    t, m = run.data.tags, run.data.metrics
    gate = t.get(f"{T}failing_gate", "")
    out: dict[str, object] = {"verdict": t.get(f"{T}status", "pending") + (f" [{gate}]" if gate else ""),
                              "score": m.get("score")}
    if is_engine:
        out["worst vs baseline"] = m.get("worst_vs_baseline")
        for pattern, fig in sorted(per_pattern(m).items()):
            out |= {f"{pattern} {name}": v for name, v in sorted(fig.items())}
    else:
        for shape, fig in sorted(per_shape(m).items()):
            out |= {f"{shape} {label}": fig.get(key) for key, label in SHAPE_FIGURES}
        out["max rel error"] = m.get("max_rel_error")
    out |= versions(run)
    out |= {"GPU-seconds": m.get("gpu_seconds"), "cost $": m.get("total_usd", m.get("cost_usd"))}
    return out


def side_by_side(old: Run, new: Run, is_engine: bool) -> list[tuple[str, str, str]]:
    a, b = figures(old, is_engine), figures(new, is_engine)
    return [(k, _fmt(a.get(k)), _fmt(b.get(k))) for k in dict.fromkeys([*a, *b])]


def regressions(old: dict[str, float], new: dict[str, float], new_status: str, is_engine: bool,
                slack: float) -> list[str]:
    """What got worse, one line each; empty when the candidate holds."""
    if new_status != "pass":
        return [f"its verdict is now {new_status}"]
    if is_engine:
        return _engine(old, new, slack)
    out = []
    before, after = per_shape(old), per_shape(new)
    for shape, o in sorted(before.items()):
        n = after.get(shape)
        if n is None:
            out.append(f"{shape}: no longer measured")
            continue
        allowed = max(o.get("spread", 0.0), n.get("spread", 0.0)) + slack
        if n["latency_us"] > o["latency_us"] * (1 + allowed):
            out.append(f"{shape}: {o['latency_us']:.4g} µs -> {n['latency_us']:.4g} µs "
                       f"(+{n['latency_us'] / o['latency_us'] - 1:.1%}; allowed +{allowed:.1%}: spread + slack)")
    return out


def _engine(old: dict[str, float], new: dict[str, float], slack: float) -> list[str]:
    out = []
    if old.get("score") and new.get("score", 0.0) < old["score"] * (1 - slack):
        out.append(f"score vs baseline {old['score']:.4g} -> {new.get('score', 0.0):.4g} (more than {slack:.0%} lower)")
    after = per_pattern(new)
    for pattern, figs in sorted(per_pattern(old).items()):
        for name, o in sorted(figs.items()):
            n = after.get(pattern, {}).get(name)
            if name not in METRICS or n is None or not o:  # what the gate compares, nothing else
                continue
            higher = METRICS[name][2]
            worse = n < o * (1 - slack) if higher else n > o * (1 + slack)
            if worse:
                out.append(f"{pattern}/{name}: {o:.4g} -> {n:.4g} (more than {slack:.0%} worse)")
    return out
