"""The op search's side of the loop: its set-up, its sources (orphaned pending runs, the
template proposer with its warm start, the LLM's replies) and where its outcomes go."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from prefect.runtime import flow_run

from contract.job import Candidate
from contract.verdict import Verdict
from engine_templates.ops import get_op
from flows import approval
from flows.search.loop import Done, Down, Search
from flows.search.stops import Progress
from gpu_pool.baselines import Baselines
from gpu_pool.executors import prewarm
from gpu_pool.health import HEALTH
from gpu_pool.leases import ensure_limits, free_slots
from gpu_pool.pool import Pool, Slot, local_pool
from proposers import warm_start_for
from proposers.base import KNOWLEDGE, point_key
from proposers.llm import LLMProposer, LLMSettings, Proposal
from targets import Target
from tasks.evaluate import Outcome, evaluate, one_line
from tasks.propose import propose, propose_code
from tracking.artifacts import Results
from tracking.history import ceilings, trials
from tracking.knowledge import KnowledgeBase, published_for
from tracking.ledger import Charge
from tracking.schema import RunScope, Tracker
from tracking.store import TrackingConfig


def scope_for(op: str, target: Target, pool: Pool) -> RunScope:
    return RunScope.on(op, target, pool.slots(target.gpu_class))


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


@dataclass
class Ready:
    """A candidate with its pending child run open; `charge`: what proposing it cost."""

    candidate: Candidate
    run_id: str
    charge: Charge | None = None


class OpSession:
    """What one op search holds from set-up to publishing: the pool's slots, tracking and the
    parent run, the proposer's inputs, and the outcomes as they are reported."""

    def __init__(self, op: str, target: Target, proposer: str, template: str | None, seed: int,
                 pool: Pool | None, llm: LLMSettings | None, warm_start: bool):
        spec = get_op(op, target.dtype)
        self.template = template or next(iter(spec.templates))
        if self.template not in spec.templates:
            raise ValueError(f"{op} has no template {self.template!r}; known: {', '.join(spec.templates)}")
        self.op, self.target, self.proposer = op, target, proposer
        self.llm = (llm or LLMSettings()) if proposer == "llm" else None
        # The LLM writes free candidates; it reads every trial of the scope, templates' too.
        self.kind, self.read = ("free", None) if self.llm else (self.template, self.template)
        pool = pool or local_pool()
        self.slots = pool.slots(target.gpu_class)
        prewarm(self.slots)
        self.scope = scope_for(op, target, pool)
        ensure_limits(pool)
        self.tracker = Tracker(TrackingConfig.from_env())
        self.results = Results(f"infersmith-{op}")  # S3, when configured, is checked before anything runs
        self.baselines = Baselines()  # each slot's, measured once this flow (gpu_pool/baselines.py)
        self.seed = flow_seed(seed)
        self.params = {"target": target.model_dump(mode="json"), "proposer": proposer, "template": self.kind,
                       "seed": seed, "proposer_seed": self.seed, "pool": [s.label for s in self.slots],
                       "warm_start": warm_start}
        if self.llm:  # the key's variable is named, the key never
            self.params["llm"] = self.llm.model_dump(mode="json", exclude={"prices"}) | {
                "price": self.llm.price and self.llm.price.model_dump()}
        self.kb = KnowledgeBase.from_env()
        self.warm = warm_start_for("llm" if self.llm else proposer, op, self.template, self.scope, target.dtype,
                                   self.kb, warm_start)
        self.progress = Progress(target)
        self.held_out = target.held_out_shapes(spec)
        self.passed: list[Outcome] = []
        self.verdicts: dict[str, dict] = {}  # the results archive's, by run id
        self.parent = ""

    @property
    def origin(self) -> str:
        return self.llm.origin if self.llm else self.proposer

    def start(self) -> None:
        """The parent run, and the line that says what runs where."""
        self.parent = self.tracker.start_parent(
            "optimization", self.scope, f"optimize {self.op} {self.target.model}", params=self.params,
            tags={"infersmith.proposer": self.origin, "infersmith.template": self.kind})
        print(f"optimizing {self.op} for {self.target.key()} with {self.origin}"
              + ("" if self.llm else f" over template {self.template!r}")
              + f" on {', '.join(s.label for s in self.slots)}; tracking run {self.parent}")
        print(self.warm.line())

    def search(self) -> Search[Ready, Outcome]:
        """The loop's view of this search: orphans first, then the proposer or the LLM."""
        sources: list = [Orphans(self)]
        if not self.llm:
            sources.append(Proposed(self))
        return Search(stops=self.progress, run=self.run, room=lambda busy: room(self.slots, busy),
                      report=self.report, sources=sources, replies=Coded(self) if self.llm else None,
                      held=self.held, decide=lambda o: approval.decide(o, self.target, self.tracker),
                      requeue=self.requeue, label=lambda r: r.candidate.label)

    def run(self, r: Ready):
        return evaluate.submit(r.candidate, r.run_id, self.target, self.slots, self.tracker, self.held_out, r.charge,
                               baselines=self.baselines)

    def claim(self, old_run: str, c: Candidate, charge: Charge | None = None) -> Ready:
        """A candidate another run left pending, on a new pending child here; the old one retired."""
        run_id = self.tracker.open_candidate(self.parent, self.scope, c, requeued_from=old_run)
        self.tracker.retire_orphan(old_run, run_id)
        return Ready(c, run_id, charge)

    def requeue(self, r: Ready, error: Exception) -> Ready:
        return self.claim(r.run_id, r.candidate, r.charge)

    def held(self, o: Outcome) -> bool:
        if o.held:
            print(f"{o.candidate.label} on {o.charge.gpu}: {one_line(o)}")
        return o.held

    def report(self, o: Outcome) -> None:
        self.verdicts[o.run_id] = json.loads(o.verdict.to_json())
        if o.score is not None:
            self.passed.append(o)
        print(f"[{self.progress.done}/{self.target.budget.candidates}] {o.candidate.label}"
              + (f" on {o.charge.gpu}" if o.charge.gpu else "") + f": {one_line(o)}")


class Orphans:
    """Candidates a stopped flow left pending in this scope, re-queued before anything new."""

    exhausted = None

    def __init__(self, s: OpSession):
        self.s, self.left = s, s.tracker.orphaned_pending(s.scope, s.kind)
        if self.left:
            print(f"re-queueing {len(self.left)} candidates a stopped flow left pending")

    def take(self, n: int) -> list[Ready]:
        taken, self.left = self.left[:n], self.left[n:]
        return [self.s.claim(old, c) for old, c in taken]


class Proposed:
    """The template proposer's batch, warm-started from published knowledge; each candidate's
    pending run opens at once, so the next proposal, here or in another flow, sees it."""

    def __init__(self, s: OpSession):
        self.s, self.exhausted = s, None
        self.entries_of = {point_key(p): ",".join(ids) for p, ids in s.warm.points}

    def take(self, n: int) -> list[Ready]:
        s = self.s
        history = trials(s.tracker, s.scope, s.read)
        fresh = propose(s.proposer, s.op, s.template, s.seed, history, n, [p for p, _ in s.warm.points],
                        s.target.dtype)
        self.exhausted = None if fresh else f"the template's space has nothing new ({len(history)} points tried)"
        return [Ready(c, s.tracker.open_candidate(s.parent, s.scope, c, extra_tags={
            "knowledge": self.entries_of[point_key(c.point)]} if c.origin == KNOWLEDGE else None)) for c in fresh]


class Coded:
    """The LLM's replies, as many awaited at once as there are free places; each becomes a
    pending child run with its tokens, dollars and transcript the moment it comes."""

    def __init__(self, s: OpSession):
        self.s = s
        self.coder = LLMProposer(s.op, s.target, s.llm, [e.body for e in published_for(s.op, s.scope.gpu_class, s.kb)],
                                 s.warm.kernels)
        # The SDK retries a request itself; past every try and its backoff the reply is given up.
        self.timeout_s = s.llm.timeout_s * (s.llm.max_retries + 1) + 120.0

    def ask(self):
        s = self.s
        return propose_code.submit(self.coder, trials(s.tracker, s.scope, s.read),
                                   ceilings(s.tracker, s.scope.gpu_class, s.target.dtype))

    def take(self, p: Proposal) -> Ready | Done[Outcome] | Down:
        if p.error:  # the SDK's retries are spent: stop proposing, finish what is in flight
            return Down(p.error)
        s, u = self.s, p.usage
        charge = Charge(input_tokens=u.input_tokens, cached_input_tokens=u.cached_input_tokens,
                        output_tokens=u.output_tokens, proposer_usd=p.usd)
        run_id = s.tracker.open_candidate(s.parent, s.scope, p.candidate)
        s.tracker.log_proposal(run_id, charge, p.prompt, p.reply, {
            "provider": s.llm.provider, "model": s.llm.model, "base_url": s.llm.base_url,
            "stop_reason": p.stop_reason, "malformed": p.malformed, "price_per_million": (
                s.llm.price.model_dump() if s.llm.price else None), **charge.token_metrics()})
        s.progress.spend(charge)
        if not p.malformed:
            return Ready(p.candidate, run_id, charge)
        # A reply with no module to judge: its verdict is written here, no GPU held.
        verdict = Verdict(op=p.candidate.op, candidate_id=p.candidate.id)
        verdict.malformed(p.malformed)
        s.tracker.finish_candidate(run_id, p.candidate, verdict, charge)
        return Done(Outcome(p.candidate, verdict, charge, run_id))
