"""The image stage for a vision target (SAM 3, docs/images.md) as serve-bench runs it: on a leased
slot of the pool, the reference's answers and baseline, then the SAM 3 engine judged against them
and loaded with AIPerf on every pattern; logged as a parent run and one child run of
`infersmith-engine`, as the text stage's is."""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from contract.images import IMAGE_METRICS, ImageAccuracyRules, ImagePattern, ImageServeJob
from contract.serve import Served
from contract.verdict import PASS, Verdict
from gpu_pool.dispatch import run_leased_group
from gpu_pool.executors import run_images
from gpu_pool.leases import ensure_limits
from gpu_pool.local import WORKER_ROOT
from gpu_pool.pool import Pool, Slot, local_pool
from targets import Target
from tasks.serve import held
from tracking.charts import log_engine_chart
from tracking.ledger import Charge
from tracking.schema import RunScope, T, Tracker
from tracking.store import TrackingConfig

OP = "engine"  # the same MLflow experiment as the text stage's runs: infersmith-engine

image_stage = task(name="serve-images", cache_policy=NO_CACHE)(run_images)


def image_serving(serving: dict) -> tuple[tuple[ImagePattern, ...], ImageAccuracyRules, float]:
    """The settings as the CLI hands them (`traffic`, `accuracy`, `margin`, plain JSON) as the stage takes them."""
    return (tuple(ImagePattern(**p) for p in serving["traffic"]), ImageAccuracyRules(**serving["accuracy"]),
            float(serving["margin"]))


def serve_key(target: Target, serving: dict) -> str:
    """What makes two image runs comparable: model, dtype, patterns, accuracy rules, margin."""
    body = json.dumps(serving, sort_keys=True)
    return f"{target.model_key}/{target.dtype}/serve-images-{hashlib.sha256(body.encode()).hexdigest()[:10]}"


def image_job(target: Target, serving: dict, model_dir: Path, slot: Slot) -> ImageServeJob:
    """The stage's job on a leased slot: its GPU (the one visible to both servers), or the CPU of a
    CPU-only host, with a template kernel in Triton's interpreter. On a pool host the model
    directory is a path there (never shipped), the host's python runs the servers, and they inherit
    the worker's PYTHONPATH (its bundle) and CUDA_VISIBLE_DEVICES (gpu_pool/ssh.py, worker_env)."""
    patterns, rules, margin = image_serving(serving)
    local = slot.host.is_local
    env = ({"PYTHONPATH": str(WORKER_ROOT), "CUDA_VISIBLE_DEVICES": "" if slot.gpu is None else str(slot.gpu)}
           if local else {})
    if slot.gpu is None:
        env["TRITON_INTERPRET"] = "1"
    return ImageServeJob(model_dir=Path(model_dir).resolve() if local else Path(model_dir), dtype=target.dtype,
                         device="cpu" if slot.gpu is None else "cuda", env=env, patterns=patterns, accuracy=rules,
                         margin=margin, start_timeout_s=600.0, pattern_timeout_s=target.budget.stage_timeout_s,
                         python=sys.executable if local else slot.host.python)


def side_by_side(metrics: dict[str, float], serving: dict) -> list[dict]:
    """One row per pattern and image metric: candidate, baseline, candidate's advantage (>1: better)."""
    return [{"pattern": p["name"], "metric": name, "better": "higher" if higher else "lower",
             "candidate": metrics.get(f"{p['name']}/{name}"), "baseline": metrics.get(f"{p['name']}/baseline_{name}"),
             "vs_baseline": metrics.get(f"{p['name']}/vs_baseline_{name}")}
            for p in serving["traffic"] for name, (_, _, higher) in IMAGE_METRICS.items()]


def one_line(verdict: Verdict, metrics: dict[str, float]) -> str:
    if verdict.status == PASS:
        return (f"pass  score {metrics.get('score', float('nan')):.3g}x vs the reference (worst metric "
                f"{metrics.get('worst_vs_baseline', float('nan')):.3g}x)")
    gate = verdict.failing_gate
    return f"{verdict.status}  [{gate.name}] {gate.detail}" if gate else verdict.status


class ImageBench:
    """serve-bench's image stage: one engine configuration (a kernels file, or every op eager),
    its parent and child runs, the slot it holds."""

    def __init__(self, model_dir: str, target: Target, serving: dict, kernels: str | None, pool: Pool | None):
        if target.modality != "vision":
            raise ValueError(f"{target.model} is a text model: the image stage serves a vision model")
        self.model_dir, self.target, self.serving = Path(model_dir), target, serving
        self.kernels = Path(kernels).resolve() if kernels else None
        pool = pool or local_pool()
        self.slots = pool.slots(target.gpu_class)
        if not self.slots:
            raise ValueError(f"the pool has no host of GPU class {target.gpu_class!r}")
        ensure_limits(pool)
        classes = {s.host.gpu_class for s in self.slots}
        self.scope = RunScope(OP, target.model, serve_key(target, serving),
                              classes.pop() if len(classes) == 1 else "mixed")
        self.tracker = Tracker(TrackingConfig.from_env())
        self.parent = self.tracker.start_parent("serve-bench", self.scope, f"serve-bench {self.model_dir.name}", params={
            "target": target.model_dump(mode="json"), "model_dir": str(self.model_dir), "modality": "vision",
            "serving": serving, "kernels": str(self.kernels or "")}, tags={f"{T}modality": "vision"})
        self.out = Path(tempfile.mkdtemp(prefix="infersmith-images-"))
        self.charge = Charge()

    def run(self) -> tuple[str, Served]:
        """The stage on a leased slot, recorded as a child run whatever happens."""
        text = self.kernels.read_text() if self.kernels else None
        cand_id = hashlib.sha256((text or "eager").encode()).hexdigest()[:12]
        run_id = self.tracker.open_image_candidate(self.parent, self.scope, cand_id, "sam3-engine", text)

        def attempt(group: list[Slot]) -> Served:
            job = image_job(self.target, self.serving, self.model_dir, group[0])
            return held(self.charge, "serve", group, lambda: image_stage(group, job, self.kernels, self.out))

        try:
            served = run_leased_group(self.slots, 1, attempt)
        except BaseException as e:  # cancelled, interrupted, the reference failed: recorded, then raised
            verdict = Verdict(op="engine", candidate_id=cand_id)
            verdict.crash("interrupted", f"evaluation stopped by {type(e).__name__}: {e}")
            self.tracker.finish_engine_candidate(run_id, verdict, {}, self.charge, self.out)
            raise
        self.tracker.finish_engine_candidate(run_id, served.verdict, served.metrics, self.charge, self.out)
        log_engine_chart(self.tracker, run_id, "sam3-engine: vs the reference, per traffic pattern",
                         self.serving["margin"])
        return run_id, served

    def finish(self, run_id: str, served: Served) -> dict:
        v, m = served.verdict, served.metrics
        passed = float(v.status == PASS)
        self.tracker.finish_parent(self.parent, {"candidates": 1, "passed": passed, **self.charge.metrics()},
                                   {"serving.json": self.serving, "verdict.json": json.loads(v.to_json())})
        shutil.rmtree(self.out, ignore_errors=True)
        return {"metrics": m, "verdict": v.status, "line": one_line(v, m), "run_id": run_id,
                "parent_run_id": self.parent, "gates": [g.__dict__ for g in v.gates],
                "table": side_by_side(m, self.serving)}

    def fail(self, e: BaseException) -> None:
        self.tracker.fail_parent(self.parent, f"{type(e).__name__}: {e}")
        shutil.rmtree(self.out, ignore_errors=True)
