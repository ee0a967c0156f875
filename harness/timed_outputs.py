"""Which of a timed run's calls the judge checks, and how their outputs are kept for it
(docs/gates.md, timed = judged): the first, the last and GRAPH_CHECKS others drawn from the
operating system's entropy; a graph's as its last replay left them, an events or wall-clock
run's copied as each call returned, outside its timing. And one input set refilled in place
with new values between two timed calls drawn the same way (`Refill`), the call after it kept.
"""
from __future__ import annotations

from os import urandom as _urandom

import torch

# Bound at import, as in harness/timing.py: a builtin or a torch function swapped later does not
# choose which calls are judged nor what is copied for the judge.
len, sorted, zip, range, enumerate, min, max, int, isinstance, tuple, type, all, sum, list = (  # noqa: A001
    len, sorted, zip, range, enumerate, min, max, int, isinstance, tuple, type, all, sum, list)
_copy, _empty_like, _clone = torch.Tensor.copy_, torch.empty_like, torch.Tensor.clone

# Of a timed run's calls, the judge checks the first, the last and this many others drawn at
# random: for a graph once it has run, for events and the wall clock before the run starts (their
# outputs are copied as they come). A function that skips work on a share f of the calls it is
# timed on escapes both timings' draws with chance (1 - f)^64: under 0.3% for f = 9%, the least a
# 10% gain needs.
GRAPH_CHECKS = 32
# What the copies of an events or wall-clock run's checked outputs may take, per run: a call whose
# outputs are larger gets fewer random draws (never fewer than the first and the last call).
KEEP_BYTES = 1 << 30


def _below(n: int) -> int:
    """Uniform in [0, n), n < 2**31, from os.urandom (bound at import; random's classes are
    looked up at call time, so a candidate could make their draws predictable)."""
    bits = n.bit_length()
    while True:
        r = int.from_bytes(_urandom(4), "big") >> (32 - bits)
        if r < n:
            return r


def _draw(population: range, k: int) -> list[int]:
    """`k` distinct members of `population`, each pick uniform over those left."""
    left = list(population)
    return [left.pop(_below(len(left))) for _ in range(k)]


def checked_sets(n: int, draws: int | None = None) -> list[int]:
    """Which of `n` captured calls the judge checks: the first, the last, and `draws` (default
    GRAPH_CHECKS) of the others at random, from the operating system's entropy."""
    middle = range(1, n - 1)
    k = min(GRAPH_CHECKS if draws is None else draws, len(middle))
    return sorted({0, n - 1, *_draw(middle, k)})


def reused_storage(every: list[tuple]) -> str:
    """'' when every call returned storage of its own; else which two calls returned the same."""
    seen: dict[int, int] = {}
    for j, outs in enumerate(every):
        for t in outs:
            ptr = t.untyped_storage().data_ptr()
            if ptr and ptr in seen and seen[ptr] != j:
                return f"calls {seen[ptr]} and {j} of {len(every)}"
            seen.setdefault(ptr, j)
    return ""


def refill_point(n: int) -> int:
    """Which of `n` (at least 2) timed calls or replays runs first on refilled inputs: one after
    the first, drawn from the operating system's entropy."""
    return 1 + _below(n - 1)


class Refill:
    """New values for one input set, put in place between two timed calls (after the one's timer
    stopped, before the other's started) and taken out again after the refilled call (a graph's:
    after the last replay): same storage,
    pointers and shapes, so a result cached on any of them while timed goes stale there, however
    the candidate tells timed calls from probed ones (docs/gates.md, caching while timed).
    `fresh`: per argument of `args`, its new values, or None for one left as it is (persistent,
    or not a tensor). The set's own values are copied before the run, to put back."""

    def __init__(self, fresh: tuple, args: tuple):
        self.pairs = [(a, f, _clone(a)) for a, f in zip(args, fresh) if f is not None]

    def put(self) -> None:
        for a, f, _ in self.pairs:
            _copy(a, f)

    def take_out(self) -> None:
        for a, _, saved in self.pairs:
            _copy(a, saved)


class Kept:
    """What the drawn calls of an events or wall-clock run returned (`checked_sets`: the first,
    the last, and up to GRAPH_CHECKS others, drawn before the run from the operating system's
    entropy), copied as each returns — after its timer stopped — into buffers allocated before
    the run from a warm-up call's outputs: every call of the run allocates, frees and is timed
    alike, kept or not. `misfit` names a drawn call whose outputs do not fit those buffers.
    With `fresh` (`Refill`), the inputs of call `refilled` (drawn, `refill_point`) are refilled in
    place before it and put back after it, and its outputs are kept too."""

    def __init__(self, model, calls: int, arg_sets=(), fresh: tuple | None = None):
        model = tensors(model, "timed")
        self.calls, self.misfit, self.model, self.us = calls, "", ", ".join(form(t) for t in model), 0.0
        size = max(1, sum(t.numel() * t.element_size() for t in model))
        drawn = checked_sets(calls, max(0, min(GRAPH_CHECKS, KEEP_BYTES // size - 2)))
        self.refilled, self.refill = -1, None
        if fresh is not None:
            self.refilled = refill_point(calls)
            self.refill = Refill(fresh, arg_sets[self.refilled % len(arg_sets)])
        self.buffers = {c: tuple(_empty_like(t) for t in model) for c in sorted({*drawn, self.refilled} - {-1})}

    def before(self, c: int) -> None:
        """Before call `c`'s timer starts."""
        if c == self.refilled:
            self.refill.put()

    def after(self, c: int, returned) -> None:
        """After call `c`'s timer stopped: its outputs kept if drawn, its inputs put back if refilled."""
        self.take(c, returned)
        if c == self.refilled:
            self.refill.take_out()

    def take(self, c: int, returned) -> None:
        into = self.buffers.get(c)
        if into is None:
            return
        outs = returned if isinstance(returned, (tuple, list)) else (returned,)
        if len(outs) != len(into) or not all(type(t) is torch.Tensor and t.shape == b.shape and t.dtype == b.dtype
                                             for t, b in zip(outs, into)):
            self.misfit = self.misfit or (f"call {c} of {self.calls} returned "
                                          f"{', '.join(form(t) for t in outs)} where its warm-up returned {self.model}")
            return
        for b, t in zip(into, outs):
            _copy(b, t)

    def outputs(self) -> dict:
        """{call: its outputs' copies}, or nothing when a drawn call's did not fit."""
        return {} if self.misfit else self.buffers


def form(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}".replace("torch.", "") if type(t) is torch.Tensor else type(t).__name__


def tensors(returned, while_: str = "captured") -> tuple:
    """The returned tensors, exactly torch.Tensor (a subclass could compute when cloned)."""
    items = returned if isinstance(returned, (tuple, list)) else (returned,)
    if not all(type(t) is torch.Tensor for t in items):
        raise TypeError(f"while {while_}, the function returned "
                        f"{', '.join(type(t).__name__ for t in items)}, not plain torch.Tensor")
    return tuple(items)
