"""Where candidates come from: every proposer, by the name the command line uses."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from engine_templates.ops.base import Template
from proposers.base import Proposer
from proposers.random import RandomProposer
from proposers.tpe import TPEProposer

if TYPE_CHECKING:
    from tracking.knowledge import KnowledgeBase, WarmStart
    from tracking.schema import RunScope

PROPOSERS: dict[str, type[Proposer]] = {"random": RandomProposer, "tpe": TPEProposer}


def make_proposer(name: str, op: str, template: Template, seed: int = 0,
                  warm_start: Sequence[dict[str, Any]] = ()) -> Proposer:
    if name not in PROPOSERS:
        raise KeyError(f"unknown proposer {name!r}; known: {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[name](op, template, seed, warm_start)


def warm_start_for(name: str, op: str, template: str, scope: RunScope, dtype: str, kb: KnowledgeBase,
                   enabled: bool = True) -> WarmStart:
    """What proposer `name` starts from: TPE the points of published template winners (for a
    vision op, also the text ops' that carry over: tracking.knowledge.warm.CARRY_OVER), the LLM
    (`llm`) the nearest published kernels; `random`, the uniform baseline, starts cold."""
    from tracking.knowledge import WarmStart, for_code, for_template

    if not enabled:
        return WarmStart(op, off="turned off for this run")
    if name == "random":
        return WarmStart(op, off="random is the uniform baseline: it starts cold")
    if name == "llm":
        return for_code(op, scope, dtype, kb)
    from engine_templates.ops import get_op

    try:
        templates = get_op(op, dtype).templates
    except KeyError:
        templates = {}
    return for_template(op, template, scope, kb, templates[template].space if template in templates else None)
