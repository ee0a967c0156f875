"""The bench stage's timing rules as plain functions: the confidence rule that decides how many
repetitions a timing runs (harness.timing.until_steady), and what a timing whose times vary on
purpose is reported as."""
from __future__ import annotations

import pytest
import torch

from contract.verdict import ShapeTiming
from harness import timing
from tracking.report import _versus


class Clock:
    """The wall clock of a CPU timing, advanced by what each call says it took: a shared machine
    preempts a busy loop too often for its times to agree within 0.5%."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def spend(self, ms: float) -> None:
        self.t += ms / 1e3


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(timing, "perf_counter", c.now)
    return c


def test_the_median_interval_comes_from_order_statistics():
    """At 10 values the 95% interval spans them all; at 40 it leaves out the 12 lowest and the 12
    highest; at 1 it is the value."""
    assert timing.median_interval(range(10)) == (0, 9)
    assert timing.median_interval(range(40)) == (12, 27)
    assert timing.median_interval(range(20)) == (4, 15)
    assert timing.median_interval([5.0]) == (5.0, 5.0)


def test_the_confidence_rule_needs_ten_values_and_a_narrow_interval():
    steady = [1.0, 1.002, 0.998, 1.001, 0.999] * 2
    assert timing.steady(steady) and not timing.steady(steady[:9])
    assert timing.steady(steady[:3], min_reps=3)
    # One outlier in ten: the interval spans it (half-width 1% of the median); among twenty it
    # no longer counts.
    assert not timing.steady(steady[:9] + [1.02])
    assert timing.steady(steady * 2 + [1.02])
    assert not timing.steady([1.0, 3.0] * 100)  # two modes: never known within 0.5%


def test_until_steady_stops_a_steady_timing_after_ten_and_runs_a_wobbling_one_to_its_cap():
    """Rounds of 10, 10, 20, 40…: a timing steady from the start stops after the first; one whose
    repetitions alternate between two times never narrows its interval and runs to the cap, as
    every timing did before the rule."""
    asked = []

    def steady_run(first, n):
        asked.append((first, n))
        return [1.0 + 1e-4 * ((first + i) % 3) for i in range(n)]

    times, held = timing.until_steady(steady_run, cap=500)
    assert (len(times), held, asked) == (10, True, [(0, 10)])

    asked.clear()

    def wobbling(first, n):
        asked.append((first, n))
        return [(1.0, 3.0)[(first + i) % 2] for i in range(n)]

    times, held = timing.until_steady(wobbling, cap=100)
    assert (len(times), held) == (100, False)
    assert asked == [(0, 10), (10, 10), (20, 20), (40, 40), (80, 20)]
    # Steady only after many: the rule waits for it, and stops at the round that shows it.
    late = [1.0 + (i % 7) * 0.05 for i in range(30)] + [1.0] * 1000
    times, held = timing.until_steady(lambda first, n: late[first:first + n], cap=500)
    assert held and len(times) == 80 and timing.median(times) == 1.0


def test_a_steady_function_is_timed_by_the_wall_clock_in_ten_calls(clock):
    """A function that takes the same time each call stops after ten calls, before the cap (50
    wall-clock calls), at its own time; one whose calls take 1 and 3 ms in turn is timed to the
    cap and said not steady."""
    sets = [(torch.zeros(4),) for _ in range(2)]
    method = timing.Method("cpu", warmup_ms=0, rep_ms=10_000)

    def steady(x):
        clock.spend(2.0)
        return x + 1

    timed = timing.median_us(steady, sets, method)
    assert (timed.steady, timed.reps, round(timed.us, 6)) == (True, 10, 2000.0)

    calls = []

    def wobbles(x):
        calls.append(1)
        clock.spend((1.0, 3.0)[len(calls) % 2])
        return x + 1

    timed = timing.median_us(wobbles, sets, method)
    assert not timed.steady and timed.reps == 50


def test_a_candidate_varying_its_time_on_purpose_gains_no_ratio_from_the_rule(clock):
    """A candidate fast while it is timed once and slow while timed again: each timing's rule stops
    on its own times, the figure is the mean of the two (not the faster), the spread says how far
    they differ, and a ratio to a baseline inside that spread is a tie, as it was before the rule."""
    sets = [(torch.zeros(4),) for _ in range(2)]
    method = timing.Method("cpu", warmup_ms=0, rep_ms=10_000)
    ms = [1.0]

    def two_faced(x):  # told here which timing it is in; a candidate would count its calls
        clock.spend(ms[0])
        return x + 1

    first = timing.median_us(two_faced, sets, method)
    ms[0] = 1.6
    repeat = timing.median_us(two_faced, sets, method)
    baseline = timing.median_us(lambda x: (clock.spend(1.25), x + 1)[1], sets, method)
    t = ShapeTiming("s", {}, candidate_us=first.us, candidate_us_repeat=repeat.us, eager_us=baseline.us,
                    compile_us=baseline.us, roofline_us=1.0, bytes=1, flops=1)
    assert (first.reps, repeat.reps, round(first.us), round(repeat.us)) == (10, 10, 1000, 1600)
    assert round(t.spread, 6) == 0.6 and t.measured_us == (first.us + repeat.us) / 2
    assert _versus(t.compile_us / t.measured_us, t.spread).endswith("tie")


def test_a_graph_run_ends_on_the_refilled_values_whatever_its_length():
    """The graph's in-place refill when the confidence rule decides the run's length: replay r
    (from 1) changes the set's values with chance 1/r, and the run ends on the new values. The
    last change falls on a replay uniform over the run, so a candidate that stops computing from
    some replay on is caught with the chance of the share it skipped, however long the run."""
    from harness.timed_outputs import Refill, Toggle

    own, fresh = torch.arange(4.0), torch.full((4,), -1.0)
    args = (own.clone(),)
    changes = []
    for _ in range(3000):
        toggle, at = Toggle(Refill((fresh,), args)), []
        for r in range(20):
            was = toggle.on
            toggle.before(r)
            at += [r] if toggle.on != was else []
        if not toggle.on:
            toggle.flip()
            at.append(20)
        assert toggle.on and torch.equal(args[0], fresh)
        toggle.refill.take_out()
        assert torch.equal(args[0], own)
        changes.append(at)
    assert all(at[0] == 1 for at in changes)
    for k in (5, 10, 15, 19):  # skipping replays k…20: caught at least with the share skipped
        caught = sum(at[-1] >= k for at in changes) / len(changes)
        assert caught > (21 - k) / 20 - 0.04, (k, caught)
    # the last change drawn (not the closing one) is uniform over replays 1…19
    drawn = [at[-2] if at[-1] == 20 else at[-1] for at in changes]
    assert 0.40 < sum(r >= 10 for r in drawn) / len(drawn) < 0.64


def test_a_refill_moves_to_another_set_and_puts_that_one_back():
    from harness.timed_outputs import Refill

    a, b, fresh = (torch.zeros(3),), (torch.ones(3),), (torch.full((3,), 7.0),)
    refill = Refill(fresh, a)
    refill.put()
    assert torch.equal(a[0], fresh[0])
    refill.take_out()
    refill.put(b)
    assert torch.equal(b[0], fresh[0]) and torch.equal(a[0], torch.zeros(3))
    refill.take_out()
    assert torch.equal(b[0], torch.ones(3))


def test_the_refill_probe_draws_and_refills_only_the_sets_it_probes():
    """The probes call the candidate on the first and the last input set, as timed and refilled:
    only those two are drawn anew and refilled, and the plan holds a seed for each of them only."""
    from contract.job import Shape
    from engine_templates.ops import get_op
    from engine_templates.ops.base import generator
    from harness.stages import _probe, probed_sets, refill_seed

    op, shape = get_op("rmsnorm"), Shape("s", {"tokens": 3, "hidden": 16})
    item = {"shape": "s", "sets": [11, 12, 13, 14], "refill": [21, 24]}
    sets = [op.inputs(shape, torch.float32, "cpu", generator("cpu", s), "normal") for s in item["sets"]]
    before = [tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in s) for s in sets]
    sent = []
    assert _probe(op, op.eager, sets, shape, item, 0, torch.float32, "cpu", lambda *a, **k: sent.append(k["item"]))
    assert probed_sets(4) == [0, 3] and probed_sets(1) == [0]
    assert sent == ["bench/0/timed/0", "bench/0/timed/3", "bench/0/refill/0", "bench/0/refill/3"]
    for j in (1, 2):
        assert torch.equal(sets[j][0], before[j][0])
    for j, seed in ((0, 21), (3, 24)):
        assert refill_seed(item, j) == seed
        new = op.inputs(shape, torch.float32, "cpu", generator("cpu", seed), "normal")
        assert torch.equal(sets[j][0], new[0]) and torch.equal(sets[j][1], before[j][1])  # the weight persists
    with pytest.raises(ValueError):
        refill_seed(item, 1)


def test_calls_on_refilled_inputs_are_kept_only_as_refilled(clock):
    """Every kept call but the refilled one ran on its set's own values: the judge checks each
    kept call against its set's seed, and the refilled one against the new values."""
    sets = [(torch.randn(8),) for _ in range(3)]
    own, fresh = [s[0].clone() for s in sets], (torch.randn(8),)

    calls = []

    def doubles(x):
        calls.append(1)
        clock.spend((1.0, 1.5)[len(calls) % 2])  # never steady: the run goes to its cap
        return x * 2

    for _ in range(5):
        timed = timing.median_us(doubles, sets, timing.Method("cpu", 0, 10_000), fresh)
        assert timed.reps == 50 and timed.refilled >= 1
        for c, (out,) in timed.outputs.items():
            assert torch.equal(out, (fresh[0] if c == timed.refilled else own[c % 3]) * 2), c


def test_outputs_cross_the_staging_buffer_bit_for_bit_and_only_a_header_line_crosses_the_pipe():
    """The sandbox's Sender copies each tensor into the staging buffer and writes one header line
    that says where it lies; the judge copies it out into memory of its own: the same bits arrive,
    in any dtype, larger than a pipe holds, and nothing but the header crosses the pipe. The
    judge's copies stay as they were when the buffer is written again. A header the stream ends
    inside is a CutOff."""
    import io
    import os

    from harness.channel import CutOff, Sender, Stager, Staging, read_frame, staging_size

    big = torch.randn(3, 100_000).to(torch.bfloat16)  # 600 KB: more than a pipe's buffer
    sent = (big, torch.arange(7, dtype=torch.int32), torch.empty(0), torch.tensor(2.5, dtype=torch.float64))
    staging = Staging(os.memfd_create("test-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING),
                      staging_size(sum(t.numel() * t.element_size() for t in sent), len(sent)))
    r, w = os.pipe()
    sender = Sender(w, Stager(staging.fd))
    sender.send("outputs", sent, item="check/0")
    sender._f.close()
    with io.BufferedReader(io.FileIO(r, "rb")) as stream:
        line = stream.peek(1 << 16)
        assert line.count(b"\n") == 1 and line.endswith(b"\n") and len(line) < 1000
        header, got = read_frame(stream, staging)
        assert read_frame(stream, staging) is None
    assert header["item"] == "check/0" and len(got) == len(sent)
    for a, b in zip(sent, got):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    sender.stager.view.fill_(0)  # the buffer reused: the judge's copies are its own
    assert torch.equal(got[0], big) and got[3].item() == 2.5
    with pytest.raises(CutOff):
        read_frame(io.BytesIO(b'{"kind": "outputs", "tensors": [{"dtype": "float32", "shape": [4]}], "nb'), staging)


def test_the_judge_counts_what_is_not_finite_and_measures_the_error_in_float64():
    from engine_templates.ops import get_op
    from harness.checks import judge, rel_error

    op = get_op("silu_mul")
    gate, up = torch.randn(4, 32), torch.randn(4, 32)
    ref = op.reference(gate, up)
    right = ref.to(torch.float32)
    assert judge(op, [right], (gate, up), 1e-6).ok
    off = right.clone()
    off[0, 0] += 1.0
    expected = float((off.double() - ref).norm() / ref.norm())
    result = judge(op, [off], (gate, up), 1e-6)
    assert (result.ok, result.gate) == (False, "accuracy") and result.rel_error == pytest.approx(expected, rel=1e-12)
    assert rel_error(off, ref) == pytest.approx(expected, rel=1e-12)
    holes = right.clone()
    holes[1, :3] = float("nan")
    holes[2, 0] = float("inf")
    result = judge(op, [holes], (gate, up), 1e-2)
    assert (result.ok, result.gate) == (False, "finite")
    assert result.detail == "output has 4 of 128 elements NaN or Inf (unwritten output reads as NaN)"


class _Colliding:
    """Entropy that repeats a low 32-bit word: 5, 5 + 2**32, 7, 7, 9, ..."""

    def __init__(self):
        self.values = iter([5, 5 + (1 << 32), 7, 7, 9, 11 + (3 << 40), 11, 13])

    def getrandbits(self, k):
        return next(self.values)


def test_a_plans_seeds_never_share_the_low_word_a_cpu_generator_seeds_from(monkeypatch):
    """A CPU generator seeds from a seed's low 32 bits only, so two seeds sharing them draw the same
    set: the plan's seeds differ there, also across the lists of one shape and of one plan."""
    from engine_templates.ops.base import generator
    from harness import plan

    a, b = (torch.randn(8, generator=generator("cpu", s)) for s in (5, 5 + (1 << 32)))
    assert torch.equal(a, b)  # why the rule exists
    monkeypatch.setattr(plan, "_seeds", _Colliding())
    taken: set[int] = set()
    assert plan.fresh_seeds(3, taken) == [5, 7, 9]
    assert plan.fresh_seeds(1, taken) == [11 + (3 << 40)]  # 11's low word is taken now
    assert taken == {5, 7, 9, 11}
