"""optimize_op: propose -> compile -> check -> microbench, until the budget or a plateau."""
from __future__ import annotations

import hashlib
import json
from typing import Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run

from contract.job import Candidate, Shape
from contract.verdict import Verdict
from engine_templates.ops import OPS, get_op
from flows import approval
from flows.progress import Progress
from gpu_pool.baselines import Baselines
from gpu_pool.executors import prewarm
from gpu_pool.health import HEALTH
from gpu_pool.leases import ensure_limits, free_slots
from gpu_pool.pool import Pool, Slot, local_pool
from proposers.base import KNOWLEDGE, point_key
from proposers.llm import LLMProposer, LLMSettings, Proposal
from targets import Target
from tasks.evaluate import Outcome, evaluate, one_line
from tasks.propose import propose, propose_code
from tracking.artifacts import Results
from tracking.charts import log_optimization_charts
from tracking.cost import per_gain_text
from tracking.history import board, ceilings, trials
from tracking.knowledge import KnowledgeBase, published_for, warm_points
from tracking.knowledge.derive import write_drafts
from tracking.ledger import Charge
from tracking.schema import RunScope, Tracker
from tracking.store import TrackingConfig

ProposerName = Literal["random", "tpe", "llm"]
# The op parameter's type: the Prefect UI offers the ops as choices and refuses any other name.
OpName = Literal[tuple(OPS)]


def scope_for(op: str, target: Target, pool: Pool) -> RunScope:
    classes = {s.host.gpu_class for s in pool.slots(target.gpu_class)}
    if not classes:
        raise ValueError(f"the pool has no host of GPU class {target.gpu_class!r}")
    return RunScope(op, target.model, target.key(), classes.pop() if len(classes) == 1 else "mixed")


def flow_seed(seed: int) -> int:
    """The proposer's seed: the user's, folded with this flow run's id, so two flows started
    with the same seed at the same moment do not propose the same batch."""
    return int(hashlib.sha256(f"{seed}/{flow_run.id}".encode()).hexdigest()[:8], 16)


def room(slots: list[Slot], in_flight: int) -> int:
    """How many more candidates can start now: one per healthy slot, and one more that waits for
    the first slot to come free, so that proposing it, opening its run and starting its task
    happen while the others' stages run, and the previous candidate's tracking writes while its
    own run (the lease passes straight on). Never more than the free slots and that one."""
    usable = HEALTH.usable(slots)
    n = min(len(usable) + 1 - in_flight, len(free_slots(usable)) + 1) if usable else 0
    return max(n, 0 if in_flight else 1)


def claim_orphan(tracker: Tracker, parent: str, scope: RunScope, old_run: str, candidate: Candidate) -> str:
    """Re-queue a candidate a stopped flow left pending: a new pending child here, the old one retired."""
    run_id = tracker.open_candidate(parent, scope, candidate, requeued_from=old_run)
    tracker.retire_orphan(old_run, run_id)
    return run_id


def take_reply(p: Proposal, tracker: Tracker, parent: str, scope: RunScope, settings: LLMSettings) -> tuple[str, Charge]:
    """A reply becomes a pending child run at once, with its tokens, dollars and transcript."""
    u = p.usage
    charge = Charge(input_tokens=u.input_tokens, cached_input_tokens=u.cached_input_tokens,
                    output_tokens=u.output_tokens, proposer_usd=p.usd)
    run_id = tracker.open_candidate(parent, scope, p.candidate)
    tracker.log_proposal(run_id, charge, p.prompt, p.reply, {
        "provider": settings.provider, "model": settings.model, "base_url": settings.base_url,
        "stop_reason": p.stop_reason, "malformed": p.malformed, "price_per_million": (
            settings.price.model_dump() if settings.price else None), **charge.token_metrics()})
    return run_id, charge


def malformed(p: Proposal, run_id: str, charge: Charge, tracker: Tracker) -> Outcome:
    """A reply with no module to judge: its verdict is written here, no GPU held."""
    verdict = Verdict(op=p.candidate.op, candidate_id=p.candidate.id)
    verdict.malformed(p.malformed)
    tracker.finish_candidate(run_id, p.candidate, verdict, charge)
    return Outcome(p.candidate, verdict, charge, run_id)


def time_on_held_out(passed: list[Outcome], target: Target, held_out: list[Shape]) -> None:
    """The best `target.held_out.timed` passed candidates of this run, each printed with what its
    bench stage timed on the held-out shapes (tasks/evaluate.py) beside its searched score."""
    best = sorted(passed, key=lambda o: -o.verdict.score())[:target.held_out.timed] if held_out else []
    for o in best:
        got = f"{o.held_out.score():.3g}x" if o.held_out and o.held_out.score() else "not timed"
        print(f"held-out shapes ({', '.join(s.label for s in held_out)}): {o.candidate.label}: "
              f"searched {o.verdict.score():.3g}x, held-out {got}")


@flow(name="optimize-op", log_prints=True)
def optimize_op(op: OpName = "rmsnorm", target: Target = Target(), proposer: ProposerName = "tpe",
                template: str | None = None, seed: int = 0, pool: Pool | None = None,
                llm: LLMSettings | None = None, warm_start: bool = True) -> dict:
    """Optimize one op for one target: every candidate, passing or not, becomes an MLflow run.
    As many candidates run at once as the pool has free GPUs of the target's class; with the
    `llm` proposer, as many replies are awaited at once as the pool has free slots. With
    `warm_start`, a template search starts from the winners of other targets' published knowledge
    entries; at the end, what the runs taught is written as draft entries for a person."""
    spec = get_op(op, target.dtype)
    template = template or next(iter(spec.templates))
    if template not in spec.templates:
        raise ValueError(f"{op} has no template {template!r}; known: {', '.join(spec.templates)}")
    llm = (llm or LLMSettings()) if proposer == "llm" else None
    # The LLM writes free candidates; it reads every trial of the scope, templates' too.
    kind, read = ("free", None) if llm else (template, template)
    pool = pool or local_pool()
    slots = pool.slots(target.gpu_class)
    prewarm(slots)
    scope = scope_for(op, target, pool)
    ensure_limits(pool)
    tracker = Tracker(TrackingConfig.from_env())
    results = Results(f"infersmith-{op}")  # S3, when configured, is checked before anything runs
    baselines = Baselines()  # each slot's, measured once this flow (gpu_pool/baselines.py)
    proposer_seed = flow_seed(seed)
    params = {"target": target.model_dump(mode="json"), "proposer": proposer, "template": kind,
              "seed": seed, "proposer_seed": proposer_seed, "pool": [s.label for s in slots], "warm_start": warm_start}
    if llm:  # the key's variable is named, the key never
        params["llm"] = llm.model_dump(mode="json", exclude={"prices"}) | {"price": llm.price and llm.price.model_dump()}
    parent = tracker.start_parent("optimization", scope, f"optimize {op} {target.model}", params=params,
                                  tags={"infersmith.proposer": llm.origin if llm else proposer,
                                        "infersmith.template": kind})
    print(f"optimizing {op} for {target.key()} with {llm.origin if llm else proposer}"
          + ("" if llm else f" over template {template!r}") + f" on {', '.join(s.label for s in slots)}; "
          f"tracking run {parent}")
    kb = KnowledgeBase.from_env()
    warm = warm_points(op, template, scope, kb) if warm_start and not llm else []
    entries_of = {point_key(p): ",".join(ids) for p, ids in warm}
    if warm:
        print(f"warm start: {len(warm)} points from published knowledge ({', '.join(entries_of.values())})")
    progress = Progress(target)
    held_out = target.held_out_shapes(spec)
    passed: list[Outcome] = []
    verdicts: dict[str, dict] = {}  # the results archive's, by run id
    coder = LLMProposer(op, target, llm, [e.body for e in published_for(op, scope.gpu_class, kb)]) if llm else None
    orphans = tracker.orphaned_pending(scope, kind)
    if orphans:
        print(f"re-queueing {len(orphans)} candidates a stopped flow left pending")
    in_flight: dict[PrefectFuture, Candidate] = {}
    replies: set[PrefectFuture] = set()  # the LLM's replies awaited
    waiting: list[Outcome] = []  # passed, held for a person: asked once nothing is in flight
    exhausted = down = None

    def report(o: Outcome) -> None:
        progress.record(o)
        verdicts[o.run_id] = json.loads(o.verdict.to_json())
        if o.verdict.score() is not None:
            passed.append(o)
        print(f"[{progress.done}/{target.budget.candidates}] {o.candidate.label}"
              + (f" on {o.charge.gpu}" if o.charge.gpu else "") + f": {one_line(o)}")

    try:
        while True:
            if waiting and not in_flight and not replies:
                for o in waiting:
                    report(approval.decide(o, target, tracker))
                waiting = []
            busy = len(in_flight) + len(replies)
            n = min(room(slots, busy), target.budget.candidates - progress.done - busy)
            if down is None and not waiting and progress.may_launch(busy, len(replies)) and n > 0:
                batch = [(c, claim_orphan(tracker, parent, scope, old, c), None) for old, c in orphans[:n]]
                orphans = orphans[n:]
                if len(batch) < n:  # open the pending runs first: the next proposal, here or in
                    # another flow, sees them in its history and proposes something else
                    history = trials(tracker, scope, read)
                    if coder:
                        ceil = ceilings(tracker, scope.gpu_class, target.dtype)
                        replies |= {propose_code.submit(coder, history, ceil) for _ in range(n - len(batch))}
                    else:
                        fresh = propose(proposer, op, template, proposer_seed, history, n - len(batch),
                                        [p for p, _ in warm], target.dtype)
                        batch += [(c, tracker.open_candidate(parent, scope, c, extra_tags={
                            "knowledge": entries_of[point_key(c.point)]} if c.origin == KNOWLEDGE else None), None)
                                  for c in fresh]
                        exhausted = None if batch else f"the template's space has nothing new ({len(history)} points tried)"
                for c, run_id, charge in batch:
                    in_flight[evaluate.submit(c, run_id, target, slots, tracker, held_out, charge,
                                              baselines=baselines)] = c
            if not in_flight and not replies:
                if waiting:
                    continue
                break
            fut = next(as_completed([*in_flight, *replies]))
            if fut in replies:
                replies.discard(fut)
                p = fut.result()
                if p.error:  # the SDK's retries are spent: stop proposing, finish what is in flight
                    down = down or p.error
                    print(f"proposing stopped: {p.error}")
                    continue
                run_id, charge = take_reply(p, tracker, parent, scope, llm)
                progress.spend(charge)
                if p.malformed:
                    report(malformed(p, run_id, charge, tracker))
                else:
                    in_flight[evaluate.submit(p.candidate, run_id, target, slots, tracker, held_out,
                                              charge, baselines=baselines)] = p.candidate
                continue
            in_flight.pop(fut)
            outcome = fut.result()
            if outcome.held:
                print(f"{outcome.candidate.label} on {outcome.charge.gpu}: {one_line(outcome)}")
                waiting.append(outcome)
            else:
                report(outcome)
        time_on_held_out(passed, target, held_out)
    except BaseException as e:
        tracker.fail_parent(parent, f"{type(e).__name__}: {e}")
        raise
    reason = (f"the LLM endpoint is down: {down}" if down else None) or progress.stop_reason() or exhausted \
        or "no candidate left to run"
    ranked = board(tracker, op, target.model, limit=10, target=target.key(),
                   gpu_class=None if scope.gpu_class == "mixed" else scope.gpu_class)
    rows = [e.__dict__ for e in ranked.entries]
    left_out = f"{ranked.fallbacks} reference_fallback candidates left out (torch's own implementation)"
    spent = f"; {progress.tokens.proposer_tokens:,} tokens, ${progress.tokens.proposer_usd:.4f}" if llm else ""
    print(f"stopped: {reason}. {progress.passed}/{progress.done} passed"
          + (f"; best score {progress.top:.3g}x" if progress.top else "") + spent)
    spend = f"spent {progress.cost.text()} on {progress.done} candidates; {per_gain_text(progress.cost, progress.top)}"
    print(spend)
    create_table_artifact(table=rows or [{"result": left_out if ranked.fallbacks else "no candidate passed"}],
                          key=f"leaderboard-{op.replace('_', '-')}",
                          description=f"{op} on {target.key()} ({scope.gpu_class}): passed candidates, best "
                                      "score first" + (f"; {left_out}" if ranked.fallbacks else "") + f". {spend}")
    drafts = write_drafts(tracker, scope, kb)
    if drafts:
        print(f"knowledge: draft entries {', '.join(drafts)}; a person publishes them with `infersmith kb publish ID`")
    metrics = progress.metrics() | {"stopped_early": float(progress.done < target.budget.candidates)}
    summary(f"optimize {op}", target.key(), scope.gpu_class, reason, metrics, spend)
    log_optimization_charts(tracker, parent, f"{op} {target.key()} ({scope.gpu_class})")
    tracker.finish_parent(parent, metrics, {"leaderboard.json": rows, "stop_reason.json": {"reason": reason},
                                            "held_out.json": [s.to_dict() for s in held_out],
                                            "knowledge.json": {"drafts": drafts,
                                                               "warm_start": [ids for _, ids in warm]}})
    archive = results.publish(parent, {"leaderboard.json": rows, "metrics.json": metrics,
                                       "stop_reason.json": {"reason": reason}, "verdicts.json": verdicts,
                                       "target.json": target.model_dump(mode="json")})
    if archive:
        print(f"results archive: {archive}")
    return {"parent_run_id": parent, "stop_reason": reason, "endpoint_down": down, "drafts": drafts, "results": archive,
            **metrics}


def summary(what: str, target_key: str, gpu_class: str, reason: str, metrics: dict[str, float], spend: str) -> None:
    """The flow's summary artifact: what it ran, why it stopped, what it cost and what that bought."""
    def row(name: str) -> str:
        return f"| {name} | {f'{metrics[name]:.4g}' if name in metrics else '-'} |"

    lines = [f"## {what}: {target_key} ({gpu_class})", "", f"Stopped: {reason}.", "", spend, "",
             "| metric | value |", "| --- | --- |"]
    lines += [row(n) for n in ("candidates", "passed", "best_score", "gpu_hours", "cost_usd", "proposer_tokens",
                               "proposer_usd", "total_usd", "reference_gpu_hours", "baseline_gpu_hours", "gain_pct",
                               "usd_per_pct_gain", "gpu_hours_per_pct_gain")]
    create_markdown_artifact("\n".join(lines), key=f"summary-{what.split()[-1].replace('_', '-')}",
                             description=f"{what} on {target_key}: cost and cost per gain")


if __name__ == "__main__":
    optimize_op(op="rmsnorm", target=Target(model="tiny", budget={"candidates": 8}), proposer="random")
