"""The serve stage: one server (its replicas) on leased slots, judged for accuracy, loaded with
AIPerf and compared with the baseline on every metric; logged as one tracking child run."""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE

from contract.serve import EngineCandidate, PatternRun, Reference, Served, ServeJob, compare
from contract.verdict import PASS, Verdict
from gpu_pool.dispatch import run_leased_group
from gpu_pool.executors import run_serve, serve_sessions
from gpu_pool.local import WORKER_ROOT
from gpu_pool.pool import Slot
from targets import Target
from tracking.charts import log_engine_chart
from tracking.ledger import Charge
from tracking.schema import Tracker

R = TypeVar("R")

# The end-to-end stage: servers and AIPerf in subprocesses on the leased slots' host (harness/serve).
serve_stage = task(name="serve", cache_policy=NO_CACHE)(run_serve)


def job_for(target: Target, model_dir: Path, group: list[Slot]) -> ServeJob:
    """The stage's job on a leased group (leases.lease_group): each replica on its own GPU of the
    group, or all of them on the CPU of a CPU-only host. On a pool host the model directory is a
    path there (never shipped) and the host's python runs the servers; PYTHONPATH is then the
    serve worker's own (its bundle), which the servers and the balancer inherit."""
    slot = group[0]
    s = target.serving
    local = slot.host.is_local
    env = {"PYTHONPATH": str(WORKER_ROOT)} if local else {}
    if slot.gpu is None:
        env["TRITON_INTERPRET"] = "1"  # a template kernel in the engine runs in Triton's interpreter
    devices = ("",) * s.replicas if slot.gpu is None else tuple(str(g.gpu) for g in group)
    return ServeJob(model_dir=Path(model_dir).resolve() if local else Path(model_dir), dtype=target.dtype,
                    device="cpu" if slot.gpu is None else "cuda", env=env, devices=devices,
                    max_model_len=s.max_model_len, patterns=tuple(p.to_job() for p in s.traffic),
                    accuracy=target.accuracy_rules(), margin=s.margin, baseline=s.baseline,
                    start_timeout_s=s.start_timeout_s, pattern_timeout_s=target.budget.stage_timeout_s,
                    python=sys.executable if local else slot.host.python,
                    reference_model_dir=_reference_dir(s.reference_model_dir, local), ready_path=s.ready_path)


def _reference_dir(path: str | None, local: bool) -> Path | None:
    if path is None:
        return None
    return Path(path).resolve() if local else Path(path)


def held(charge: Charge, stage: str, group: list[Slot], work: Callable[[], R]) -> R:
    """work() charged as `stage` for every GPU of the group, held the whole time."""
    slot = group[0]
    charge.place(slot.host.name, ",".join(s.label for s in group), slot.host.gpu_class, slot.gpu)
    start, t0 = time.time(), time.monotonic()
    try:
        return work()
    finally:
        charge.add_stage(stage, len(group) * (time.monotonic() - t0), slot.usd_per_second)
        charge.held.extend((s.label, start, time.time()) for s in group)


class Baseline:
    """The baseline server's metrics, measured once: with the reference's answers when the
    reference is the baseline, else the first time a candidate needs them, on its slots (so on the
    same kind of host as the candidate, by the same mechanism). Its GPU time is the flow's, not
    the candidate's that happened to need it first."""

    def __init__(self, out: Path):
        self.out = out
        self.runs: dict[str, PatternRun] | None = None
        self.charge = Charge()
        self._lock = threading.Lock()

    def get(self, job: ServeJob, group: list[Slot]) -> dict[str, PatternRun]:
        with self._lock:
            if self.runs is None:
                self.runs = held(self.charge, "baseline", group,
                                 lambda: serve_sessions(group).baseline(job, self.out))
            return self.runs

    def metrics(self) -> dict[str, float]:
        return {f"{p}/{k}": v for p, run in (self.runs or {}).items() for k, v in run.metrics.items()}


@dataclass
class EngineOutcome:
    candidate: EngineCandidate
    verdict: Verdict
    metrics: dict[str, float]
    charge: Charge
    run_id: str

    @property
    def score(self) -> float | None:
        return self.metrics.get("score") if self.verdict.status == PASS else None


@task(name="evaluate-engine", cache_policy=NO_CACHE)
def evaluate_engine(cand: EngineCandidate, run_id: str, target: Target, model_dir: Path, slots: list[Slot],
                    tracker: Tracker, reference: Reference, baseline: Baseline, out: Path,
                    command: str | None = None) -> EngineOutcome:
    """The candidate (an engine configuration, or the server `command` starts: by default, an
    engine spec's configuration's own) on leased slots, a GPU per replica: accuracy, load, then
    the all-metrics gate against the baseline; recorded whatever happens."""
    charge = Charge()
    command = command or cand.command or None

    def attempt(group: list[Slot]) -> Served:
        job = job_for(target, model_dir, group)
        served = held(charge, "serve", group, lambda: serve_stage(group, job, cand, reference, out, command))
        if served.verdict.status == PASS:  # the baseline's time, measured now or before, is the flow's
            compare(served, baseline.get(job, group), target.serving.margin)
        return served

    try:
        served = run_leased_group(slots, target.serving.replicas, attempt)
    except BaseException as e:  # cancelled, interrupted, or the baseline failed: record it, then propagate
        verdict = Verdict(op="engine", candidate_id=cand.id)
        verdict.crash("interrupted", f"evaluation stopped by {type(e).__name__}: {e}")
        tracker.finish_engine_candidate(run_id, verdict, {}, charge, out)
        raise
    tracker.finish_engine_candidate(run_id, served.verdict, served.metrics, charge, out)
    log_engine_chart(tracker, run_id, f"{cand.label}: vs {target.serving.baseline}, per traffic pattern",
                     target.serving.margin)
    return EngineOutcome(cand, served.verdict, served.metrics, charge, run_id)


def one_line(o: EngineOutcome) -> str:
    v = o.verdict
    if v.status == PASS:
        return f"pass  score {o.metrics.get('score', float('nan')):.3g}x vs baseline (worst metric " \
               f"{o.metrics.get('worst_vs_baseline', float('nan')):.3g}x)"
    gate = v.failing_gate
    return f"{v.status}  [{gate.name}] {gate.detail}" if gate else v.status
