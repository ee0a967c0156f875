"""The proposer interface: where candidates come from.

Call order, for every proposer:
  1. `Proposer(op, template, seed, warm_start)` once per optimization (cheap; no I/O).
     `warm_start`: points other targets won with (published knowledge), for a proposer that
     starts from them; `random`, the uniform baseline, does not.
  2. `propose(history, n)` each time the flow has free GPUs. `history` is every trial of
     this op, target and template that tracking knows of, from any process: finished ones
     with their state and score, and pending ones (proposed, not yet judged).
  3. Nothing else. A proposer keeps no state between calls: everything it knows comes from
     `history`, so parallel flows and a flow resumed after a crash propose consistently.

`propose` returns at most `n` candidates, none already in `history` and no two alike;
fewer (possibly none) when the space has nothing new left.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

from contract.job import Candidate
from engine_templates.ops.base import Template
from tracking.trials import Trial

KNOWLEDGE = "knowledge"  # the origin of a candidate proposed from the warm start's points


def point_key(point: dict[str, Any]) -> str:
    return json.dumps(point, sort_keys=True)


class Proposer(ABC):
    name: ClassVar[str]

    def __init__(self, op: str, template: Template, seed: int = 0, warm_start: Sequence[dict[str, Any]] = ()):
        self.op, self.template, self.seed = op, template, seed
        self.warm_start = [dict(p) for p in warm_start]

    @abstractmethod
    def propose(self, history: Sequence[Trial], n: int) -> list[Candidate]:
        """Up to n new candidates given everything tried so far."""

    def candidate(self, point: dict[str, Any], origin: str | None = None) -> Candidate:
        return Candidate(op=self.op, kind="template", template=self.template.name,
                         point=dict(point), origin=origin or self.name)

    def seen(self, history: Sequence[Trial]) -> set[str]:
        return {point_key(t.candidate.point) for t in history
                if t.candidate.kind == "template" and t.candidate.template == self.template.name}
