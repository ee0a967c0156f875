"""One candidate through compile -> check -> microbench, logged as one tracking child run."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from contract.job import STAGES, Candidate, Job
from contract.verdict import PASS, Verdict
from engine_templates.ops import get_op
from gpu_pool.dispatch import MAX_ATTEMPTS, run_leased
from gpu_pool.health import HostFault
from gpu_pool.local import StageRun
from gpu_pool.pool import Slot
from targets import Target
from tasks.check import check_stage
from tasks.compile import compile_stage
from tasks.microbench import microbench_stage
from tracking.ledger import Charge
from tracking.schema import Tracker


@dataclass
class Outcome:
    candidate: Candidate
    verdict: Verdict
    charge: Charge
    run_id: str


def jobs_for(candidate: Candidate, target: Target, slot: Slot) -> dict[str, Job]:
    op = get_op(candidate.op)
    w = target.workload
    shapes = op.shapes(target.dims, w.decode_batches, w.prefill_tokens, w.contexts)
    odd = op.odd_shapes(target.dims)
    on_gpu = slot.gpu is not None
    rules = target.rules(on_gpu)
    return {s: Job(s, candidate, target.model, shapes, odd, rules, "cuda" if on_gpu else "cpu") for s in STAGES}


def run_stages(candidate: Candidate, target: Target, slot: Slot, run_stage: Callable[..., StageRun],
               charge: Charge) -> Verdict:
    """Stages in order, stopping at the first that does not pass; one merged verdict."""
    verdict: Verdict | None = None
    for stage, job in jobs_for(candidate, target, slot).items():
        run = run_stage(stage, job, slot, target.budget.stage_timeout_s)
        charge.add_stage(stage, run.held_s, slot.usd_per_second)
        if verdict is None:
            verdict = run.verdict
        else:
            verdict.merge(run.verdict)
        if verdict.status != PASS:
            break
    return verdict


STAGE_TASKS = {"compile": compile_stage, "check": check_stage, "bench": microbench_stage}


def _stage_task(stage: str, job: Job, slot: Slot, timeout_s: float) -> StageRun:
    return STAGE_TASKS[stage](job, slot, timeout_s)


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(candidate: Candidate, run_id: str, target: Target, slots: list[Slot], tracker: Tracker,
             charge: Charge | None = None) -> Outcome:
    """One candidate, already opened as pending child run `run_id`, on a leased slot of `slots`;
    recorded whatever happens. A host fault retries it on another host (see gpu_pool.dispatch).
    `charge`: what proposing it already cost (an LLM's tokens), added to."""
    charge = charge or Charge()

    def attempt(slot: Slot) -> Verdict:
        charge.place(slot.host.name, slot.label, slot.host.gpu_class, slot.gpu)
        start = time.time()
        try:
            return run_stages(candidate, target, slot, _stage_task, charge)
        finally:  # while the lease is held: the audit trail that no two candidates shared the slot
            charge.held.append((slot.label, start, time.time()))

    try:
        verdict = run_leased(slots, attempt)
    except HostFault as e:
        verdict = Verdict(op=candidate.op, candidate_id=candidate.id)
        verdict.crash("host", f"no host could run it ({charge.attempts} of at most {MAX_ATTEMPTS} tried): {e}")
    except BaseException as e:  # cancelled or interrupted: record it, then let it propagate
        verdict = Verdict(op=candidate.op, candidate_id=candidate.id)
        verdict.crash("interrupted", f"evaluation stopped by {type(e).__name__}: {e}")
        tracker.finish_candidate(run_id, candidate, verdict, charge, _template_source(candidate))
        raise
    tracker.finish_candidate(run_id, candidate, verdict, charge, _template_source(candidate))
    return Outcome(candidate, verdict, charge, run_id)


def _template_source(candidate: Candidate) -> str | None:
    if candidate.kind != "template":
        return None
    return get_op(candidate.op).templates[candidate.template].source_path.read_text()


def one_line(o: Outcome) -> str:
    v = o.verdict
    if v.status == PASS:
        score = v.score()
        timing = "" if v.gpu_timing else " (CPU interpreter: timings say nothing about a GPU)"
        return f"pass  score {score:.3g}x vs best baseline{timing}"
    gate = v.failing_gate
    return f"{v.status}  [{gate.name}] {gate.detail}" if gate else v.status
