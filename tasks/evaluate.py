"""One candidate through compile -> check -> microbench, logged as one tracking child run."""
from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable, ContextManager, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from contract.job import STAGES, Candidate, Job, Rules, Shape
from contract.verdict import PASS, Verdict
from engine_templates.ops import get_op
from gpu_pool.baselines import Baselines
from gpu_pool.dispatch import MAX_ATTEMPTS, run_leased
from gpu_pool.executors import candidate_session
from gpu_pool.health import HostFault
from gpu_pool.local import LocalSession, StageRun
from gpu_pool.pool import Slot
from gpu_pool.ssh import SSHSession
from targets import Target
from targets.held_out import is_held_out
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
    # Passed, but counts only once a person approves it (Verdict.needs_approval): logged as
    # failing the `approval` gate until the flow records the decision (flows/approval.py).
    held: bool = False
    # What its bench stage timed on the run's held-out shapes (a passed candidate's, logged on its
    # run as `held_out_*`): kept apart from `verdict`, whose score is the target's shapes' alone.
    held_out: Verdict | None = None

    @property
    def score(self) -> float | None:
        return self.verdict.score()


def rules_on(target: Target, slot: Slot, logged: Rules | None = None) -> Rules:
    """The target's rules on this slot; `logged` (a re-run's) in their place, except whether
    torch.compile is timed, which is the slot's: a CPU has no compile baseline."""
    on_gpu = slot.gpu is not None
    return target.rules(on_gpu) if logged is None else replace(logged, compile_baseline=on_gpu)


def jobs_for(candidate: Candidate, target: Target, slot: Slot, held_out: Sequence[Shape] = (),
             rules: Rules | None = None) -> dict[str, Job]:
    """The three stages' jobs: the target's shapes timed; the op's awkward sizes and this run's
    held-out shapes (targets/held_out.py) checked too, and the held-out ones timed after the
    target's (their baselines measured with the others', once a flow: gpu_pool/baselines.py); by
    the target's rules or `rules`."""
    op = get_op(candidate.op, target.dtype)
    shapes = target.op_shapes(op)
    odd = op.odd_shapes(target.dims)
    rules = rules or rules_on(target, slot)
    device = "cpu" if slot.gpu is None else "cuda"
    jobs = {s: Job(s, candidate, target.model, shapes, [*odd, *held_out], rules, device) for s in STAGES}
    jobs["bench"] = replace(jobs["bench"], shapes=[*shapes, *held_out], odd_shapes=odd)
    return jobs


def split_held_out(verdict: Verdict) -> Verdict | None:
    """Take the held-out shapes' timings (and baselines) out of `verdict`, which then scores the
    target's shapes alone; a verdict of those timings, None when it has none."""
    held = [t for t in verdict.timings if is_held_out(t.label)]
    if not held:
        return None
    verdict.timings = [t for t in verdict.timings if not is_held_out(t.label)]
    out = copy.deepcopy(verdict)
    out.timings = held
    b = verdict.baselines
    if b.get("shapes"):  # the record names and sizes them too: the flow's store keeps it whole

        def shown(d: dict) -> dict:
            return {k: v for k, v in d.items() if not is_held_out(k)}

        verdict.baselines = {**b, "shapes": shown(b["shapes"])}
        if isinstance(b.get("key"), dict) and isinstance(b["key"].get("shapes"), dict):
            verdict.baselines["key"] = {**b["key"], "shapes": shown(b["key"]["shapes"])}
        if is_held_out(str((b.get("drift") or {}).get("shape", ""))):
            verdict.baselines.pop("drift")
    return out


def run_stages(candidate: Candidate, target: Target, slot: Slot, run_stage: Callable[..., StageRun],
               charge: Charge, jobs: dict[str, Job] | None = None, baselines: Baselines | None = None,
               session: Callable[..., ContextManager] | None = None) -> Verdict:
    """Stages in order (`jobs`, default jobs_for's), each under its kind's limit
    (Budget.stage_limit), stopping at the first that does not pass; one merged verdict.
    `baselines`: the flow's, which the bench job carries for its slot and its verdict adds to.
    `session(slot, jobs, limits)`: the candidate's session (gpu_pool.executors.candidate_session),
    handed to each `run_stage` call as its last argument: one supervisor and one sandbox for the
    stages."""
    verdict: Verdict | None = None
    jobs = dict(jobs or jobs_for(candidate, target, slot))
    if baselines is not None and "bench" in jobs:
        jobs["bench"] = replace(jobs["bench"], baselines=baselines.for_job(slot, jobs["bench"]),
                                ceilings=baselines.ceilings_for(slot, jobs["bench"]))
    limits = {stage: target.budget.stage_limit(stage) for stage in jobs}
    with session(slot, jobs, limits) if session else nullcontext() as open_session:
        for stage, job in jobs.items():
            run = (run_stage(stage, job, slot, limits[stage], open_session) if session
                   else run_stage(stage, job, slot, limits[stage]))
            if baselines is not None:
                baselines.keep(slot, job, run.verdict)
            charge.add_stage(stage, run.held_s, slot.usd_per_second)
            if verdict is None:
                verdict = run.verdict
            else:
                verdict.merge(run.verdict)
            if verdict.status != PASS:
                break
    return verdict


STAGE_TASKS = {"compile": compile_stage, "check": check_stage, "bench": microbench_stage}


def _stage_task(stage: str, job: Job, slot: Slot, timeout_s: float, session: LocalSession | SSHSession | None = None) -> StageRun:
    return STAGE_TASKS[stage](job, slot, timeout_s, session)


def _judged(candidate: Candidate, target: Target, slots: list[Slot], charge: Charge,
            jobs: Callable[[Slot], dict[str, Job]], baselines: Baselines | None = None) -> Verdict:
    """The stages of jobs(slot) on a leased slot of `slots`; a host fault retries them on another
    host (see gpu_pool.dispatch), and one that no host could run is a `host` crash."""
    def attempt(slot: Slot) -> Verdict:
        charge.place(slot.host.name, slot.label, slot.host.gpu_class, slot.gpu)
        start = time.time()
        try:
            return run_stages(candidate, target, slot, _stage_task, charge, jobs(slot), baselines, candidate_session)
        finally:  # while the lease is held: the audit trail that no two candidates shared the slot
            charge.held.append((slot.label, start, time.time()))

    try:
        return run_leased(slots, attempt)
    except HostFault as e:
        verdict = Verdict(op=candidate.op, candidate_id=candidate.id)
        verdict.crash("host", f"no host could run it ({charge.attempts} of at most {MAX_ATTEMPTS} tried): {e}")
        return verdict


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(candidate: Candidate, run_id: str, target: Target, slots: list[Slot], tracker: Tracker,
             held_out: list[Shape] | None = None, charge: Charge | None = None,
             logged_rules: Rules | None = None, baselines: Baselines | None = None) -> Outcome:
    """One candidate, already opened as pending child run `run_id`, on a leased slot of `slots`,
    checked on the held-out shapes too; recorded whatever happens, with the rules it was judged by.
    `charge`: what proposing it already cost (an LLM's tokens), added to. `logged_rules`: a
    re-run's, in place of the target's. `baselines`: the flow's store (gpu_pool/baselines.py), so
    that each slot's are measured once a flow."""
    charge = charge or Charge()
    used: list[Rules] = []

    def jobs(slot: Slot) -> dict[str, Job]:
        used.append(rules_on(target, slot, logged_rules))
        return jobs_for(candidate, target, slot, held_out or (), used[-1])

    try:
        verdict = _judged(candidate, target, slots, charge, jobs, baselines)
        timed_held_out = split_held_out(verdict)
    except BaseException as e:  # cancelled or interrupted: record it, then let it propagate
        verdict = Verdict(op=candidate.op, candidate_id=candidate.id)
        verdict.crash("interrupted", f"evaluation stopped by {type(e).__name__}: {e}")
        tracker.finish_candidate(run_id, candidate, verdict, charge, _template_source(candidate, target.dtype),
                                 rules=used[-1] if used else None)
        raise
    held = verdict.needs_approval
    rules = used[-1] if used else None
    if timed_held_out is None or verdict.status != PASS:
        timed_held_out = None
    if not held:
        tracker.finish_candidate(run_id, candidate, verdict, charge, _template_source(candidate, target.dtype), rules=rules)
    else:
        waiting = copy.deepcopy(verdict)
        waiting.gate("approval", False, f"waiting for a person's approval ({', '.join(held)})")
        tracker.finish_candidate(run_id, candidate, waiting, charge, _template_source(candidate, target.dtype),
                                 {"approval": "waiting"}, rules=rules)
    if timed_held_out is not None:  # its GPU time is the bench stage's, on the candidate's own charge
        tracker.finish_held_out(run_id, timed_held_out, Charge())
    return Outcome(candidate, verdict, charge, run_id, held=bool(held), held_out=timed_held_out)


def _template_source(candidate: Candidate, dtype: str) -> str | None:
    if candidate.kind != "template":
        return None
    return get_op(candidate.op, dtype).templates[candidate.template].source_path.read_text()


def one_line(o: Outcome) -> str:
    v = o.verdict
    if o.held:
        return f"waits for approval ({', '.join(v.needs_approval)}); score {v.score() or 0:.3g}x if approved"
    if v.status == PASS:
        score = v.score()
        timing = "" if v.gpu_timing else " (CPU interpreter: timings say nothing about a GPU)"
        return f"pass  score {score:.3g}x vs best baseline{timing}"
    gate = v.failing_gate
    return f"{v.status}  [{gate.name}] {gate.detail}" if gate else v.status
