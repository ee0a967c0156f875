"""Every stop rule of a search, and its running totals: count, wall clock, plateau, tokens,
dollars and GPU-hours, read from the target's budget. The loop (loop.py) asks `may_launch`
before it starts anything and `stop_reason` when it ends; an exhausted space and an endpoint
that went down are the loop's own, since only it sees the sources. `SessionBudget`: the rules of
an agent's session over MCP, where the agent, not a loop, proposes."""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Protocol

from targets import Target
from tracking.cost import Cost, per_gain
from tracking.ledger import Charge


class Judged(Protocol):
    """What the stop rules read of an outcome: what it cost, and its score if it passed."""

    charge: Charge

    @property
    def score(self) -> float | None: ...


class Progress:
    """Stop rules and the running best: budget, wall clock, plateau, tokens, dollars, GPU-hours."""

    def __init__(self, target: Target):
        self.budget, self.started = target.budget, time.monotonic()
        self.done, self.passed, self.best, self.since_best = 0, 0, None, 0
        self.top: float | None = None  # the best score, where `best` moves only on a 1% gain
        self.gpu_seconds = self.usd = 0.0
        self.host_seconds: dict[str, float] = defaultdict(float)
        self.proposals, self.tokens = 0, Charge()  # what the proposer's replies cost, as they come

    def spend(self, charge: Charge) -> None:
        """A proposer's reply and its cost: counted when it arrives, judged or not."""
        self.proposals += 1
        for k in ("input_tokens", "cached_input_tokens", "output_tokens", "proposer_usd"):
            setattr(self.tokens, k, getattr(self.tokens, k) + getattr(charge, k))

    @property
    def total_usd(self) -> float:
        return self.usd + self.tokens.proposer_usd

    def record(self, o: Judged) -> None:
        self.done += 1
        self.spent(o.charge)
        score = o.score
        if score is not None:
            self.passed += 1
            self.top = score if self.top is None else max(self.top, score)
        if score is not None and (self.best is None or score > self.best * 1.01):
            self.best, self.since_best = score, 0
        else:
            self.since_best += 1

    def spent(self, charge: Charge) -> None:
        """GPU time held for this run: a candidate's, or a timing on the held-out shapes."""
        self.gpu_seconds += charge.gpu_seconds
        self.usd += charge.usd
        if charge.host:  # a malformed reply held no host
            self.host_seconds[charge.host] += charge.gpu_seconds

    def left(self, in_flight: int) -> int:
        """Candidates the count still allows to start, beside those in flight."""
        return self.budget.candidates - self.done - in_flight

    def may_launch(self, in_flight: int, proposing: int = 0) -> bool:
        """`in_flight`: candidates running and replies awaited; `proposing`: the replies among them."""
        return self.stop_reason(proposing, in_flight - proposing) is None and self.left(in_flight) > 0

    def stop_reason(self, proposing: int = 0, running: int = 0) -> str | None:
        """Why nothing more may start, or None. `proposing`: replies awaited, which will cost
        about what the replies so far did, each; `running`: candidates on the pool, whose GPU
        time is not counted yet."""
        b = self.budget
        ahead = proposing + 1
        if b.max_tokens_total is not None and self.proposals:
            each = self.tokens.proposer_tokens / self.proposals
            if self.tokens.proposer_tokens + ahead * each > b.max_tokens_total:
                return (f"token budget of {b.max_tokens_total:,}: {self.tokens.proposer_tokens:,} spent, and another "
                        f"reply (about {each:,.0f} tokens each so far) would pass it")
        if b.max_usd is not None and (self.proposals or self.done):
            reply, gpu = self.tokens.proposer_usd / max(self.proposals, 1), self.usd / max(self.done, 1)
            each = reply + gpu
            if self.total_usd + ahead * reply + (running + ahead) * gpu > b.max_usd:
                return (f"$ budget of {b.max_usd:g}: ${self.total_usd:.4f} spent, and another candidate (about "
                        f"${each:.4f} each so far) would pass it")
        if b.max_gpu_hours is not None and self.done:
            each = self.gpu_seconds / self.done / 3600
            if self.gpu_seconds / 3600 + (running + ahead) * each > b.max_gpu_hours:
                return (f"GPU-hour budget of {b.max_gpu_hours:g}: {self.gpu_seconds / 3600:.3g} spent, {running} "
                        f"running, and another candidate (about {each:.3g} each so far) would pass it")
        if self.done >= b.candidates:
            return f"budget of {b.candidates} candidates spent"
        elapsed = time.monotonic() - self.started
        if elapsed > b.wall_clock_s:
            return f"wall-clock budget of {b.wall_clock_s:g} s spent"
        if self.done and elapsed + self.gpu_seconds / self.done > b.wall_clock_s:
            return (f"wall-clock budget of {b.wall_clock_s:g} s: another candidate (about "
                    f"{self.gpu_seconds / self.done:.0f} s each so far) would end after it")
        if self.since_best >= b.plateau:
            return f"plateau: {self.since_best} candidates without a 1% better score"
        return None

    @property
    def cost(self) -> Cost:
        """GPU time as the candidates ran, the proposer's tokens as its replies came."""
        return Cost(self.gpu_seconds, self.usd, float(self.tokens.proposer_tokens), self.tokens.proposer_usd)

    def metrics(self) -> dict[str, float]:
        m = {"candidates": self.done, "passed": self.passed, "wall_s": time.monotonic() - self.started}
        m |= self.cost.metrics() | self.tokens.token_metrics() | per_gain(self.cost, self.top)
        m |= {f"gpu_seconds/{host}": v for host, v in self.host_seconds.items()}
        return m | ({"best_score": self.top} if self.top is not None else {})


class SessionBudget:
    """An agent's session over MCP: candidates and GPU-hours across all its `evaluate` calls, which
    may overlap. `admit` before judging one (the reason when it is refused), `settle` after."""

    def __init__(self, max_candidates: int | None = None, max_gpu_hours: float | None = None):
        self.max_candidates, self.max_gpu_hours = max_candidates, max_gpu_hours
        self.done = self.running = 0
        self.gpu_seconds = 0.0
        self._lock = threading.Lock()

    def admit(self) -> str | None:
        """None, with the candidate counted as running; else why the session's budget refuses it."""
        with self._lock:
            why = self._refusal()
            if why is None:
                self.running += 1
            return why

    def settle(self, gpu_seconds: float) -> None:
        with self._lock:
            self.running -= 1
            self.done += 1
            self.gpu_seconds += gpu_seconds

    def _refusal(self) -> str | None:
        n, h = self.max_candidates, self.max_gpu_hours
        if n is not None and self.done + self.running >= n:
            return (f"the session's budget of {n} candidates is spent ({self.done} judged, "
                    f"{self.running} being judged)")
        if h is not None and self.done:
            each = self.gpu_seconds / self.done / 3600
            if self.gpu_seconds / 3600 + (self.running + 1) * each > h:
                return (f"the session's GPU-hour budget of {h:g}: {self.gpu_seconds / 3600:.3g} spent, "
                        f"{self.running} being judged, and another candidate (about {each:.3g} each so far) "
                        "would pass it")
        return None
