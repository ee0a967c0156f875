"""sweep: every op of a plan on every target of it, each an optimize-op subflow; the nightly job.

A plan is a YAML file (infra/sweep.yaml is the one `infersmith deploy` schedules by default),
validated into a SweepPlan at the edge: an unknown op or preset, or an op that a target's model
cannot take, is refused before anything runs — by the CLI in one line, by the Prefect UI's form.
"""
from __future__ import annotations

from pathlib import Path

import yaml
from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, model_validator

from engine_templates.ops import get_op
from flows.optimize_op import OpName, ProposerName, optimize_op
from gpu_pool.pool import Pool
from targets import Target
from tracking.cost import sweep_totals
from tracking.schema import Tracker
from tracking.store import TrackingConfig


class SweepPlan(BaseModel):
    """What a sweep optimizes: each op for each target, in that order."""

    model_config = ConfigDict(extra="forbid")
    ops: list[OpName] = Field(min_length=1, description="ops to optimize, each on every target")
    targets: list[Target] = Field(min_length=1, description="targets: model, dtype, shapes, GPU class, budget")
    proposer: ProposerName = "tpe"
    seed: int = 0
    max_gpu_hours: PositiveFloat | None = Field(
        None, description="the sweep's GPU-hours in all: each optimization may spend what is left (or its own "
                          "budget's max_gpu_hours, if less), and none starts once they are spent")

    @model_validator(mode="after")
    def _ops_fit_targets(self) -> SweepPlan:
        # fused_moe on a dense preset, say: refused now rather than one failed subflow at night
        for i, target in enumerate(self.targets):
            for op in self.ops:
                try:
                    target.op_shapes(get_op(op))
                except ValueError as e:
                    raise ValueError(f"targets[{i}] ({target.model}) cannot take {op}: {e}") from None
        return self


class SweepFileError(ValueError):
    """A sweep file that cannot be used; the message is one line naming the file and field."""


def load_plan(path: Path | str) -> SweepPlan:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SweepFileError(f"{path}: cannot read: {e.strerror}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise SweepFileError(f"{path}: not a YAML file: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise SweepFileError(f"{path}: expected a mapping with `ops:` and `targets:`")
    try:
        return SweepPlan.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc, msg = ".".join(str(x) for x in err["loc"]), err["msg"].removeprefix("Value error, ")
        raise SweepFileError(f"{path}: {loc}: {msg}" if loc else f"{path}: {msg}") from None


@flow(name="sweep", log_prints=True)
def sweep(plan: SweepPlan, pool: Pool | None = None) -> list[dict]:
    """Each op of the plan on each of its targets, one optimize-op subflow after another. A failed
    optimization does not stop the others; the sweep fails at the end, naming every one that did."""
    results, failed, skipped = [], [], 0
    for target in plan.targets:
        for op in plan.ops:
            name = f"{op} {target.model} {target.dtype}"
            capped = within(plan, target, sum(r.get("gpu_hours", 0.0) for r in results))
            if capped is None:
                skipped += 1
                continue
            state = optimize_op.with_options(flow_run_name=name)(
                op=op, target=capped, proposer=plan.proposer, seed=plan.seed, pool=pool, return_state=True)
            if state.is_completed():
                results.append({"op": op, "target": target.key(), **state.result()})
            else:
                failed.append(f"{name}: {state.message or state.name}")
    print(f"sweep: {len(results)} of {len(results) + len(failed)} optimizations completed"
          + (f"; {skipped} not started: the sweep's GPU-hour budget of {plan.max_gpu_hours:g} is spent"
             if skipped else ""))
    spend(results)
    if failed:
        raise RuntimeError(f"{len(failed)} optimizations failed: " + "; ".join(failed))
    return results


def within(plan: SweepPlan, target: Target, spent_hours: float) -> Target | None:
    """The target with the GPU-hours the sweep has left as its cap (its own, if less); None when
    the sweep's are spent."""
    if plan.max_gpu_hours is None:
        return target
    left = plan.max_gpu_hours - spent_hours
    if left <= 0:
        return None
    own = target.budget.max_gpu_hours
    budget = target.budget.model_copy(update={"max_gpu_hours": left if own is None else min(own, left)})
    return target.model_copy(update={"budget": budget})


def spend(results: list[dict]) -> None:
    """What the sweep cost: each optimization's GPU-hours, dollars and cost per gain, and their sum
    (tracking.cost.sweep_totals) as the last row of the `sweep-cost` table artifact."""
    totals = sweep_totals(Tracker(TrackingConfig.from_env()), [r["parent_run_id"] for r in results])
    keys = ("gpu_hours", "cost_usd", "proposer_tokens", "proposer_usd", "total_usd")
    rows = [{"optimization": f"{r['op']} {r['target']}", **{k: r.get(k, 0.0) for k in keys},
             "gain_pct": r.get("gain_pct"), "usd_per_pct_gain": r.get("usd_per_pct_gain")} for r in results]
    rows.append({"optimization": f"sweep: {len(results)} optimizations", **{k: totals[k] for k in keys},
                 "gain_pct": None, "usd_per_pct_gain": None})
    print(f"sweep spent {totals['gpu_hours']:.3g} GPU-h, ${totals['total_usd']:.2f}")
    create_table_artifact(rows, key="sweep-cost", description="what each optimization of the sweep cost, "
                          "and the sweep in all (its last row)")


if __name__ == "__main__":
    sweep(load_plan(Path(__file__).resolve().parent.parent / "infra" / "sweep.yaml"))
