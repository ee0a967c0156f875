"""optimize_engine: propose engine configurations -> serve each end to end (accuracy, AIPerf on
every traffic pattern, every metric against the baseline) until the budget; serve_bench: the
stage once, for one configuration or one server command."""
from __future__ import annotations

from pathlib import Path

from prefect import flow

from contract.serve import METRICS, EngineCandidate
from contract.verdict import PASS
from flows.optimize_op import ProposerName
from flows.search import run_search
from flows.search.engine import Session
from gpu_pool.pool import Pool
from proposers.engine import EngineProposer
from proposers.engine_spec import SpecProposer
from targets import Target
from targets.engine_spec import load_spec, spec_path
from tasks.serve import EngineOutcome, one_line
from tasks.serve_images import ImageBench
from tracking.history import kernel_choices


@flow(name="optimize-engine", log_prints=True)
def optimize_engine(model_dir: str, target: Target = Target(), seed: int = 0, kernels_per_op: int = 2,
                    include: list[dict] | None = None, pool: Pool | None = None,
                    proposer: ProposerName = "tpe", engine_spec: str | None = None) -> dict:
    """Engine configurations for one model directory through the serve stage, as many at once as
    the pool has free groups of slots of the class, each a child run of `infersmith-engine`, until
    the budget's rules stop it (count, wall clock, plateau, GPU-hours, $). `include`:
    configurations (EngineCandidate fields) to try first; then the proposer's over the op
    leaderboards' kernels and the engine's knobs. With `engine_spec` (a shipped spec's name — vllm,
    sglang, infersmith — or a spec file's path): that server's knobs instead, against its defaults
    as the baseline (docs/end-to-end.md)."""
    spec = load_spec(engine_spec) if engine_spec else None
    if spec:
        if include:
            raise ValueError("include names kernels files of this project's engine; an engine spec search has none")
        target = target.model_copy(update={"serving": spec.serving(target.serving)})
    s = Session("engine-optimization", f"optimize {spec.engine if spec else 'engine'} {Path(model_dir).name}",
                Path(model_dir), target, pool, {"proposer": proposer, "seed": seed, "kernels_per_op": kernels_per_op,
                                                "include": include or [], "engine_spec": engine_spec or ""})
    try:
        s.start()
        if spec:
            s.tracker.client.log_text(s.parent, spec_path(engine_spec).read_text(), "engine_spec.yaml")
            search = SpecProposer(spec, proposer, seed)
        else:
            options = kernel_choices(s.tracker, target.model, target.activation_dtype,
                                     None if s.scope.gpu_class == "mixed" else s.scope.gpu_class, kernels_per_op,
                                     s.out / "kernels")
            search = EngineProposer(proposer, options, any(slot.gpu is not None for slot in s.slots), seed)
        print(f"optimizing the engine on {model_dir} for {s.scope.target_key} against {target.serving.baseline} "
              f"with {proposer} on {', '.join(slot.label for slot in s.slots)}; tracking run {s.parent}")
        stopped = run_search(s.search(search, [EngineCandidate.from_dict({"origin": "include", **d})
                                               for d in include or []]))
    except BaseException as e:
        s.fail(e)
        raise
    p = s.progress
    metrics = s.finish({"candidates": p.done, "passed": p.passed,
                        "stopped_early": float(p.done < target.budget.candidates)}, stopped.reason)
    archive = metrics.pop("results", None)
    if archive:
        print(f"results archive: {archive}")
    return {"parent_run_id": s.parent, "stop_reason": stopped.reason, "results": archive, **metrics}


@flow(name="serve-bench", log_prints=True)
def serve_bench(model_dir: str, target: Target = Target(), kernels: dict | None = None,
                candidate_command: str | None = None, pool: Pool | None = None,
                engine: dict | None = None) -> dict:
    """The serve stage once: the engine with `kernels` and the settings `engine` names
    (EngineCandidate fields, e.g. spec_tokens) — or the server `candidate_command` starts — against
    the baseline. Returns the verdict, the metrics and a side-by-side table."""
    cand = EngineCandidate(kernels=kernels or {}, origin="serve-bench", **(engine or {}))
    s = Session("serve-bench", f"serve-bench {Path(model_dir).name}", Path(model_dir), target, pool,
                {"kernels": kernels or {}, "candidate_command": candidate_command or "", "engine": engine or {}})
    try:
        s.start()
        outcome = s.evaluate(cand, candidate_command)
    except BaseException as e:
        s.fail(e)
        raise
    metrics = s.finish({"candidates": 1, "passed": float(outcome.verdict.status == PASS)}, "one configuration served")
    return {"metrics": metrics, "verdict": outcome.verdict.status, "line": one_line(outcome), "run_id": outcome.run_id,
            "parent_run_id": s.parent, "gates": [g.__dict__ for g in outcome.verdict.gates],
            "table": side_by_side(outcome, target)}


@flow(name="serve-bench-images", log_prints=True)
def serve_bench_images(model_dir: str, target: Target, serving: dict, kernels: str | None = None,
                       pool: Pool | None = None) -> dict:
    """The image stage once for a vision target (docs/images.md): the SAM 3 engine with `kernels`
    (a kernels file; none: every op eager) against the reference server, on every pattern of
    `serving` (traffic, accuracy, margin). Returns what serve_bench returns."""
    bench = ImageBench(model_dir, target, serving, kernels, pool)
    try:
        run_id, served = bench.run()
    except BaseException as e:
        bench.fail(e)
        raise
    return bench.finish(run_id, served)


def side_by_side(o: EngineOutcome, target: Target) -> list[dict]:
    """One row per pattern and metric: candidate, baseline, candidate's advantage (>1: better); and
    with speculative decoding the pattern's acceptance rate (the candidate's alone)."""
    rows = []
    for p in target.serving.traffic:
        for name, (_, _, higher) in METRICS.items():
            c, b = o.metrics.get(f"{p.name}/{name}"), o.metrics.get(f"{p.name}/baseline_{name}")
            rows.append({"pattern": p.name, "metric": name, "better": "higher" if higher else "lower",
                         "candidate": c, "baseline": b, "vs_baseline": o.metrics.get(f"{p.name}/vs_baseline_{name}")})
        if f"{p.name}/spec_drafted_tokens" in o.metrics:
            rows.append({"pattern": p.name, "metric": "spec_acceptance_rate", "better": "higher",
                         "candidate": o.metrics.get(f"{p.name}/spec_acceptance_rate"), "baseline": None,
                         "vs_baseline": None})
    return rows
