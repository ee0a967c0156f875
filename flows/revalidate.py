"""revalidate: today's winners — each op leaderboard's best per target and GPU class, and the
best engine configuration (the kernels the engine chose) — run again on the pool's current
torch, triton, CUDA and driver. A winner that no longer passes, or got slower than its spread
plus the slack allows (tracking.compare), fails the flow run, with a Prefect artifact naming
what regressed and the versions of then and now."""
from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import NonNegativeFloat

from engine_templates.ops import OPS
from flows.optimize_op import OpName
from flows.reproduce import RERUN_ERRORS, rerun
from gpu_pool.pool import Pool, local_pool
from targets import GPUClass, ModelName
from tracking.compare import regressions
from tracking.cost import Cost
from tracking.history import winners
from tracking.replay import logged, versions
from tracking.schema import T, Tracker
from tracking.store import TrackingConfig


class Regressed(Exception):
    """Some winner regressed or could not be re-run; `result` holds every row."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def _versions(v: dict[str, str]) -> str:
    return f"{v['device']}: torch {v['torch']}, triton {v['triton']}, CUDA {v['cuda']}, driver {v['driver']}"


@flow(name="revalidate", log_prints=True)
def revalidate(ops: list[OpName] | None = None, model: ModelName | None = None, gpu_class: GPUClass = "any",
               engine: bool = True, include_cpu_timed: bool = False, slack: NonNegativeFloat = 0.05,
               engine_slack: NonNegativeFloat = 0.10, pool: Pool | None = None,
               model_dir: str | None = None) -> dict:
    """Re-run the winners of `ops` (None: every op) and, with `engine`, the best engine
    configuration of each target, of `model` and `gpu_class` where given, on `pool` (default: this
    machine). Winners timed by the CPU interpreter only with `include_cpu_timed`. An op winner
    regresses past its spread + `slack`; an engine configuration past `engine_slack`.
    `model`: a preset's name or the config path runs were tagged with (targets.model_name).
    `model_dir`: the checkpoint engine configurations serve (default: the one each logged)."""
    tracker = Tracker(TrackingConfig.from_env())
    pool = pool or local_pool()
    classes = {h.gpu_class for h in pool.hosts}
    names = list(OPS if ops is None else ops) + (["engine"] if engine else [])
    found = [(op, run) for op in names for run in winners(tracker, op, model, None if gpu_class == "any" else gpu_class,
                                                        gpu_timing=not include_cpu_timed)]
    print(f"revalidating {len(found)} winners of {', '.join(names)} on {', '.join(sorted(classes))}")
    rows, regressed, cost = [], [], Cost()
    for op, won in found:
        tags = won.data.tags
        row = {"op": op, "target": tags.get(f"{T}target", ""), "gpu_class": tags.get(f"{T}gpu_class", ""),
               "candidate": won.info.run_name, "run": won.info.run_id, "then": _versions(versions(won))}
        if row["gpu_class"] not in classes:
            rows.append(row | {"result": f"skipped: the pool has no {row['gpu_class']} host"})
            continue
        problems, now = [], "-"
        with tempfile.TemporaryDirectory(prefix="infersmith-revalidate-") as scratch:
            try:
                old = logged(tracker, won.info.run_id, Path(scratch))
                done = rerun(tracker, old, pool, "revalidation", row["gpu_class"], model_dir)
            except RERUN_ERRORS as e:  # no verdict: the winner is not confirmed, which fails the run too
                problems = [f"could not be re-run: {(str(e).splitlines() or [type(e).__name__])[0]}"]
            else:
                new = done.new
                now = _versions(versions(new))
                cost = cost + Cost.from_metrics(done.metrics)
                problems = regressions(won.data.metrics, new.data.metrics, new.data.tags.get(f"{T}status", ""),
                                       old.is_engine, engine_slack if old.is_engine else slack)
                if done.detail:
                    problems = [f"{p}: {done.detail}" if p.startswith("its verdict") else p for p in problems]
                row["rerun"] = new.info.run_id
        row |= {"now": now, "result": "; ".join(problems) or "holds"}
        rows.append(row)
        print(f"{op} {row['target']} ({row['gpu_class']}) {row['candidate']}: {row['result']}")
        if problems:
            regressed.append(row)
    create_table_artifact(rows or [{"result": "no winner to revalidate"}], key="revalidation",
                          description="today's winners run again: what held and what regressed")
    result = {"winners": len(found), "rerun": sum("rerun" in r for r in rows), "regressed": len(regressed),
              "rows": rows, **cost.metrics()}
    if regressed:
        lines = [f"# {len(regressed)} of {len(found)} winners regressed", ""]
        for r in regressed:
            lines += [f"## {r['op']} — {r['target']} ({r['gpu_class']}): `{r['candidate']}`", "",
                      f"- run then: {r['run']}, on {r['then']}", f"- run now: {r.get('rerun', '-')}, on {r['now']}",
                      f"- what regressed: {r['result']}", ""]
        create_markdown_artifact("\n".join(lines), key="revalidation-regressions",
                                 description="winners that regressed, with the versions of then and now")
        raise Regressed(f"{len(regressed)} of {len(found)} winners regressed: "
                        + "; ".join(f"{r['op']} {r['candidate']}: {r['result']}" for r in regressed), result)
    return result


if __name__ == "__main__":
    print(revalidate())
