"""What a search starts from: the published entries a proposer can use, and why the others were not.

A template proposer (TPE) starts from the points other targets' entries won with, for its
template. A code-writing proposer (the LLM) starts from the winning kernels of the nearest
targets: the same GPU class first, then the same dtype, the same model, the very target, then
the best score. Either way the search says in one line which entries it used and why it skipped
the rest (`WarmStart.line`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tracking.knowledge.entries import PUBLISHED, Entry, KnowledgeBase
from tracking.schema import RunScope

KERNELS = 3  # the nearest winning kernels a code-writing proposer reads

# A vision op's template whose parameters mean what a text op's template's do (the same names,
# the same kind of kernel): the text op's published points are offered to its search too, each
# one whose every parameter is a name of the vision template's space with a value in its range
# (docs/knowledge.md#vision-ops-from-text-ops).
CARRY_OVER: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    ("layernorm", "rows"): (("rmsnorm", "rows"), ("fused_add_rmsnorm", "rows")),  # block_n, rows, warps, stages
    ("vision_attention", "flash"): (("prefill_attention", "flash"),),  # block_m, block_n, warps, stages
    ("vision_linear", "tiles"): (("linear", "tiles"),),  # block_m, block_n, block_k, group_m, warps, stages
    ("gelu", "flat"): (("silu_mul", "flat"),),  # block, warps, stages
}


@dataclass
class WarmStart:
    op: str
    points: list[tuple[dict[str, Any], list[str]]] = field(default_factory=list)  # template: point, entry ids
    kernels: list[list[Entry]] = field(default_factory=list)  # code: one winner's entries each, nearest first
    skipped: list[tuple[str, str]] = field(default_factory=list)  # entry id, why
    off: str = ""  # why there is no warm start at all

    @property
    def used(self) -> list[str]:
        return [i for _, ids in self.points for i in ids] + [e.id for group in self.kernels for e in group]

    def line(self) -> str:
        """One line for the flow's output: the entries used, and each skipped one with its reason."""
        if self.off:
            return f"warm start: off ({self.off})"
        if not self.used and not self.skipped:
            return f"warm start: none (no published knowledge of {self.op})"
        n, kind = (len(self.points), "point") if self.points else (len(self.kernels), "kernel")
        what = f"{n} {kind}{'s' if n != 1 else ''}" if n else "nothing"
        used = f"used {', '.join(self.used)}" if self.used else "used none"
        skipped = "; ".join(f"{i} ({why})" for i, why in self.skipped)
        return f"warm start: {what} from published knowledge; {used}" + (f"; skipped {skipped}" if skipped else "")

    def to_dict(self) -> dict:
        return {"used": self.used, "skipped": dict(self.skipped), "off": self.off}


def for_template(op: str, template: str, scope: RunScope, kb: KnowledgeBase,
                 space: dict[str, list] | None = None) -> WarmStart:
    """The points of the template that other targets' published entries won with, each once with
    the ids of the entries behind it: the op's own entries before those carried over, entries of
    this GPU class first, then by score. An entry of this very target and GPU class is skipped: its
    runs are already this search's history. With the template's `space`, the points of the text
    ops CARRY_OVER names for (op, template) that fit in it are offered too."""
    warm = WarmStart(op)
    usable = []
    for e in kb.entries(PUBLISHED, op):
        w = e.winner
        if w["kind"] != "template":
            warm.skipped.append((e.id, "free kernel: no template point"))
        elif w["template"] != template:
            warm.skipped.append((e.id, f"a point of template {w['template']}, not {template}"))
        elif (e.target, e.gpu_class) == (scope.target_key, scope.gpu_class):
            warm.skipped.append((e.id, "this target's own: its runs are the history"))
        else:
            usable.append(e)
    for source, source_template in CARRY_OVER.get((op, template), ()) if space is not None else ():
        for e in kb.entries(PUBLISHED, source):
            why = _misfit(e, source_template, space, f"{op}/{template}")
            if why:
                warm.skipped.append((e.id, why))
            else:
                usable.append(e)
    usable.sort(key=lambda e: (e.op != op, e.gpu_class != scope.gpu_class, -e.score, e.id))
    out: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for e in usable:
        out.setdefault(json.dumps(e.winner["point"], sort_keys=True), (e.winner["point"], []))[1].append(e.id)
    warm.points = list(out.values())
    return warm


def _misfit(e: Entry, template: str, space: dict[str, list], into: str) -> str:
    """Why another op's entry's point cannot start a search of `into`'s space ("" when it can)."""
    w = e.winner
    if w["kind"] != "template" or w["template"] != template:
        return f"{e.op}: not a point of its template {template}"
    point = w["point"]
    if set(point) != set(space):
        return f"{e.op}/{template}'s parameters {', '.join(sorted(point))} are not {into}'s"
    outside = [f"{k}={v}" for k, v in sorted(point.items()) if v not in space[k]]
    return f"{', '.join(outside)} outside {into}'s space" if outside else ""


def distance(e: Entry, scope: RunScope, dtype: str) -> tuple:
    """How far the target an entry was measured on is from the one searched: smaller is nearer."""
    return (e.gpu_class != scope.gpu_class, e.dtype != dtype, e.model != scope.model, e.target != scope.target_key)


def for_code(op: str, scope: RunScope, dtype: str, kb: KnowledgeBase, n: int = KERNELS) -> WarmStart:
    """The n nearest published winners (free kernels and template points alike), each with every
    published entry it won; a free kernel whose entry holds no source is skipped."""
    warm = WarmStart(op)
    groups: dict[str, list[Entry]] = {}
    for e in sorted(kb.entries(PUBLISHED, op), key=lambda e: (distance(e, scope, dtype), -e.score, e.id)):
        if e.winner["kind"] == "free" and not e.winner.get("source"):
            warm.skipped.append((e.id, "free kernel: its entry holds no source"))
        elif e.winner["candidate_id"] in groups or len(groups) < n:
            groups.setdefault(e.winner["candidate_id"], []).append(e)
        else:
            warm.skipped.append((e.id, f"farther than the {n} nearest kernels"))
    warm.kernels = list(groups.values())
    return warm
