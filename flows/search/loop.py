"""The loop every search runs: fill the free slots from the sources, report what finishes, ask a
person about held candidates once nothing is in flight, and stop by the rules (stops.py).

Nothing here knows an op, an engine or Prefect's server: a `Search` is plain callables, so the
same loop runs the flows' tasks and the tests' fakes (see the package's docstring for the order).
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_any
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Protocol, Sequence, TypeVar

from flows.search.stops import Progress

Item = TypeVar("Item")  # a candidate ready to run: its pending run already open
Out = TypeVar("Out")  # what running it gave: an outcome with `charge` and `score` (stops.Judged)


@dataclass(frozen=True)
class Done(Generic[Out]):
    """A reply judged without the pool (a malformed one): reported as it is."""

    outcome: Out


@dataclass(frozen=True)
class Down:
    """A reply that says its source can give no more (the endpoint is down): proposing stops."""

    reason: str


class Batch(Protocol[Item]):
    """A source that gives candidates at once: orphaned pending runs, a warm start, a proposer."""

    exhausted: str | None  # after a take that gave nothing: why, if the source is spent

    def take(self, n: int) -> list[Item]:
        """Up to n candidates, each with its pending run opened; fewer when it has no more."""


class Replies(Protocol[Item, Out]):
    """A source whose candidates come later: an LLM's replies, one awaited per free place."""

    timeout_s: float | None  # a reply not come by then is given up, and proposing stops

    def ask(self) -> Any:
        """Start one request; a future of its reply."""

    def take(self, reply: Any) -> Item | Done[Out] | Down:
        """The reply as a candidate to run, an outcome already judged, or the endpoint down."""


def first_done(futures: Sequence[Any], timeout: float | None) -> Any | None:
    """The first of the futures to finish, or None after `timeout` seconds. Prefect's futures
    are waited on through the executor futures they wrap, concurrent.futures' as they are."""
    inner = {getattr(f, "wrapped_future", f): f for f in futures}
    done, _ = wait_any(list(inner), timeout, FIRST_COMPLETED)
    return inner[next(iter(done))] if done else None


@dataclass
class Search(Generic[Item, Out]):
    """One search, as the loop drives it."""

    stops: Progress  # every budget rule and the running totals
    run: Callable[[Item], Future | Any]  # start a candidate on a slot: a future of its outcome
    room: Callable[[int], int]  # how many more may start now, given how many are busy
    report: Callable[[Out], None]  # print and log an outcome, after the stops counted it
    sources: Sequence[Batch[Item]] = ()  # asked in order for ready candidates
    replies: Replies[Item, Out] | None = None  # asked for the places the sources left
    held: Callable[[Out], bool] = lambda o: False  # passed, but counts only once a person decides
    decide: Callable[[Out], Out] = lambda o: o  # ask the person; only called with nothing in flight
    requeue: Callable[[Item, Exception], Item] | None = None  # a fresh run of a candidate whose slot died
    label: Callable[[Item], str] = str
    wait: Callable[[Sequence[Any], float | None], Any | None] = first_done


@dataclass
class Stopped:
    reason: str
    down: str | None = None  # the endpoint's error, when that stopped it


@dataclass
class _State(Generic[Item, Out]):
    running: dict[Any, Item] = field(default_factory=dict)
    awaited: dict[Any, float] = field(default_factory=dict)  # reply futures, by deadline
    waiting: list[Out] = field(default_factory=list)  # held for a person
    retries: list[Item] = field(default_factory=list)  # re-queued, ahead of every source
    second: set[int] = field(default_factory=set)  # ids of re-queued candidates: no third try
    exhausted: str | None = None
    down: str | None = None
    failure: Exception | None = None

    @property
    def busy(self) -> int:
        return len(self.running) + len(self.awaited)


def run_search(s: Search[Item, Out]) -> Stopped:
    """Run the search until a stop rule, the sources or the endpoint end it, and every started
    candidate has been reported. A source or a candidate that raises stops anything new from
    starting; what is in flight finishes and is reported, then the error is raised."""
    st: _State[Item, Out] = _State()
    while True:
        if st.waiting and not st.busy:
            for o in st.waiting:
                _finish(s, s.decide(o))
            st.waiting = []
        n = min(s.room(st.busy), s.stops.left(st.busy))
        if not st.waiting and st.failure is None and n > 0 and s.stops.may_launch(st.busy, len(st.awaited)):
            _fill(s, st, n)
        if not st.busy:
            if st.waiting:
                continue
            break
        _next(s, st)
    if st.failure is not None:
        raise st.failure
    reason = (f"the LLM endpoint is down: {st.down}" if st.down else None) or s.stops.stop_reason() \
        or st.exhausted or "no candidate left to run"
    p = s.stops
    spent = f"; {p.tokens.proposer_tokens:,} tokens, ${p.tokens.proposer_usd:.4f}" if s.replies else ""
    print(f"stopped: {reason}. {p.passed}/{p.done} passed" + (f"; best score {p.top:.3g}x" if p.top else "") + spent)
    return Stopped(reason, st.down)


def _fill(s: Search[Item, Out], st: _State[Item, Out], n: int) -> None:
    """Up to n candidates: re-queued ones first, then each source's, then replies asked for."""
    got, st.retries = st.retries[:n], st.retries[n:]
    try:
        if st.down is None:
            for src in s.sources:
                if len(got) < n:
                    got += src.take(n - len(got))
            for _ in range(n - len(got) if s.replies else 0):
                st.awaited[s.replies.ask()] = time.monotonic() + (s.replies.timeout_s or float("inf"))
    except Exception as e:  # a proposer's bug: nothing new starts, what runs finishes
        st.failure = e
        print(f"proposing stopped: {type(e).__name__}: {e}")
    if not got and not st.awaited and s.sources and st.failure is None:
        st.exhausted = next((src.exhausted for src in reversed(s.sources) if src.exhausted), None)
    elif got:
        st.exhausted = None
    for item in got:
        st.running[s.run(item)] = item


def _next(s: Search[Item, Out], st: _State[Item, Out]) -> None:
    """Wait for the first candidate or reply to finish (or a reply's deadline) and take it."""
    deadline = min(st.awaited.values(), default=float("inf"))
    timeout = None if deadline == float("inf") else max(deadline - time.monotonic(), 0.0)
    fut = s.wait([*st.running, *st.awaited], timeout)
    if fut is None:  # a reply's deadline passed
        late = [f for f, d in st.awaited.items() if d <= time.monotonic()]
        for f in late:
            del st.awaited[f]
        if late and st.down is None:
            st.down = f"no reply within {s.replies.timeout_s:g} s"
            print(f"proposing stopped: {st.down}")
        return
    if fut in st.awaited:
        del st.awaited[fut]
        try:
            got = s.replies.take(fut.result())
        except Exception as e:
            st.failure = st.failure or e
            print(f"proposing stopped: {type(e).__name__}: {e}")
            return
        if isinstance(got, Down):
            st.down = st.down or got.reason
            print(f"proposing stopped: {got.reason}")
        elif isinstance(got, Done):
            _finish(s, got.outcome)
        else:
            st.running[s.run(got)] = got
        return
    item = st.running.pop(fut)
    second = id(item) in st.second
    st.second.discard(id(item))
    try:
        o = fut.result()
    except Exception as e:  # the candidate's slot died under it: once more on a fresh run
        if s.requeue is None or second:
            st.failure = st.failure or e
            print(f"{s.label(item)}: {type(e).__name__}: {e}; nothing new starts")
            return
        again = s.requeue(item, e)
        st.second.add(id(again))
        st.retries.append(again)
        print(f"{s.label(item)}: {type(e).__name__}: {e}; re-queued")
        return
    if s.held(o):
        st.waiting.append(o)
    else:
        _finish(s, o)


def _finish(s: Search[Item, Out], o: Out) -> None:
    s.stops.record(o)
    s.report(o)
