"""The search loop alone (flows/search/loop.py), with fake sources and sinks on a thread pool: no
Prefect server, no tracking. Each stop rule, a failing proposer, a silent endpoint, a dying slot,
a held candidate and a budget reached with work in flight."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from flows.search import Done, Down, Progress, Search, run_search
from targets import Target
from tracking.ledger import Charge


@dataclass
class Out:
    name: str
    score: float | None
    charge: Charge = field(default_factory=Charge)
    held: bool = False
    finished: float = 0.0  # time.monotonic() when it was judged


class Counter:
    """A proposer over `size` points (unbounded by default); `fail_on`: the take that raises."""

    def __init__(self, size: int | None = None, fail_on: int | None = None):
        self.size, self.fail_on, self.given, self.takes, self.exhausted = size, fail_on, 0, 0, None

    def take(self, n: int) -> list[str]:
        self.takes += 1
        if self.takes == self.fail_on:
            raise RuntimeError("the proposer's bug")
        n = n if self.size is None else min(n, self.size - self.given)
        got = [f"c{self.given + i}" for i in range(n)]
        self.given += n
        self.exhausted = None if got else f"the space has nothing new ({self.given} points tried)"
        return got


class Pool:
    """Slots on a thread pool: `judge(name)` gives an outcome after `seconds`; `room` free places."""

    def __init__(self, judge, slots: int = 2, seconds: float = 0.01):
        self.judge, self.slots, self.seconds = judge, slots, seconds
        self.pool = ThreadPoolExecutor(slots + 1)
        self.started: list[str] = []
        self.reported: list[Out] = []

    def run(self, name: str) -> Future:
        self.started.append(name)

        def work() -> Out:
            time.sleep(self.seconds)
            o = self.judge(name)
            o.finished = time.monotonic()
            return o

        return self.pool.submit(work)

    def search(self, target: Target, **kw) -> Search:
        kw.setdefault("sources", [Counter()])
        return Search(stops=Progress(target), run=self.run, room=lambda busy: max(self.slots - busy, 0),
                      report=self.reported.append, **kw)


def budget(**b) -> Target:
    return Target(model="tiny", budget=b)


def scored(score=1.0, gpu_seconds=0.0, usd=0.0):
    return lambda name: Out(name, score, Charge(gpu_seconds=gpu_seconds, usd=usd))


def rising(name: str) -> Out:
    return Out(name, 1.0 + int(name[1:]))


def test_count_stops_it_with_every_started_candidate_reported(capsys):
    pool = Pool(rising, slots=3)
    stopped = run_search(pool.search(budget(candidates=5)))
    assert stopped.reason == "budget of 5 candidates spent"
    assert len(pool.started) == 5 and sorted(o.name for o in pool.reported) == [f"c{i}" for i in range(5)]
    assert "stopped: budget of 5 candidates spent. 5/5 passed; best score" in capsys.readouterr().out


def test_wall_clock_stops_before_a_candidate_that_would_end_after_it():
    pool = Pool(scored(gpu_seconds=0.2), slots=1, seconds=0.2)
    stopped = run_search(pool.search(budget(candidates=50, wall_clock_s=0.5)))
    assert stopped.reason.startswith("wall-clock budget of 0.5 s")
    assert 1 <= len(pool.reported) <= 3


def test_plateau():
    pool = Pool(scored(2.0), slots=2)
    stopped = run_search(pool.search(budget(candidates=50, plateau=4)))
    assert stopped.reason.startswith("plateau: ")
    assert 5 <= len(pool.reported) <= 6  # the first sets the best; one more may have been in flight


def test_gpu_hours_count_the_running_ones():
    # 0.5 GPU-h each, 2 GPU-h allowed: after the first two, two running and one more would make 2.5
    pool = Pool(scored(gpu_seconds=1800), slots=2)
    stopped = run_search(pool.search(budget(candidates=50, max_gpu_hours=2.0)))
    assert stopped.reason.startswith("GPU-hour budget of 2")
    assert len(pool.reported) == len(pool.started) and 3 <= len(pool.started) <= 4
    assert sum(o.charge.gpu_seconds for o in pool.reported) / 3600 <= 2.0


def test_a_budget_reached_with_work_in_flight_lets_it_finish_and_starts_nothing_new():
    # $1 a candidate, $2.5 allowed, three slots: the first three start at once; once one is in,
    # another would make $4 (one spent, two running, one more): nothing new starts, and all three
    # are reported.
    pool = Pool(scored(usd=1.0), slots=3, seconds=0.05)
    stopped = run_search(pool.search(budget(candidates=50, max_usd=2.5)))
    assert stopped.reason.startswith("$ budget of 2.5")
    assert len(pool.started) == 3 and len(pool.reported) == 3


class Coder:
    """An LLM's replies: each `ask` a future answered from `script` on a thread; None never answers."""

    def __init__(self, script: list, timeout_s: float | None = None):
        self.script, self.timeout_s, self.asked = list(script), timeout_s, 0
        self.pool = ThreadPoolExecutor(4)

    def ask(self) -> Future:
        self.asked += 1
        reply = self.script.pop(0) if self.script else Down("out of script")
        if reply is None:
            return Future()  # never set
        return self.pool.submit(lambda: reply)

    def take(self, reply):
        if isinstance(reply, tuple):  # (name, tokens): a module, with what it cost
            name, tokens = reply
            self.stops.spend(Charge(output_tokens=tokens))
            return name
        return reply


def with_coder(pool: Pool, target: Target, coder: Coder) -> Search:
    s = pool.search(target, sources=[], replies=coder)
    coder.stops = s.stops
    return s


def test_token_budget_counts_the_replies_awaited():
    coder = Coder([("c0", 400), ("c1", 400), ("c2", 400), ("c3", 400)])
    pool = Pool(scored(), slots=1)
    stopped = run_search(with_coder(pool, budget(candidates=50, max_tokens_total=1000), coder))
    assert stopped.reason.startswith("token budget of 1,000: 800 spent")
    assert pool.started == ["c0", "c1"] and coder.asked == 2


def test_an_endpoint_down_stops_proposing_and_what_runs_finishes(capsys):
    # Two places: c0's reply and the error are awaited at once, in either order; c0 runs on
    coder = Coder([("c0", 10), Down("the openai endpoint gave 503"), ("never", 10)])
    pool = Pool(scored(), slots=2, seconds=0.3)
    stopped = run_search(with_coder(pool, budget(candidates=50), coder))
    assert stopped.down == "the openai endpoint gave 503"
    assert stopped.reason == "the LLM endpoint is down: the openai endpoint gave 503"
    assert coder.asked == 2 and pool.started == ["c0"] and [o.name for o in pool.reported] == ["c0"]
    out = capsys.readouterr().out
    assert "proposing stopped: the openai endpoint gave 503" in out and "10 tokens" in out


def test_a_reply_judged_without_the_pool_is_reported_as_it_is():
    coder = Coder([Done(Out("malformed", None)), ("c0", 10)])
    pool = Pool(scored(), slots=1)
    stopped = run_search(with_coder(pool, budget(candidates=2), coder))
    assert pool.started == ["c0"] and [o.name for o in pool.reported] == ["malformed", "c0"]
    assert stopped.reason == "budget of 2 candidates spent"  # the malformed one counts


def test_a_reply_that_never_comes_is_given_up_at_its_deadline(capsys):
    coder = Coder([("c0", 10), None, None], timeout_s=0.3)
    pool = Pool(scored(), slots=2)
    t0 = time.monotonic()
    stopped = run_search(with_coder(pool, budget(candidates=50), coder))
    assert 0.3 <= time.monotonic() - t0 < 5
    assert stopped.reason == "the LLM endpoint is down: no reply within 0.3 s"
    assert [o.name for o in pool.reported] == ["c0"]
    assert "proposing stopped: no reply within 0.3 s" in capsys.readouterr().out


def test_the_space_exhausted():
    pool = Pool(scored(), slots=2)
    stopped = run_search(pool.search(budget(candidates=50), sources=[Counter(size=3)]))
    assert stopped.reason == "the space has nothing new (3 points tried)" and len(pool.reported) == 3


def test_sources_are_asked_in_order():
    orphans = Counter(size=2)
    orphans.take = lambda n, take=orphans.take: [f"orphan-{c}" for c in take(n)]
    pool = Pool(scored(), slots=1)
    run_search(pool.search(budget(candidates=4), sources=[orphans, Counter()]))
    assert pool.started == ["orphan-c0", "orphan-c1", "c0", "c1"]


def test_a_proposer_that_raises_lets_what_runs_finish_then_fails(capsys):
    pool = Pool(scored(), slots=2, seconds=0.1)
    with pytest.raises(RuntimeError, match="the proposer's bug"):
        run_search(pool.search(budget(candidates=50), sources=[Counter(fail_on=2)]))
    assert len(pool.started) == 2 and len(pool.reported) == 2  # the first batch, reported
    assert "proposing stopped: RuntimeError: the proposer's bug" in capsys.readouterr().out


def test_a_slot_that_dies_mid_candidate_is_requeued_once(capsys):
    deaths = {"c1": 1}
    lock = threading.Lock()

    def judge(name: str) -> Out:
        with lock:
            base = name.removesuffix("'")
            if deaths.get(base, 0) > 0 and not name.endswith("'"):
                deaths[base] -= 1
                raise ConnectionError("the host went away")
        return Out(name, 1.0 + int(base[1:]))

    requeued = []

    def requeue(name: str, error: Exception) -> str:
        requeued.append((name, str(error)))
        return name + "'"  # a fresh run of the same candidate

    pool = Pool(judge, slots=2)
    stopped = run_search(pool.search(budget(candidates=3), requeue=requeue))
    assert requeued == [("c1", "the host went away")]
    assert sorted(o.name for o in pool.reported) == ["c0", "c1'", "c2"] and stopped.reason.startswith("budget")
    assert "c1: ConnectionError: the host went away; re-queued" in capsys.readouterr().out


def test_a_candidate_that_dies_twice_fails_the_search_after_the_others_finish():
    def judge(name: str) -> Out:
        if name.startswith("c1"):
            raise ConnectionError("the host went away")
        return Out(name, 1.0)

    pool = Pool(judge, slots=2, seconds=0.05)
    with pytest.raises(ConnectionError):
        run_search(pool.search(budget(candidates=3), requeue=lambda name, e: name + "'"))
    assert "c1'" in pool.started and pool.reported and all(not o.name.startswith("c1") for o in pool.reported)


def test_a_held_candidate_is_decided_once_nothing_is_in_flight():
    def judge(name: str) -> Out:
        time.sleep(0.3 if name == "c1" else 0.0)  # c0 is held while c1 still runs
        return Out(name, 2.0, held=name == "c0")

    decided = []

    def decide(o: Out) -> Out:
        decided.append((o.name, time.monotonic()))
        return Out(o.name, None, o.charge)  # rejected

    pool = Pool(judge, slots=2)
    stopped = run_search(pool.search(budget(candidates=2), held=lambda o: o.held, decide=decide))
    [(name, at)] = decided
    c1 = next(o for o in pool.reported if o.name == "c1")
    assert name == "c0" and at >= c1.finished
    assert [o.name for o in pool.reported] == ["c1", "c0"] and pool.reported[1].score is None
    assert stopped.reason == "budget of 2 candidates spent"


def test_a_session_budget_counts_calls_being_judged_and_their_gpu_hours():
    from flows.search.stops import SessionBudget

    by_count = SessionBudget(max_candidates=2)
    assert by_count.admit() is None and by_count.admit() is None  # two at once
    assert by_count.admit() == "the session's budget of 2 candidates is spent (0 judged, 2 being judged)"
    by_count.settle(10.0)
    assert "1 judged, 1 being judged" in by_count.admit()

    by_hours = SessionBudget(max_gpu_hours=1.0)
    assert by_hours.admit() is None and by_hours.admit() is None  # nothing measured yet
    by_hours.settle(1200.0)  # 1/3 GPU-h: with the one running, another would make 1.0
    assert by_hours.admit() is None
    by_hours.settle(1200.0)
    why = by_hours.admit()  # 2/3 spent, one running, one more: 4/3
    assert why.startswith("the session's GPU-hour budget of 1: 0.667 spent, 1 being judged")
    assert SessionBudget().admit() is None


def test_the_engine_search_serves_as_many_configurations_at_once_as_the_pool_has_groups():
    from flows.search.engine import groups
    from gpu_pool.pool import Pool as GPUPool

    pool = GPUPool.model_validate({"hosts": [
        {"name": "a", "address": "10.0.0.1", "gpus": [0, 1, 2, 3], "gpu_class": "h100"},
        {"name": "b", "address": "10.0.0.2", "gpus": [0, 1, 2], "gpu_class": "h100"},
        {"name": "c"}]})
    assert groups(pool.slots("h100"), 1) == 7
    assert groups(pool.slots("h100"), 2) == 3  # a: two, b: one (its third GPU alone serves none)
    assert groups(pool.slots("cpu"), 2) == 1  # a CPU host runs every replica on its CPU
