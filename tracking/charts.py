"""Pictures of a run, logged as MLflow artifacts under `charts/`: a PNG and, beside it, the numbers
it plots as JSON (one series per shape, or per traffic pattern), read from tracking alone.

- `roofline.png` (an optimization): per shape, eager, torch.compile and the shape's fastest
  candidate as % of the roofline measured on that device; the ceiling is 100%.
- `progress.png` (an optimization): per candidate in the order they finished, its speed-up over
  the best baseline on each shape and its score (their geometric mean), with the running best.
- `vs_baseline.png` (an engine evaluation): per traffic pattern, each metric's advantage over the
  baseline (>1: better), with the margin every metric had to clear.
"""
from __future__ import annotations

import math
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.entities import Run

from contract.serve import METRICS
from tracking.history import flags
from tracking.schema import T, Tracker

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STAGES = ("eager", "torch.compile", "best candidate")


def _figure(width: float) -> Figure:
    """A figure of its own: no pyplot, so no GUI backend, safe in worker threads. Matplotlib is
    imported here, when a chart is drawn: the commands that draw none (evaluate) never load it."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, 4.5), layout="constrained")


def per_shape(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """`<shape>/<name>` metrics of a candidate run, by shape."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for k, v in metrics.items():
        shape, _, name = k.partition("/")
        if name and shape not in ("stage_seconds", "accuracy"):
            out[shape][name] = v
    return {s: m for s, m in out.items() if "latency_us" in m}


def children(tracker: Tracker, parent_id: str) -> list[Run]:
    """The parent's candidate runs, in the order they finished (pending ones last)."""
    exp = tracker.client.get_run(parent_id).info.experiment_id
    runs = tracker.client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent_id}'", max_results=5000)
    return sorted(runs, key=lambda r: (r.info.end_time is None, r.info.end_time or 0, r.info.start_time))


def roofline_data(runs: list[Run]) -> dict[str, dict[str, float | None]]:
    """Per shape: % of roofline of eager, torch.compile and the fastest passed candidate there."""
    best: dict[str, dict[str, float]] = {}
    for run in runs:
        if run.data.tags.get(f"{T}status") != "pass" or "reference_fallback" in flags(run):
            continue
        for shape, m in per_shape(run.data.metrics).items():
            if shape not in best or m["latency_us"] < best[shape]["latency_us"]:
                best[shape] = m
    out = {}
    for shape, m in best.items():
        def pct(key: str) -> float | None:
            return 100.0 * m["roofline_us"] / m[key] if m.get(key) and m.get("roofline_us") else None
        out[shape] = {"eager": pct("eager_us"), "torch.compile": pct("compile_us"),
                      "best candidate": pct("latency_us"), "best_us": m["latency_us"]}
    return dict(sorted(out.items()))


def progress_data(runs: list[Run]) -> dict[str, list]:
    """Per finished candidate: its status, score, and per shape its speed-up over the best baseline."""
    done = [r for r in runs if r.info.end_time is not None]
    shapes = sorted({s for r in done for s in per_shape(r.data.metrics)})
    series: dict[str, list] = {"status": [], "score": [], **{s: [] for s in shapes}}
    for r in done:
        series["status"].append(r.data.tags.get(f"{T}status", ""))
        series["score"].append(r.data.metrics.get("score"))
        m = per_shape(r.data.metrics)
        for s in shapes:
            t = m.get(s, {})
            bases = [x for x in (t.get("eager_us"), t.get("compile_us")) if x]
            series[s].append(min(bases) / t["latency_us"] if bases and t.get("latency_us") else None)
    return series


def roofline_chart(title: str, data: dict[str, dict[str, float | None]]) -> Figure:
    fig = _figure(8)
    ax = fig.add_subplot()
    xs = range(len(STAGES))
    for shape, row in data.items():
        pts = [(x, row[k]) for x, k in zip(xs, STAGES) if row.get(k) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{shape} ({row['best_us']:.1f} µs)")
    ax.axhline(100.0, color="black", linestyle="--", label="ceiling (measured roofline)")
    ax.set_xticks(list(xs), STAGES)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("% of roofline")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="best")
    return fig


def progress_chart(title: str, data: dict[str, list]) -> Figure:
    fig = _figure(8)
    ax = fig.add_subplot()
    n = range(1, len(data["score"]) + 1)
    for shape in (k for k in data if k not in ("status", "score")):
        ax.plot(n, [math.nan if v is None else v for v in data[shape]], marker=".", linestyle=":", label=shape)
    scores = [math.nan if v is None else v for v in data["score"]]
    ax.plot(n, scores, marker="o", linestyle="", color="black", label="score (geomean)")
    running, best = [], math.nan
    for v in scores:
        best = v if math.isnan(best) or (not math.isnan(v) and v > best) else best
        running.append(best)
    ax.step(n, running, where="post", color="black", label="best so far")
    failed = [i for i, s in zip(n, data["status"]) if s != "pass"]
    if failed:
        ax.plot(failed, [0.0] * len(failed), marker="x", linestyle="", color="red", label="failed or crashed")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("candidate (in the order finished)")
    ax.set_ylabel("speed-up over the best baseline")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="best")
    return fig


def engine_data(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per traffic pattern: each metric's advantage over the baseline (>1: better)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for k, v in metrics.items():
        pattern, _, name = k.partition("/")
        if name.startswith("vs_baseline_"):
            out[pattern][name.removeprefix("vs_baseline_")] = v
    return dict(sorted(out.items()))


def engine_chart(title: str, data: dict[str, dict[str, float]], margin: float) -> Figure:
    fig = _figure(9)
    ax = fig.add_subplot()
    names = [m for m in METRICS if any(m in ratios for ratios in data.values())]
    width = 0.8 / max(len(data), 1)
    for i, (pattern, ratios) in enumerate(data.items()):
        ax.bar([x + i * width for x in range(len(names))], [ratios.get(m, 0.0) for m in names], width, label=pattern)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.0 + margin, color="red", linestyle="--", label=f"needed: baseline + {margin:.0%}")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("candidate over baseline (>1: better)")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="best")
    return fig


def log_chart(tracker: Tracker, run_id: str, name: str, fig: Figure, data: dict) -> None:
    """`charts/<name>.png` and `charts/<name>.json` (what it plots: `series`, one per shape or pattern)."""
    with tempfile.TemporaryDirectory(prefix="infersmith-chart-") as d:
        fig.savefig(Path(d) / f"{name}.png", format="png", dpi=110)
        tracker.client.log_artifact(run_id, str(Path(d) / f"{name}.png"), "charts")
    tracker.client.log_dict(run_id, data, f"charts/{name}.json")


def log_optimization_charts(tracker: Tracker, parent_id: str, title: str) -> None:
    """The roofline and progress charts of an optimization's candidates, on its parent run."""
    runs = children(tracker, parent_id)
    roof = roofline_data(runs)
    if roof:
        log_chart(tracker, parent_id, "roofline", roofline_chart(f"{title}: % of roofline per shape", roof),
                  {"series": roof})
    prog = progress_data(runs)
    if prog["score"]:
        log_chart(tracker, parent_id, "progress", progress_chart(f"{title}: score over candidates", prog),
                  {"status": prog["status"], "score": prog["score"],
                   "series": {k: v for k, v in prog.items() if k not in ("status", "score")}})


def log_engine_chart(tracker: Tracker, run_id: str, title: str, margin: float) -> bool:
    """The engine evaluation's metrics against the baseline per pattern; False when it has none
    (it stopped before the load)."""
    data = engine_data(tracker.client.get_run(run_id).data.metrics)
    if not data:
        return False
    log_chart(tracker, run_id, "vs_baseline", engine_chart(title, data, margin), {"margin": margin, "series": data})
    return True
