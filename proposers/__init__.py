"""Where candidates come from: every proposer, by the name the command line uses."""
from __future__ import annotations

from typing import Any, Sequence

from engine_templates.ops.base import Template
from proposers.base import Proposer
from proposers.random import RandomProposer
from proposers.tpe import TPEProposer

PROPOSERS: dict[str, type[Proposer]] = {"random": RandomProposer, "tpe": TPEProposer}


def make_proposer(name: str, op: str, template: Template, seed: int = 0,
                  warm_start: Sequence[dict[str, Any]] = ()) -> Proposer:
    if name not in PROPOSERS:
        raise KeyError(f"unknown proposer {name!r}; known: {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[name](op, template, seed, warm_start)
