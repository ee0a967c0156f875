"""What a gain cost. GPU time (at the pool's price per GPU-hour) and proposer tokens, added up
per candidate (tracking.ledger.Charge), per flow — with the end-to-end stage's reference and
baseline servers, whose GPUs were held too — per target and per sweep; and cost per gain: $ and
GPU-hours per percent of speed-up of the best candidate over the baseline.

Names, on a candidate run and (summed) on its flow's parent run: `gpu_seconds`, `gpu_hours`,
`cost_usd` (the GPU time's dollars), `proposer_tokens`, `proposer_usd`, `total_usd` (GPU and
proposer together). A parent adds `reference_*` and `baseline_*` (the same names, for those
servers' time), `gain_pct`, `usd_per_pct_gain` (of `total_usd`) and `gpu_hours_per_pct_gain`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from tracking.ledger import Charge
from tracking.schema import T, Tracker

OVERHEADS = ("reference", "baseline")  # what a flow holds GPUs for besides its candidates
RERUN_TAG = f"{T}reruns"  # a reproduction's or revalidation's child: the run it re-ran


@dataclass
class Cost:
    gpu_seconds: float = 0.0
    gpu_usd: float = 0.0
    proposer_tokens: float = 0.0
    proposer_usd: float = 0.0

    @classmethod
    def of(cls, charge: Charge) -> Cost:
        return cls(charge.gpu_seconds, charge.usd, float(charge.proposer_tokens), charge.proposer_usd)

    @classmethod
    def from_metrics(cls, m: dict[str, float], prefix: str = "") -> Cost:
        return cls(m.get(f"{prefix}gpu_seconds", 0.0), m.get(f"{prefix}cost_usd", 0.0),
                   m.get(f"{prefix}proposer_tokens", 0.0), m.get(f"{prefix}proposer_usd", 0.0))

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0

    @property
    def usd(self) -> float:
        return self.gpu_usd + self.proposer_usd

    def metrics(self, prefix: str = "") -> dict[str, float]:
        m = {"gpu_seconds": self.gpu_seconds, "gpu_hours": self.gpu_hours, "cost_usd": self.gpu_usd,
             "proposer_tokens": self.proposer_tokens, "proposer_usd": self.proposer_usd, "total_usd": self.usd}
        return {f"{prefix}{k}": v for k, v in m.items()}

    def text(self) -> str:
        proposer = (f" (proposer: {self.proposer_tokens:.0f} tokens, ${self.proposer_usd:.2f})"
                    if self.proposer_tokens or self.proposer_usd else "")
        return f"{self.gpu_hours:.3g} GPU-h, ${self.usd:.2f}{proposer}"


def run_cost(m: dict[str, float]) -> Cost:
    """A candidate run's: its evaluation and, for one its optimization timed on the held-out
    shapes at its end, that timing (`held_out_gpu_seconds`, `held_out_cost_usd`)."""
    return Cost.from_metrics(m) + Cost.from_metrics(m, "held_out_")


def gain_pct(best_score: float | None) -> float | None:
    """The best candidate's speed-up over the baseline in percent; None when it is no speed-up."""
    return None if best_score is None or best_score <= 1.0 else 100.0 * (best_score - 1.0)


def per_gain(cost: Cost, best_score: float | None) -> dict[str, float]:
    """$ and GPU-hours per percent of speed-up; nothing when nothing beat the baseline."""
    pct = gain_pct(best_score)
    if pct is None:
        return {}
    return {"gain_pct": pct, "usd_per_pct_gain": cost.usd / pct, "gpu_hours_per_pct_gain": cost.gpu_hours / pct}


def per_gain_text(cost: Cost, best_score: float | None) -> str:
    g = per_gain(cost, best_score)
    if not g:
        return "no gain over the baseline" + (f" (best {best_score:.3g}x)" if best_score is not None else "")
    return (f"best +{g['gain_pct']:.3g}% over the baseline: ${g['usd_per_pct_gain']:.3g} and "
            f"{g['gpu_hours_per_pct_gain']:.3g} GPU-h per 1%")


class FlowCost:
    """One flow's spend: its candidates' charges and its overheads' (the reference, the baseline)."""

    def __init__(self) -> None:
        self.candidates = Cost()
        self.overheads = {name: Cost() for name in OVERHEADS}

    def add(self, charge: Charge, overhead: str | None = None) -> None:
        if overhead is None:
            self.candidates = self.candidates + Cost.of(charge)
        else:
            self.overheads[overhead] = self.overheads[overhead] + Cost.of(charge)

    @property
    def total(self) -> Cost:
        total = self.candidates
        for c in self.overheads.values():
            total = total + c
        return total

    def metrics(self, best_score: float | None) -> dict[str, float]:
        m = self.total.metrics()
        for name, c in self.overheads.items():
            if c.gpu_seconds or c.usd:
                m |= c.metrics(f"{name}_")
        return m | per_gain(self.total, best_score)


def spent(tracker: Tracker, op: str, target: str, gpu_class: str | None = None) -> tuple[Cost, int]:
    """What finding the target's candidates cost on this GPU class (any when None): every
    candidate run (any verdict; re-runs by reproduce and revalidate left out) and the overheads
    their flows logged. Returns the cost and the number of candidates."""
    from tracking.history import search

    where = {"target": target} | ({"gpu_class": gpu_class} if gpu_class else {})
    children = [r for r in search(tracker, op, **where) if RERUN_TAG not in r.data.tags]
    cost = Cost()
    for run in children:
        cost = cost + run_cost(run.data.metrics)
    def quoted(v: str) -> str:
        return "'" + v.replace("'", "\\'") + "'"

    flt = f"tags.`{T}target` = {quoted(target)} AND tags.`{T}kind` != 'candidate'"
    if gpu_class:
        flt += f" AND tags.`{T}gpu_class` = {quoted(gpu_class)}"
    for parent in tracker.client.search_runs([tracker.experiment(op)], flt, max_results=5000):
        if RERUN_TAG in parent.data.tags:
            continue
        for name in OVERHEADS:
            cost = cost + Cost.from_metrics(parent.data.metrics, f"{name}_")
    return cost, len(children)


def sweep_totals(tracker: Tracker, parent_run_ids: list[str]) -> dict[str, float]:
    """A sweep's spend: the sum of its optimizations' parent runs (each with its overheads)."""
    total = Cost()
    for run_id in parent_run_ids:
        total = total + Cost.from_metrics(tracker.client.get_run(run_id).data.metrics)
    return total.metrics() | {"optimizations": float(len(parent_run_ids))}
