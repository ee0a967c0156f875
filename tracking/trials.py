"""What the history of a target holds, as proposers read it: one trial per candidate tracking
recorded, pending until its verdict is in."""
from __future__ import annotations

from dataclasses import dataclass

from contract.job import Candidate
from contract.serve import EngineCandidate

PENDING = "pending"


@dataclass(frozen=True)
class Trial:
    candidate: Candidate
    state: str  # "pending", "pass", "fail" or "crash"
    score: float | None = None  # higher is better; set only for passed, timed trials


@dataclass(frozen=True)
class EngineTrial:
    candidate: EngineCandidate
    id: str  # as recorded: a free kernel's file is gone with its flow, so the id cannot be recomputed
    state: str  # "pending", "pass", "fail" or "crash"
    # The geometric mean of the metrics' advantage over the baseline: set for a passed
    # configuration and for a near miss (accurate, served, failed only the all-metrics gate).
    score: float | None = None
