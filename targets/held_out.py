"""Held-out shapes: sizes of the target's range that no proposer is shown.

A proposer (a search, an LLM, an agent) sees the target's shapes and is scored on them; a kernel
can be tuned to exactly those sizes and nothing else. Each run draws, from every list of the
workload (decode batches, prefill tokens, contexts), odd sizes in that list's range that the
list does not hold (other batch sizes, odd row counts and context lengths), and builds the
op's shapes from them under labels starting `held_out_`. The check stage checks every candidate
on them beside the awkward sizes; the bench stage times them after the shown shapes.
They reach tracking (for the person reading the results) and never a proposer's view: `withheld`
is applied to every failure text that view carries.
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, Sequence

from contract.job import Shape
from engine_templates.models import ModelDims

if TYPE_CHECKING:  # the ops import torch, which a controller that only reads a target need not
    from engine_templates.ops.base import Op

PREFIX = "held_out_"
WITHHELD = "on a held-out shape (its size and the failure's detail are not shown to proposers)"


def size_range(shown: Sequence[int]) -> list[int]:
    """The odd sizes from half the least shown size to the greatest, none of them shown: no held-out
    shape needs more memory than the largest shown one (the range reaches 7 at least, for the tiny
    presets' few sizes). None when nothing is shown: that list does not apply."""
    if not shown:
        return []
    lo, hi = max(1, min(shown) // 2), max(max(shown), 7)
    return [v for v in range(lo | 1, hi + 1, 2) if v not in shown]


def held_out_shapes(op: Op, dims: ModelDims, decode_batches: Sequence[int], prefill_tokens: Sequence[int],
                    contexts: Sequence[int], per_list: int, rng: random.Random) -> list[Shape]:
    """The op's shapes at `per_list` sizes drawn from each list's `size_range`, labelled
    `held_out_*`. A decode batch or prefill length is drawn again where all its shapes would equal
    shown or awkward ones (tiny's batch 3 is the awkward `odd_3rows`): those are not held out."""
    if per_list <= 0:
        return []
    known = {_key(s) for s in [*op.shapes(dims, list(decode_batches), list(prefill_tokens), list(contexts)),
                               *op.odd_shapes(dims)]}
    ctx = sorted(rng.sample(size_range(contexts), min(per_list, len(size_range(contexts)))))

    def draw(shown: Sequence[int], shapes_at) -> list[int]:
        pool, out = size_range(shown), []
        rng.shuffle(pool)
        for v in pool:
            shapes = shapes_at(v)
            if not shapes or len(out) == per_list:  # the list does not apply to this op, or enough
                break
            if any(_key(s) not in known for s in shapes):
                out.append(v)
        return sorted(out)

    batches = draw(decode_batches, lambda v: op.shapes(dims, [v], [], ctx))
    prefill = draw(prefill_tokens, lambda v: op.shapes(dims, [], [v], ctx))
    return [Shape(PREFIX + s.label, dict(s.dims)) for s in op.shapes(dims, batches, prefill, ctx)
            if _key(s) not in known]


def _key(shape: Shape) -> tuple:
    return tuple(sorted(shape.dims.items()))


def is_held_out(label: str) -> bool:
    return label.startswith(PREFIX)


def withheld(detail: str) -> str:
    """`detail` as a proposer may read it: the harness names the shape a failure happened on, and
    a failure on a held-out shape would tell its size (and, through the candidate's own error, more)."""
    return WITHHELD if PREFIX in detail else detail
