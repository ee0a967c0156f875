"""Markdown tables of the best measured candidates, per op and target, from tracking.

For every shape: the fastest passed candidate on that shape (an engine dispatches per shape),
with torch eager and torch.compile timed in the same process, each as % of the roofline
measured on that device, and the spread between two timings of the candidate. A ratio to
torch.compile within that spread is marked `tie`. Candidates flagged `reference_fallback` (they
call torch's own op) are left out and counted; the header names the date and versions of the rows
shown, per shape where they differ. Under each table, the candidates timed on held-out shapes
(targets/held_out.py) with their searched and held-out speed-ups.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from datetime import datetime, timezone

from mlflow.entities import Run

from tracking.cost import per_gain_text, spent
from tracking.history import flags, search
from tracking.schema import T, Tracker


def _shape_rows(runs: list[Run]) -> dict[str, tuple[Run, dict[str, float]]]:
    best: dict[str, tuple[Run, dict[str, float]]] = {}
    for run in runs:
        per_shape: dict[str, dict[str, float]] = defaultdict(dict)
        for k, v in run.data.metrics.items():
            if "/" in k and not k.startswith("stage_seconds/"):
                shape, name = k.split("/", 1)
                per_shape[shape][name] = v
        for shape, m in per_shape.items():
            if "latency_us" in m and (shape not in best or m["latency_us"] < best[shape][1]["latency_us"]):
                best[shape] = (run, m)
    return best


def _versus(ratio: float | None, spread: float) -> str:
    """torch.compile's time over the candidate's, and `tie` where the two differ by no more than
    the spread between the candidate's own two timings: a difference the candidate's timing does
    not reproduce says nothing about which is faster. A tie, or a ratio that two decimals would
    round to 1.00x, is printed with three, so that the direction and the size stay visible."""
    if not ratio:
        return "-"
    if abs(ratio - 1.0) <= spread:
        return f"{ratio:.3f}x tie"
    return f"{ratio:.3f}x" if abs(ratio - 1.0) < 0.005 else f"{ratio:.2f}x"


def _cell(us: float | None, pct: float | None) -> str:
    return "-" if us is None else f"{us:.1f} ({pct:.0f}%)" if pct is not None else f"{us:.1f}"


ENV = (("torch", "torch"), ("triton", "triton"), ("cuda", "CUDA"), ("driver", "driver"))


def _by_value(rows: list[tuple[str, str]]) -> str:
    """`v` when every shape's value is v, else each value with its shapes: `a (s1, s2) and b (s3)`."""
    shapes: dict[str, list[str]] = defaultdict(list)
    for shape, value in rows:
        shapes[value].append(shape)
    if len(shapes) == 1:
        return next(iter(shapes))
    return " and ".join(f"{v} ({', '.join(s)})" for v, s in sorted(shapes.items()))


def _provenance(rows: list[tuple[str, Run]]) -> str:
    """When and with what the rows shown were measured: one value where they agree, per shape where
    they differ (each row is its own best run, which may come from another flow or host)."""
    def day(run: Run) -> str:
        return datetime.fromtimestamp(run.info.start_time / 1000, timezone.utc).strftime("%Y-%m-%d")

    env = ", ".join(f"{name} {_by_value([(s, r.data.tags.get(f'{T}{key}') or '?') for s, r in rows])}"
                    for key, name in ENV)
    return f"measured {_by_value([(s, day(r)) for s, r in rows])}; {env}"


def report(tracker: Tracker, op: str, gpu_only: bool = True) -> str:
    runs = search(tracker, op, status="pass")
    if gpu_only:
        runs = [r for r in runs if r.data.tags.get(f"{T}gpu_timing") == "true"]
    by_target: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for r in runs:
        by_target[(r.data.tags.get(f"{T}target", ""), r.data.tags.get(f"{T}device", ""))].append(r)
    out = []
    for (target, device), group in sorted(by_target.items()):
        # A reference_fallback candidate calls torch's own op: its "speed-up" is torch against torch.
        ranked = [r for r in group if "reference_fallback" not in flags(r)]
        left_out = len(group) - len(ranked)
        rows = sorted(_shape_rows(ranked).items(), key=lambda kv: _shape_order(kv[0]))
        out.append(f"### {op} — {target} — {device}\n")
        note = (f" ({left_out} flagged `reference_fallback` left out: {'it calls' if left_out == 1 else 'they call'} "
                f"PyTorch's own {op}, so {'its' if left_out == 1 else 'their'} speed is torch's)") if left_out else ""
        where = f"; {_provenance([(shape, run) for shape, (run, _) in rows])}." if rows else "; none to show."
        out.append(f"{len(group)} passed candidates{note}{where}\n")
        out.append(cost_line(tracker, op, target, group, max((r.data.metrics.get("score", 0.0) for r in ranked),
                                                             default=None)) + "\n")
        if not rows:
            continue
        out.append("| shape | best candidate | candidate µs (% roofline) | eager µs (%) | torch.compile µs (%) "
                   "| vs compile | spread |")
        out.append("| --- | --- | --- | --- | --- | --- | --- |")
        warm = False
        for shape, (run, m) in rows:
            point = json.loads(run.data.tags.get(f"{T}candidate", "{}")).get("point", {})
            label = ",".join(f"{k}={v}" for k, v in sorted(point.items())) or run.info.run_name
            vs = m.get("speedup_vs_compile")
            cover = m.get("l2_cover", 0.0)
            if 0 < cover < 2:
                warm = True
                shape = f"{shape} † ({cover:.1f}x L2)"
            out.append(f"| {shape} | `{label}` | {_cell(m['latency_us'], m.get('pct_roofline'))} "
                       f"| {_cell(m.get('eager_us'), m.get('eager_pct_roofline'))} "
                       f"| {_cell(m.get('compile_us'), m.get('compile_pct_roofline'))} "
                       f"| {_versus(vs, m.get('spread', 0.0))} | {100 * m.get('spread', 0):.1f}% |")
        if warm:
            out.append("\n† the rotated input sets total less than twice the GPU's L2 (the set count is "
                       "capped), so repeats may be served from the L2: for candidate and baselines alike.")
        out += _held_out_rows(ranked)
        out.append("")
    return "\n".join(out) if out else f"no passed GPU-timed candidates for {op}\n"


def _held_out_rows(runs: list[Run], limit: int = 5) -> list[str]:
    """The candidates timed on held-out shapes (sizes no proposer saw, drawn afresh each
    optimization), best searched score first: a speed-up that holds only on the shown shapes shows."""
    timed = sorted((r for r in runs if r.data.tags.get(f"{T}held_out")), key=lambda r: -r.data.metrics.get("score", 0))
    if not timed:
        return []
    out = ["", "Held-out shapes (never shown to a proposer): speed-up over the best baseline, geometric mean.", "",
           "| candidate | searched | held-out |", "| --- | --- | --- |"]
    for run in timed[:limit]:
        m, status = run.data.metrics, run.data.tags[f"{T}held_out"]
        held = (f"{m['held_out_score']:.2f}x" if status == "pass" and "held_out_score" in m
                else f"{status} at {run.data.tags.get(f'{T}held_out_gate') or '?'}")
        out.append(f"| `{run.info.run_name}` | {m.get('score', 0):.2f}x | {held} |")
    return out


def cost_line(tracker: Tracker, op: str, target: str, runs: list[Run], best: float | None) -> str:
    """What finding the target's candidates cost on the GPU class of `runs`, and per percent gained."""
    classes = {r.data.tags.get(f"{T}gpu_class", "") for r in runs}
    gpu_class = classes.pop() if len(classes) == 1 else None
    cost, n = spent(tracker, op, target, gpu_class)
    return (f"Cost on {gpu_class or 'every GPU class'}: {n} candidate{'s' if n != 1 else ''}, {cost.text()}; "
            f"{per_gain_text(cost, best)}.")


def _shape_order(label: str):
    nums = [int(x) for x in re.findall(r"\d+", label)]
    return (label.split("_")[0], nums)
