"""Which of a timed run's calls the judge checks, and how their outputs are kept for it
(docs/gates.md, timed = judged): the first, the last and GRAPH_CHECKS others drawn from the
operating system's entropy; a graph's as its last replay left them, an events or wall-clock
run's copied as each call returned, outside its timing. And one input set refilled in place
with new values between two timed calls drawn the same way (`Refill`; `Toggle` and `Kept` for a
run whose length the confidence rule decides as it goes), the call after it kept.
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
# random: for a graph once it has run, for events and the wall clock as a uniform sample of the
# calls, each drawn after it returned (their outputs are copied as they come). A function that
# skips work on a share f of the calls it is timed on escapes both timings' draws with chance (1 - f)^64: under 0.3% for f = 9%, the least a
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
    or not a tensor). The set's own values are copied before the run, to put back; `put(other)`
    refills another set of the same form instead, its values copied into the same room."""

    def __init__(self, fresh: tuple, args: tuple):
        self.fresh, self.args = fresh, args
        self.saved = [_clone(a) for a, f in zip(args, fresh) if f is not None]

    def _pairs(self) -> list:
        return [(a, f) for a, f in zip(self.args, self.fresh) if f is not None]

    def put(self, args: tuple | None = None) -> None:
        if args is not None and args is not self.args:
            self.args = args
            for s, (a, _) in zip(self.saved, self._pairs()):
                _copy(s, a)
        for a, f in self._pairs():
            _copy(a, f)

    def take_out(self) -> None:
        for s, (a, _) in zip(self.saved, self._pairs()):
            _copy(a, s)


def changes_now(r: int) -> bool:
    """Whether the refilled set's values change before repetition `r` (from 1) of a run whose
    length is not known when it starts (timing's confidence rule): with chance 1/r, from the
    operating system's entropy, so the last change falls on a repetition uniform over the run,
    however long it turns out (the first always changes)."""
    return r >= 1 and _below(r) == 0


class Toggle:
    """A graph run's in-place refill (`Refill`) when its length is not known in advance: the set's
    new values are put in or taken out before each repetition `changes_now` picks, and the run
    ends on the new values (the timing flips them in once more, before one more replay, when the
    last change took them out). Whatever the candidate skips from some replay on, the last change falls
    there with the chance of the share it skipped, and the outputs after the last replay must
    follow the new values."""

    def __init__(self, refill: Refill):
        self.refill, self.on = refill, False

    def before(self, r: int) -> None:
        if changes_now(r):
            self.flip()

    def flip(self) -> None:
        self.refill.take_out() if self.on else self.refill.put()
        self.on = not self.on


class Kept:
    """What the drawn calls of an events or wall-clock run returned, copied as each returns —
    after its timer stopped — into buffers allocated before the run from a warm-up call's
    outputs: every call of the run allocates, frees and is timed alike, kept or not. The run's
    length is not known when it starts (timing's confidence rule), so the calls kept are the
    first, the last of each round of the rule (the run ends on one) and up to GRAPH_CHECKS
    others held as a uniform sample of the calls so far (reservoir sampling, each call drawn
    after it returned, from the operating system's entropy); a call on refilled inputs is kept
    only as such. `misfit` names a kept call whose
    outputs do not fit those buffers.
    With `fresh` (`Refill`), call c (from 1) runs on its set refilled in place with chance 1/c
    (`changes_now`), the set put back after it: the last such call, uniform over the run, is
    `refilled`, and its outputs are kept too."""

    def __init__(self, model, calls: int, arg_sets=(), fresh: tuple | None = None):
        model = tensors(model, "timed")
        self.calls, self.misfit, self.model, self.us = calls, "", ", ".join(form(t) for t in model), 0.0
        self.reps, self.steady = 0, False  # set by the run: calls timed, whether the confidence rule held
        size = max(1, sum(t.numel() * t.element_size() for t in model))
        k = max(0, min(GRAPH_CHECKS, KEEP_BYTES // size - 2))
        self.arg_sets, self.fresh = arg_sets, fresh
        self.first, self.last = (tuple(_empty_like(t) for t in model) for _ in range(2))
        self.slots = [tuple(_empty_like(t) for t in model) for _ in range(k)]
        self.slot_calls = [-1] * k
        self.last_call, self.seen = -1, 0
        self.refilled, self.refill, self.refilling = -1, None, False
        if fresh is not None:
            self.refill = Refill(fresh, arg_sets[0])
            self.refilled_out = tuple(_empty_like(t) for t in model)

    def before(self, c: int) -> None:
        """Before call `c`'s timer starts."""
        self.refilling = self.refill is not None and changes_now(c)
        if self.refilling:
            self.refill.put(self.arg_sets[c % len(self.arg_sets)])

    def after(self, c: int, returned, last: bool = False) -> None:
        """After call `c`'s timer stopped: its outputs kept if drawn (`last`: the last call of a
        round of the rule, kept until a later round's replaces it), its inputs put back if refilled."""
        if self.refilling:  # kept as the refilled call only: its outputs follow the new values
            if self._copy(c, returned, self.refilled_out):
                self.refilled = c
            self.refill.take_out()
            self.refilling = False
            return
        if c == 0:
            self._copy(c, returned, self.first)
        elif self.slots:
            i, self.seen = self.seen, self.seen + 1
            j = i if i < len(self.slots) else _below(i + 1)
            if j < len(self.slots):
                self.slot_calls[j] = c if self._copy(c, returned, self.slots[j]) else -1
        if last and self._copy(c, returned, self.last):
            self.last_call = c

    def _copy(self, c: int, returned, into: tuple) -> bool:
        outs = returned if isinstance(returned, (tuple, list)) else (returned,)
        if len(outs) != len(into) or not all(type(t) is torch.Tensor and t.shape == b.shape and t.dtype == b.dtype
                                             for t, b in zip(outs, into)):
            self.misfit = self.misfit or (f"call {c} of the timed run returned "
                                          f"{', '.join(form(t) for t in outs)} where its warm-up returned {self.model}")
            return False
        for b, t in zip(into, outs):
            _copy(b, t)
        return True

    def outputs(self) -> dict:
        """{call: its outputs' copies}, or nothing when a kept call's did not fit."""
        if self.misfit:
            return {}
        out = {0: self.first, **{c: b for c, b in zip(self.slot_calls, self.slots) if c >= 0}}
        if self.last_call >= 0:
            out[self.last_call] = self.last
        if self.refilled >= 0:
            out[self.refilled] = self.refilled_out
        return dict(sorted(out.items()))


def form(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}".replace("torch.", "") if type(t) is torch.Tensor else type(t).__name__


def tensors(returned, while_: str = "captured") -> tuple:
    """The returned tensors, exactly torch.Tensor (a subclass could compute when cloned)."""
    items = returned if isinstance(returned, (tuple, list)) else (returned,)
    if not all(type(t) is torch.Tensor for t in items):
        raise TypeError(f"while {while_}, the function returned "
                        f"{', '.join(type(t).__name__ for t in items)}, not plain torch.Tensor")
    return tuple(items)
