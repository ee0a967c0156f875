"""What the history of a target holds, as proposers read it: one trial per candidate tracking
recorded, pending until its verdict is in."""
from __future__ import annotations

from dataclasses import dataclass, field

from contract.job import Candidate
from contract.serve import EngineCandidate

PENDING = "pending"


@dataclass(frozen=True)
class Trial:
    candidate: Candidate
    state: str  # "pending", "pass", "fail", "crash" or "malformed"
    score: float | None = None  # higher is better; set only for passed, timed trials
    # What tracking recorded beside the score, for proposers that write code (a template
    # search reads only the three fields above): the run's metrics (per shape
    # `<shape>/<metric>`), the gate that stopped it and why, and when it started (epoch ms).
    metrics: dict[str, float] = field(default_factory=dict, compare=False)
    gate: str = ""
    detail: str = ""
    started_ms: int = 0


@dataclass(frozen=True)
class Ceilings:
    """A GPU class's measured ceilings in one dtype, as a GPU-timed candidate's verdict recorded
    them: what the roofline is made of."""

    gpu_class: str
    copy_bytes_per_s: float  # bytes read + written per second by a large device copy
    matmul_flops_per_s: float  # a large dense matmul
    device: str = ""  # the card that measured them

    def roofline_us(self, nbytes: int, flops: int) -> float:
        return max(nbytes / self.copy_bytes_per_s, flops / self.matmul_flops_per_s) * 1e6


@dataclass(frozen=True)
class EngineTrial:
    candidate: EngineCandidate
    id: str  # as recorded: a free kernel's file is gone with its flow, so the id cannot be recomputed
    state: str  # "pending", "pass", "fail" or "crash"
    # The geometric mean of the metrics' advantage over the baseline: set for a passed
    # configuration and for a near miss (accurate, served, failed only the all-metrics gate).
    score: float | None = None
