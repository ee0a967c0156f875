"""Timing one callable the way a kernel engineer would accept.

On a GPU: warm-up excluded, device events, the median of as many runs as the confidence rule
asks (`until_steady`: at least ten, until the median is known within 0.5%, or a time cap), inputs
rotated across several sets so that L2 does not serve repeats, and CUDA-graph replay for every shape whose
roofline is under a millisecond (`by_graph`), so that host time between launches is not timed.
On a CPU (the Triton interpreter) the numbers are wall-clock and say nothing about a GPU; the
verdict marks them so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Sequence

import torch

from harness.timed_outputs import (  # noqa: F401,E501
    GRAPH_CHECKS,
    Kept,
    Refill,
    Toggle,
    checked_sets,
    refill_point,
    reused_storage,
    tensors,
)

# Every timer and reduction a measurement goes through is bound here, at import, before any
# candidate exists (docs/gates.md, timer patching): a candidate that swaps one on its
# module or class (`statistics.median`, `torch.cuda.Event.elapsed_time`, `torch.cuda.synchronize`)
# does not steer a figure, even if it puts the original back before the identity check
# (harness/integrity.py) looks. The events are recorded on a stream named here, not on whatever
# `torch.cuda.current_stream` returns when they are recorded. The builtins this module calls are
# bound as its own globals, which Python looks up before the builtins module: `print.__self__`
# reaches that module without an import, and a `len` or `sorted` swapped there would otherwise
# divide or order every figure. For the same reason the median is computed here, not by
# `statistics.median`, which calls the builtins' `sorted`.
len, sorted, zip, range, enumerate, min, max, int, iter, next, isinstance, tuple, type, all, list = (  # noqa: A001
    len, sorted, zip, range, enumerate, min, max, int, iter, next, isinstance, tuple, type, all, list)


def median(values) -> float:
    data = sorted(values)
    if not data:
        raise ValueError("no timings to take the median of")
    mid = len(data) // 2
    return data[mid] if len(data) % 2 else (data[mid - 1] + data[mid]) / 2

# torch.cuda.synchronize looks up torch._C._cuda_synchronize (and the device context) when
# called; the C function itself is bound here. A CPU build has none, and never synchronizes.
_synchronize = getattr(torch._C, "_cuda_synchronize", torch.cuda.synchronize)
_Event = torch.cuda.Event
_record, _elapsed = torch.cuda.Event.record, torch.cuda.Event.elapsed_time
_wait_event = torch.cuda.Event.synchronize
_replay = torch.cuda.CUDAGraph.replay
_current_stream = torch.cuda.current_stream


def _events(n: int) -> list:
    return [_Event(enable_timing=True) for _ in range(n)]


def _median_elapsed_ms(starts: list, ends: list) -> float:
    return median(_elapsed(s, e) for s, e in zip(starts, ends))


# The confidence rule: how many repetitions a timing runs (docs/gates.md, Timing). At least
# MIN_REPS; then, in rounds that double the count, until the median's 95% interval (order
# statistics, no assumption on the times' distribution: `median_interval`) is within CI_REL of the
# median either way, or until the time cap (`Method.rep_ms` at the first estimate of a
# repetition, as many as fit, and at most 500 graph replays, 2,000 event pairs, 50 wall-clock
# calls). Until 2026-12-07 every timing ran to that cap. The wall clock of a CPU run, whose
# figures say nothing about a GPU, needs only WALL_MIN_REPS.
MIN_REPS = 10
CI_REL = 0.005
Z95 = 1.96
WALL_MIN_REPS = 3


def median_interval(values) -> tuple[float, float]:
    """The median's 95% confidence interval from the order statistics of `values`: the ranks
    n/2 ± 1.96·sqrt(n)/2 (the normal approximation to the binomial), clamped to the data."""
    data = sorted(values)
    n = len(data)
    half = Z95 * n ** 0.5 / 2
    lo, hi = int(n / 2 - half) - 1, -int(-(n / 2 + half) // 1)  # floor - 1, ceil (0-based)
    return data[max(0, lo)], data[min(n - 1, hi)]


def steady(values, min_reps: int = MIN_REPS) -> bool:
    """The confidence rule's stop: at least `min_reps` values, the median's 95% interval within
    CI_REL of the median either way."""
    if len(values) < min_reps:
        return False
    lo, hi = median_interval(values)
    mid = median(values)
    return mid > 0 and (hi - lo) / 2 <= CI_REL * mid


def until_steady(run: Callable[[int, int], list], cap: int, min_reps: int = MIN_REPS) -> tuple[list, bool]:
    """Repetitions in rounds, `run(first, n)` timing repetitions first … first + n - 1 and
    returning their times: `min_reps` first, then each round as many as ran before it, until the
    confidence rule holds (`steady`) or `cap` repetitions ran. (times, whether the rule held)."""
    times: list = []
    target = min(min_reps, cap)
    while True:
        times += run(len(times), target - len(times))
        if steady(times, min_reps):
            return times, True
        if len(times) >= cap:
            return times, False
        target = min(cap, 2 * len(times))


@dataclass(frozen=True)
class Method:
    device: str
    warmup_ms: float
    rep_ms: float  # the time cap of the confidence rule
    graph: bool = False
    min_reps: int = MIN_REPS


# At most this many input sets a shape. Twice an H200's L2 (2 x 60 MiB) is covered down to calls
# of ~60 KB (every decode shape from batch 8 up); below that the sets stay partly in L2, and each
# timing says so (ShapeTiming.l2_cover). It was 64 until 2026-12-03: every call under ~1.9 MB
# (most decode shapes) was then timed on sets that fit in the L2.
ROTATION_CAP = 2048


def by_graph(device: str, roofline_us: float, launch_bound_us: float) -> bool:
    """Whether a shape is timed by CUDA-graph replay (candidate and baselines alike): on a GPU,
    when its roofline is under `launch_bound_us` (Rules, 1 ms). Events time one call between
    two events, and when the host takes longer to issue a call than the device to run it
    (torch.compile's guards and wrapper do the most host work), the device waits between calls
    and the wait is timed too. A graph replay issues every call of a replay at once. Past the
    bound a call keeps the device busy for at least 1 ms, seven times the longest events figure
    seen for torch.compile at these shapes (141 us). On an H200 (docs/BENCHMARKS.md):
    rmsnorm at qwen3-8b prefill_16384, roofline 63 us, timed with events at 67.5-76 us
    for the same kernel and 76-141 us for torch.compile, and by graph at 67.2-67.3 and 76.1-76.7."""
    return device == "cuda" and roofline_us < launch_bound_us


def rotation_count(bytes_per_call: int, l2_bytes: int, cap: int = ROTATION_CAP) -> int:
    """Input sets to rotate through so that their total is at least twice the L2."""
    if bytes_per_call <= 0:
        return 1
    need = -(-2 * l2_bytes // bytes_per_call)
    return max(1, min(cap, need))


@dataclass(frozen=True)
class Timed:
    us: float  # median per call
    how: str  # "graph", "events" or "wall"
    fallback: str = ""  # a graph was asked for and could not be captured: why
    # {call of the timed run: what it returned}, for the calls `checked_sets` drew: call c ran on
    # input set c % len(sets) (a graph captures one call per set; events and the wall clock rotate
    # through them from set 0); a graph's as its last replay left them, the others' copied as
    # each call returned
    outputs: dict = field(default_factory=dict)
    # graph: two captured calls returned the same storage ("calls 3 and 4 of 8"), so the earlier
    # one's values are gone and a call's work cannot be checked: the stage fails `timed_outputs`
    reused: str = ""
    # events or wall clock: a drawn call returned outputs of another form than its warm-up did
    # (named), so they cannot be checked: the stage fails `timed_outputs`
    misfit: str = ""
    # with `fresh` inputs: the key of `outputs` computed on them (-1: none) — the call (events,
    # wall clock) or the input set (graph) that ran on inputs refilled in place inside the run
    refilled: int = -1
    # the confidence rule: repetitions timed (graph replays, calls), and whether the median's
    # interval closed before the time cap
    reps: int = 0
    steady: bool = False


# Set when a capture failed in this process: what is left of it (an allocator pool, perhaps a
# stream) makes later captures unreliable, so every later graph timing here uses events.
_graphs_off = ""


def graphs_off() -> str:
    """Why graph timing is off in this process ('' while it is on)."""
    return _graphs_off


def turn_graphs_off(why: str) -> None:
    """Time later graphs of this process with events, as the baselines it reuses were (`why`:
    what failed to capture where they were measured; '' leaves graphs on)."""
    global _graphs_off
    _graphs_off = _graphs_off or why


def median_us(fn: Callable[..., Any], arg_sets: Sequence[tuple], method: Method,
              fresh: tuple | None = None) -> Timed:
    """The median time per call. A function that cannot be captured in a CUDA graph (host syncs,
    graphs of its own) is timed with events instead — honest code is not rejected for that, and
    launch gaps then count against it — and `fallback` says why; so is every later graph timing
    of the process, whoever it times. `fresh` (the candidate's timings): new values for the
    arguments it does not leave None, put in place of one input set's inside the run (`Refill`)."""
    return timings(fn, arg_sets, method, [fresh])[0]


def timings(fn: Callable[..., Any], arg_sets: Sequence[tuple], method: Method, fresh: list) -> list[Timed]:
    """One timing (`median_us`) per entry of `fresh`, each with its own refill values (or None).
    By graph, one capture serves them all: each timing has its own replays, its own confidence
    rule, its own refilled set and its own judged outputs (NaN-filled again before it), and the
    candidate's code runs once per input set, not once per timing. Events and the wall clock time
    each anew."""
    global _graphs_off
    if method.device != "cuda":
        return [_timed(_cpu_median_us(fn, arg_sets, method, f), "wall") for f in fresh]
    if not method.graph:
        return [_timed(_events_median_us(fn, arg_sets, method, f), "events") for f in fresh]
    if _graphs_off:
        why = f"no graphs in this process after a failed capture ({_graphs_off})"
    else:
        try:
            return [Timed(us, "graph", outputs=outputs, reused=reused, refilled=refilled, reps=reps, steady=held)
                    for us, outputs, reused, refilled, reps, held in _graph_median_us(fn, arg_sets, method, fresh)]
        except Exception as e:  # not capturable; if it fails outside a graph too, that error goes on
            root = e.__context__ if isinstance(e.__context__, Exception) else e  # the call, not capture_end
            why = _graphs_off = f"{type(root).__name__}: {root}".split("\n")[0][:200]
    _synchronize()
    return [_timed(_events_median_us(fn, arg_sets, method, f), "events", fallback=why) for f in fresh]


def _timed(kept: Kept, how: str, fallback: str = "") -> Timed:
    return Timed(kept.us, how, fallback, outputs=kept.outputs(), misfit=kept.misfit, refilled=kept.refilled,
                 reps=kept.reps, steady=kept.steady)


def _cpu_median_us(fn, arg_sets, method: Method, fresh: tuple | None = None) -> Kept:
    """The wall clock's median, over as many calls as the confidence rule asks (`until_steady`)."""
    n_sets = len(arg_sets)
    first = fn(*arg_sets[0])  # warm-up; its outputs are the model of the copies' buffers
    t = perf_counter()
    fn(*arg_sets[1 % n_sets])
    est = max(perf_counter() - t, 1e-9)
    kept = Kept(first, max(method.min_reps, min(50, int(method.rep_ms / 1e3 / est))), arg_sets, fresh)
    del first

    def run(first: int, n: int) -> list:
        times = []
        for c in range(first, first + n):
            args = arg_sets[c % n_sets]
            kept.before(c)  # a refill, before the timer starts
            t = perf_counter()
            out = fn(*args)
            times.append(perf_counter() - t)
            kept.after(c, out, last=c == first + n - 1)
            del out  # freed as every call's is: the next call's allocations see what an unkept one leaves
        return times

    times, kept.steady = until_steady(run, kept.calls, method.min_reps)
    kept.us, kept.reps = median(times) * 1e6, len(times)
    return kept


def host_rounds(fn: Callable[..., Any], arg_sets: Sequence[tuple], reps: int = 10,
                rounds: int = 5) -> list[tuple[float, float]]:
    """(events us, wall us) per call, for each of `rounds` rounds: `reps` calls timed with
    device events (the median), then `reps` calls back to back ended by a device-wide
    synchronize (the mean). Work left on another stream or thread is inside the wall time
    and not the events'. The two halves of a round are milliseconds apart, so whatever else
    loads the host or the device then (another process's kernels) weighs on both."""
    out, stream = [], _current_stream()
    for r in range(rounds):
        starts, ends = _events(reps), _events(reps)
        _synchronize()
        for i, (s, e) in enumerate(zip(starts, ends)):
            _record(s, stream)
            fn(*arg_sets[(r + i) % len(arg_sets)])
            _record(e, stream)
        _synchronize()
        events_us = _median_elapsed_ms(starts, ends) * 1e3
        t = perf_counter()
        for i in range(reps):
            fn(*arg_sets[(r + i) % len(arg_sets)])
        _synchronize()
        out.append((events_us, (perf_counter() - t) / reps * 1e6))
    return out


def _estimate_ms(run_once: Callable[[], None]) -> float:
    (start, end), stream = _events(2), _current_stream()
    _synchronize()
    _record(start, stream)
    for _ in range(5):
        run_once()
    _record(end, stream)
    _wait_event(end)
    return max(_elapsed(start, end) / 5, 1e-4)


def _events_median_us(fn, arg_sets, method: Method, fresh: tuple | None = None) -> Kept:
    n_sets = len(arg_sets)
    counter = iter(range(1 << 62))

    def run_once():
        fn(*arg_sets[next(counter) % n_sets])

    est = _estimate_ms(run_once)
    for _ in range(max(1, int(method.warmup_ms / est))):
        run_once()
    kept = Kept(fn(*arg_sets[0]), max(method.min_reps, min(2000, int(method.rep_ms / est))), arg_sets, fresh)
    stream = _current_stream()
    _synchronize()

    def run(first: int, n: int) -> list:
        starts, ends = _events(n), _events(n)
        for c, (s, e) in enumerate(zip(starts, ends), first):
            args = arg_sets[c % n_sets]
            kept.before(c)  # a refill, queued before the start event
            _record(s, stream)
            out = fn(*args)
            _record(e, stream)
            # copies queued after the end event: on the device, between two timings
            kept.after(c, out, last=c == first + n - 1)
            del out
        _wait_event(ends[-1])
        return [_elapsed(s, e) for s, e in zip(starts, ends)]

    times, kept.steady = until_steady(run, kept.calls, method.min_reps)
    _synchronize()
    kept.us, kept.reps = median(times) * 1e3, len(times)
    return kept


def _graph_median_us(fn, arg_sets, method: Method, fresh: list) -> list[tuple[float, dict, str, int, int, bool]]:
    """Capture one call per input set in a graph; the time per call is a replay over the sets.
    One timing per entry of `fresh`, of the one capture. Each also returns copies of what some
    captured calls returned, as its last replay left them (NaN before its first: an output the
    graph never writes reads as NaN) — the work that was timed, for the judge: the first set's,
    the last's, and up to GRAPH_CHECKS others drawn after its last replay (`checked_sets`), so
    that a function doing less while captured, on however few of the sets, cannot know which of
    them will be looked at. And `reused`: which captured calls returned storage a later one
    returned too (then nothing is kept: their values cannot be checked). With new values (an
    entry of `fresh` not None), one input set drawn after capture is refilled in place between
    timed replays and the run ends on its new values (`Toggle`: the last change falls on a replay
    uniform over the run, however many the confidence rule asks for): a captured call reads its
    inputs when replayed, so its outputs must follow them (`refilled`: that set; its values are
    put back afterwards). Also the replays timed and whether the confidence rule held
    (`until_steady`)."""
    side = torch.cuda.Stream()
    side.wait_stream(_current_stream())
    with torch.cuda.stream(side):  # warm on a side stream, as capture requires
        for args in arg_sets:
            fn(*args)
    _current_stream().wait_stream(side)
    _synchronize()
    graph, capture, before = torch.cuda.CUDAGraph(), torch.cuda.Stream(), _current_stream()
    try:
        with torch.cuda.graph(graph, stream=capture):
            returned = [fn(*args) for args in arg_sets]
    except BaseException:
        _end_failed_capture(graph, capture, before)
        raise
    every = [tensors(r) for r in returned]
    reused = reused_storage(every)
    stream, results, est = _current_stream(), [], 0.0
    for new_values in fresh:
        for outs in every:
            for t in outs:
                if t.is_floating_point():
                    t.fill_(float("nan"))
        if not est:
            est = _estimate_ms(lambda: _replay(graph))  # noqa: F821 (deleted below, after the lambda ran)
            for _ in range(max(1, int(method.warmup_ms / est))):
                _replay(graph)  # noqa: F821
        cap = max(method.min_reps, min(500, int(method.rep_ms / est)))
        refilled = -1 if new_values is None or reused else refill_point(len(arg_sets) + 1) - 1
        toggle = Toggle(Refill(new_values, arg_sets[refilled])) if refilled >= 0 else None
        _synchronize()

        def run(first: int, n: int) -> list:
            starts, ends = _events(n), _events(n)
            for r, (s, e) in enumerate(zip(starts, ends), first):
                if toggle is not None:  # noqa: B023 (called in this iteration only)
                    toggle.before(r)  # noqa: B023 (a change of the refilled set's values, before the start event)
                _record(s, stream)
                _replay(graph)  # noqa: F821 (deleted below, after the last run)
                _record(e, stream)
            _wait_event(ends[-1])
            return [_elapsed(s, e) for s, e in zip(starts, ends)]

        times, held = until_steady(run, cap, method.min_reps)
        if toggle is not None and not toggle.on:  # the last change took the new values out: put them back
            toggle.flip()
            times += run(len(times), 1)
        _synchronize()
        picked = [] if reused else sorted({*checked_sets(len(every)), refilled} - {-1})  # drawn now that it has run
        outputs = {j: tuple(t.clone() for t in every[j]) for j in picked}
        if toggle is not None:
            toggle.refill.take_out()
        results.append((median(times) * 1e3 / len(arg_sets), outputs, reused, refilled, len(times), held))
    del graph, returned, every
    return results


def _end_failed_capture(graph, capture, before) -> None:
    """After an exception inside capture: the caller's stream back, and the capture ended if
    torch's context manager could not end it (it raised before doing so)."""
    torch.cuda.set_stream(before)
    with torch.cuda.stream(capture):
        if torch.cuda.is_current_stream_capturing():
            try:
                graph.capture_end()
            except RuntimeError:
                pass  # the capture was invalidated; ending it is all that was wanted
