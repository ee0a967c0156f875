"""TPE warm-started from published knowledge against TPE cold, on a second model preset: how many
candidates the warm run needs to reach the cold run's best score, with the same budget on the
same GPU. Prints a markdown table (docs/BENCHMARKS.md's), one row per op and seed.

Each run has a tracking home of its own under --home, so no run sees another's history:
  <op>/source/   an optimization on --source; its draft entries are then published
  <op>/cold-S/   --target, TPE with seed S, without a warm start
  <op>/warm-S/   --target, TPE with seed S, started from the source's published entries (copied in)
A finished run leaves scores.json in its home and is not run again: a command cut short by a time
limit goes on where it stopped when called again (an unfinished run starts over); --fresh forgets.
An op written SOURCE_OP:OP (e.g. rmsnorm:layernorm) is optimized as SOURCE_OP on --source and as
OP on --target: a vision op warm-started from a text op's entries (tracking/knowledge/warm.py,
CARRY_OVER), e.g. --source qwen3-8b --target sam3 --ops rmsnorm:layernorm,linear:vision_linear.
Run from the repo root: python3 bench/warm_start.py [--ops rmsnorm,silu_mul] [--budget 16] ...
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

SCORE_MARGIN = 1.01  # a warm candidate within 1% of the cold best has reached it: timing noise


def optimize(home: Path, op: str, model: str, budget: int, seed: int, warm_start: bool) -> list[float | None]:
    """One optimization in its tracking home; each candidate's score (None: not passed) in the
    order the candidates started."""
    from flows.optimize_op import optimize_op
    from targets import Target
    from tracking.history import search
    from tracking.schema import T, Tracker
    from tracking.store import TrackingConfig

    os.environ["INFERSMITH_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # a store of its own: a shared one would share history
    result = optimize_op(op=op, target=Target(model=model, budget={"candidates": budget, "plateau": budget}),
                         proposer="tpe", seed=seed, warm_start=warm_start)
    runs = [r for r in search(Tracker(TrackingConfig.from_env()), op)
            if r.data.tags.get("mlflow.parentRunId") == result["parent_run_id"]]
    runs.sort(key=lambda r: r.info.start_time)
    return [r.data.metrics.get("score") if r.data.tags.get(f"{T}status") == "pass" else None for r in runs]


def run(home: Path, op: str, model: str, budget: int, seed: int, warm_from: Path | None = None,
        publish: bool = False) -> list[float | None]:
    """optimize() once per home: a finished run's scores are read back from its scores.json."""
    done = home / "scores.json"
    if done.is_file():
        return json.loads(done.read_text())
    shutil.rmtree(home, ignore_errors=True)
    if warm_from is not None:
        shutil.copytree(warm_from / "knowledge", home / "knowledge")
    scores = optimize(home, op, model, budget, seed, warm_start=warm_from is not None)
    if publish:
        from tracking.knowledge import KnowledgeBase

        kb = KnowledgeBase(home / "knowledge")
        for e in kb.entries("draft", op):
            kb.move(e.id, "published", by="bench", note="warm-start benchmark")
    done.write_text(json.dumps(scores))
    return scores


def reached(scores: list[float | None], best: float) -> int | None:
    """1-based index of the first score within SCORE_MARGIN of `best`."""
    return next((i for i, s in enumerate(scores, 1) if s is not None and s * SCORE_MARGIN >= best), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="rmsnorm,silu_mul", help="ops, or SOURCE_OP:OP pairs (rmsnorm:layernorm)")
    p.add_argument("--source", default="qwen3-8b", help="model preset whose published winners start the warm run")
    p.add_argument("--target", default="qwen3-1.7b", help="model preset both runs optimize")
    p.add_argument("--budget", type=int, default=16, help="candidates of every run")
    p.add_argument("--seeds", default="0", help="comma-separated proposer seeds: one cold and one warm run each")
    p.add_argument("--home", default="/tmp/infersmith-warm-start", help="the runs' tracking homes")
    p.add_argument("--fresh", action="store_true", help="forget the finished runs under --home first")
    args = p.parse_args()
    root = Path(args.home)
    if args.fresh:
        shutil.rmtree(root, ignore_errors=True)
    import torch

    from tracking.knowledge import KnowledgeBase

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (interpreter: says nothing of a GPU)"
    rows = []
    for pair in args.ops.split(","):
        source_op, _, op = pair.rpartition(":")
        source_op = source_op or op
        source = root / source_op / "source"
        run(source, source_op, args.source, args.budget, 0, publish=True)
        published = KnowledgeBase(source / "knowledge").entries("published", source_op)
        for seed in (int(s) for s in args.seeds.split(",")):
            cold = run(root / op / f"cold-{seed}", op, args.target, args.budget, seed)
            warm = run(root / op / f"warm-{seed}", op, args.target, args.budget, seed, warm_from=source)
            cold_best = max((s for s in cold if s is not None), default=None)
            warm_best = max((s for s in warm if s is not None), default=None)
            rows.append([pair, seed, len(published), _x(cold_best), reached(cold, cold_best) if cold_best else "-",
                         _x(warm_best), (reached(warm, cold_best) or f"not in {len(warm)}") if cold_best else "-"])
    head = ["op", "seed", "entries published", "cold best", "cold: candidates to its best", "warm best",
            "warm: candidates to the cold best"]
    print(f"\nTPE warm-started from {args.source}'s published entries vs cold, on {args.target}; budget "
          f"{args.budget} each; {gpu}; reached = within {100 * (SCORE_MARGIN - 1):.0f}% of the score\n")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def _x(score: float | None) -> str:
    return f"{score:.3g}x" if score is not None else "-"


if __name__ == "__main__":
    main()
