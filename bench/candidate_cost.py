"""Where a candidate's time goes: runs `infersmith optimize` (or `evaluate`) here, in this process,
and prints a markdown breakdown — per stage and its parts, and outside the stages — from what
the tracking store logged for each candidate (`stage_seconds/*`, `phase_s/*`, the slot's held
intervals).

    python3 bench/candidate_cost.py --op rmsnorm --model qwen3-8b --budget 24
    python3 bench/candidate_cost.py --op rmsnorm --model tiny --evaluate gauntlet/rmsnorm/honest_torch.py
    python3 bench/candidate_cost.py --op rmsnorm --report   # the latest optimization in the store, run nothing

--report reads a store a run left (a home.tgz unpacked into INFERSMITH_HOME) when the command was
cut short before it printed: its times then count from the flow's start, not the command's.

Run from the repository root, with the environment `bench/gpu_env.sh` sets on a GPU host. The
plateau stop is set to the budget, so that every candidate asked for runs. On a checkout from
before the stages had parts (`phase_s/*`), those rows are empty and the rest holds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

T0 = time.time()  # before any import of the project's: the command's own start counts

from cli.main import main as infersmith  # noqa: E402

STAGES = ("compile", "check", "bench")
PARTS = ("start", "prepare", "sandbox_start", "baselines", "candidate", "finish")
PART_WORDS = {"start": "process start, until the supervisor runs", "prepare": "screen, hash the harness, start the sandbox",
              "sandbox_start": "sandbox ready (its imports, the plan)", "baselines": "baselines, before the candidate loads",
              "candidate": "load the candidate, run and judge the stage", "finish": "end the sandbox, check the harness, verdict"}


def runs_since(started: float, op: str) -> tuple[object, list]:
    """The latest parent run of `op` started after `started`, and its candidates' runs."""
    from tracking.schema import Tracker
    from tracking.store import TrackingConfig

    tracker = Tracker(TrackingConfig.from_env())
    parents = [r for r in tracker.client.search_runs([tracker.experiment(op)], "tags.`infersmith.kind` != 'candidate'",
                                                     order_by=["attributes.start_time DESC"], max_results=1)
               if r.info.start_time / 1000 >= started]
    if not parents:
        raise SystemExit("candidate_cost: no run of this command in the tracking store")
    parent = parents[0]
    children = tracker.client.search_runs([tracker.experiment(op)],
                                          f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'", max_results=5000)
    return parent, children


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def breakdown(children: list, t0: float, t_end: float) -> str:
    held = sorted((s, e) for c in children for _, s, e in json.loads(c.data.tags.get("infersmith.held", "[]")))
    n = len(children)
    m = [c.data.metrics for c in children]
    lines = ["| part | median s a candidate |", "| --- | ---: |"]
    for stage in STAGES:
        held_s = [x[f"stage_seconds/{stage}"] for x in m if f"stage_seconds/{stage}" in x]
        lines.append(f"| **{stage} stage** (the slot held) | {fmt(median(held_s))} |")
        for part in PARTS:
            key = f"phase_s/{stage}/{part}"
            lines.append(f"| &nbsp;&nbsp;{PART_WORDS[part]} | {fmt(median([x[key] for x in m if key in x]))} |")
    in_lease = [sum(e - s for _, s, e in json.loads(c.data.tags.get("infersmith.held", "[]")))
                - sum(c.data.metrics.get(f"stage_seconds/{st}", 0.0) for st in STAGES) for c in children]
    gaps = [b[0] - a[1] for a, b in zip(held, held[1:])]
    lines += [f"| in the lease, outside the stages (Prefect's task runs) | {fmt(median(in_lease))} |",
              f"| between candidates: the slot idle (tracking, proposing, the lease passing on) | {fmt(median(gaps))} |"]
    span = held[-1][1] - held[0][0] if held else 0.0
    per = span / n if n else 0.0
    cached = sum(x.get("baselines_cached", 0.0) for x in m)
    summary = [
        "| | |", "| --- | ---: |",
        f"| candidates | {n} ({sum(c.data.tags.get('infersmith.status') == 'pass' for c in children)} passed) |",
        f"| command start to the first candidate's stages (imports, Prefect's API, MLflow, fork server) | "
        f"{held[0][0] - t0:.1f} s |" if held else "| command start | – |",
        f"| first candidate's start to last candidate's end | {span:.1f} s |",
        f"| **a candidate, in the steady state** (that span / candidates) | **{per:.2f} s** |",
        f"| median time the slot was held a candidate | {fmt(median([e - s for s, e in held]))} s |",
        f"| last candidate's end to the command's end | {t_end - (held[-1][1] if held else t0):.1f} s |",
        f"| whole command | {t_end - t0:.1f} s |",
        f"| candidates an hour of the slot | {3600 / per:.0f} |" if per else "| candidates an hour | – |",
        f"| 100 candidates, projected | {(held[0][0] - t0 if held else 0) + 100 * per:.0f} s |",
        f"| bench stages that reused the slot's baselines | {cached:.0f} of {sum('stage_seconds/bench' in x for x in m)} |",
    ]
    return "\n".join(summary) + "\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="candidate_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="rmsnorm")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--budget", type=int, default=24)
    p.add_argument("--proposer", default="tpe")
    p.add_argument("--evaluate", metavar="FILE", help="one `infersmith evaluate` of this candidate file instead")
    p.add_argument("--report", action="store_true", help="run nothing: the breakdown of the op's latest "
                   "optimization in the tracking store, times from the flow's start")
    p.add_argument("extra", nargs="*", help="more options for the command, after --")
    args = p.parse_args(argv)
    if args.report:
        parent, children = runs_since(0.0, args.op)
        held_ends = [e for c in children for _, _, e in json.loads(c.data.tags.get("infersmith.held", "[]"))]
        t_end = (parent.info.end_time or 0) / 1000 or max(held_ends, default=parent.info.start_time / 1000)
        print(f"\ntracking run {parent.info.run_id} ({parent.info.status}); times from the flow's start, "
              f"not the command's\n")
        print(breakdown(children, parent.info.start_time / 1000, t_end))
        return 0
    if args.evaluate:
        command = ["evaluate", "--op", args.op, "--model", args.model, "--candidate", args.evaluate, *args.extra]
    else:
        command = ["optimize", "--op", args.op, "--model", args.model, "--budget", str(args.budget),
                   "--plateau", str(args.budget), "--proposer", args.proposer, *args.extra]
    code = infersmith(command)
    t_end = time.time()
    parent, children = runs_since(T0, args.op)
    print(f"\n`infersmith {' '.join(command)}` (exit code {code}); tracking run {parent.info.run_id}\n")
    print(breakdown(children, T0, t_end))
    return 0


if __name__ == "__main__":
    sys.exit(main())
