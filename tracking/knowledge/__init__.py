"""The knowledge base: what verified runs taught, one entry per op, shape class, GPU class and
target, in markdown files a person reviews. An optimization writes drafts; only entries a person
published leave it: to warm-start a search (`for_template`: TPE's points, `for_code`: the LLM's
kernels), into an LLM's prompt (`published_for`) or an agent's search (`search`)."""
from __future__ import annotations

from typing import Any

from tracking.knowledge.entries import DRAFT, PUBLISHED, RETIRED, STATES, Entry, KnowledgeBase
from tracking.knowledge.warm import WarmStart, for_code, for_template
from tracking.schema import RunScope

__all__ = ["DRAFT", "PUBLISHED", "RETIRED", "STATES", "Entry", "KnowledgeBase", "WarmStart", "for_code",
           "for_template", "published_for", "search", "warm_points"]


def published_for(op: str, gpu_class: str, kb: KnowledgeBase | None = None) -> list[Entry]:
    """The published entries of `op` measured on `gpu_class`, best score first: what a prompt may show."""
    entries = (kb or KnowledgeBase.from_env()).entries(PUBLISHED, op)
    return sorted((e for e in entries if e.gpu_class == gpu_class), key=lambda e: -e.score)


def search(query: str, op: str | None = None, kb: KnowledgeBase | None = None) -> list[Entry]:
    """Published entries (of `op`, where given) holding the most of the query's words, then the
    best score first; every published entry of the op for an empty query."""
    words = query.lower().split()
    hits = []
    for e in (kb or KnowledgeBase.from_env()).entries(PUBLISHED, op):
        text = e.text().lower()
        found = sum(w in text for w in words)
        if found or not words:
            hits.append((found, e))
    return [e for _, e in sorted(hits, key=lambda h: (-h[0], -h[1].score, h[1].id))]


def warm_points(op: str, template: str, scope: RunScope,
                kb: KnowledgeBase | None = None) -> list[tuple[dict[str, Any], list[str]]]:
    """The points of the template that other targets' published entries won with, each once with
    the ids of the entries behind it: entries of this GPU class first, then by score."""
    return for_template(op, template, scope, kb or KnowledgeBase.from_env()).points
