"""The three stages as they run inside the sandbox: compile, check, bench.

The supervisor (harness/supervisor.py) decides what to run — which seeds, which input sets
— and judges the values; these functions call the candidate, check what only its own
process can see (output form, inputs, threads, timers), time it, and report every output
the supervisor must judge through `send`. A stage stops at its first failed gate.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from contract.job import Job, Shape
from engine_templates.ops.base import activation_dtype, generator
from harness import integrity, timing
from harness.checks import run_call

# Bound as this module's globals, as in harness/timing.py: a builtin swapped in the builtins
# module (`min` picks the hidden-work round) does not reach this process's decisions.
len, min, sorted, zip, enumerate, isinstance, any = len, min, sorted, zip, enumerate, isinstance, any  # noqa: A001

Send = Callable[..., None]
# Hidden-work cross-check on a GPU (timing.host_rounds): in at least one round, the wall time
# per call (device-wide synchronize at the end) may exceed the event median by launch overhead,
# not by more.
HOST_SLACK_RATIO, HOST_SLACK_US = 1.5, 40.0
_MEMORY_WORDS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def shapes_by_label(job: Job) -> dict[str, Shape]:
    return {s.label: s for s in [*job.shapes, *job.odd_shapes]}


def describe_exception(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames)
                  if "candidate" in f.filename or "templates" in f.filename), "")
    return f"{type(e).__name__}: {e}".strip()[:600] + (f" (at {where})" if where else "")


def failure_gate(e: BaseException, default: str) -> str:
    """`memory` for an allocation the limits refused, else `default`."""
    if isinstance(e, MemoryError) or any(w in str(e).lower() for w in _MEMORY_WORDS):
        return "memory"
    return default


def compile_stage(job: Job, op, fn, dev: str, plan: dict, send: Send) -> None:
    """Call once on every shape: JIT compilation and autotuning happen here, not in timing."""
    dtype = activation_dtype(job.rules.dtype)
    t = time.perf_counter()
    for shape in [*job.shapes, *job.odd_shapes]:
        send("compiling", shape=shape.label)  # what a stage stopped at its limit was doing
        args = op.inputs(shape, dtype, dev, generator(dev, 0), "normal")
        try:
            result = run_call(op, fn, args, dtype, dev)
        except Exception as e:
            send("gate", name=failure_gate(e, "compile"), passed=False, detail=f"{shape.label}: {describe_exception(e)}")
            return
        if not result.ok and result.gate == "hidden_work":
            send("gate", name=result.gate, passed=False, detail=f"{shape.label}: {result.detail}")
            return
    send("gate", name="compile", passed=True,
         detail=f"warmed {len(job.shapes) + len(job.odd_shapes)} shapes in {time.perf_counter() - t:.1f} s")


def check_stage(job: Job, op, fn, dev: str, plan: dict, send: Send) -> None:
    """Each planned call on fresh inputs drawn from the supervisor's seed; outputs go to it."""
    dtype, shapes = activation_dtype(job.rules.dtype), shapes_by_label(job)
    for i, call in enumerate(plan["calls"]):
        where = f"{call['shape']} ({call['dist']} inputs, seed {call['seed']})"
        args = op.inputs(shapes[call["shape"]], dtype, dev, generator(dev, call["seed"]), call["dist"])
        try:
            result = run_call(op, fn, args, dtype, dev)
        except Exception as e:
            send("gate", name=failure_gate(e, "runtime"), passed=False, detail=f"{where}: {describe_exception(e)}")
            return
        if not result.ok:
            send("gate", name=result.gate, passed=False, detail=f"{where}: {result.detail}")
            return
        send("outputs", result.outputs, item=f"check/{i}")


def compile_baseline(op, n_shapes: int, backend: str = "inductor", **compile_kw):
    """torch.compile of the op's eager code, specialised to each shape (dynamic=False), with
    room for every shape of the job: past Dynamo's recompile limit (8 by default) a shape would
    run eager code under the torch.compile label. `compile_kw` (a mode, Inductor options) is for
    the diagnostics that compare torch.compile's settings; the harness passes none."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, n_shapes + 1)
    return torch.compile(op.eager, dynamic=False, backend=backend, **compile_kw)


Ready = tuple  # (shape, input sets, timing.Method, the method asked for: "graph", "events" or "wall")


def prepare_shape(job: Job, op, dev: str, item: dict, send: Send, settle: Callable[[], bool]) -> Ready | None:
    """One planned shape's input sets and timing method, once the supervisor has said go (None:
    its answer did not come as sent, and the failed gate was sent). The sets are drawn together
    (`Op.input_sets`: one launch per set and argument for the random draw, the scaling, casting
    and the rest once for all), each the values its seed gives alone, which is how the
    supervisor draws a set again to judge it. All of them before the timings: a graph captures
    one call per set, and events rotate through them all from the warm-up on."""
    shape = shapes_by_label(job)[item["shape"]]
    dtype = activation_dtype(job.rules.dtype)
    arg_sets = op.input_sets(shape, dtype, dev, item["sets"], "normal")
    method = timing.Method(dev, job.rules.warmup_ms, job.rules.rep_ms, graph=item["graph"],
                           min_reps=timing.MIN_REPS if dev == "cuda" else timing.WALL_MIN_REPS)
    if not settle():
        send("gate", name="protocol", passed=False,
             detail=f"{shape.label}: the supervisor's go-ahead to time did not arrive as sent: something "
                    "in the candidate's process read or closed its stdin")
        return None
    return shape, arg_sets, method, "graph" if item["graph"] else "events" if dev == "cuda" else "wall"


def baseline_timings(op, compiled, ready: Ready, send: Send) -> tuple | None:
    """(eager, torch.compile or None) at one prepared shape; None when timing them failed (sent:
    the platform's fault, not the candidate's). What their graphs computed is not judged, nor kept."""
    shape, arg_sets, method, asked = ready
    try:
        eager = replace(timing.median_us(op.eager, arg_sets, method), outputs={})
        comp = replace(timing.median_us(compiled, arg_sets, method), outputs={}) if compiled else None
    except Exception as e:
        send("gate", name="baseline", passed=False, crash=True,
             detail=f"{shape.label}: timing the baselines ({asked}) failed: {describe_exception(e)}")
        return None
    return eager, comp


def bench_stage(job: Job, op, fn, dev: str, plan: dict, send: Send, baselines: dict[str, tuple],
                settle: Callable[[], bool] = lambda: True,
                patched: Callable[[], list[str]] = lambda: []) -> None:
    """Per shape the candidate twice, timed on the same rotated input sets (drawn again from the
    same seeds; by graph, of one capture: timing.timings), and the probes. `baselines`: per shape
    (eager, torch.compile or None), measured before the candidate was loaded (harness/baselines.py),
    so that nothing the candidate does to the process reaches them: a capture that fails leaves
    later graph timings of the process to events, and were that the baselines' too, a candidate
    could choose how torch.compile is timed.
    `settle` returns once the supervisor has judged every output sent so far and its own GPU work
    has finished (False: the answer never came right), so that nothing of the supervisor's runs on
    the GPU while this process times. `patched` names the timers and harness functions the
    candidate has replaced (integrity.Identities.changed): asked after every shape's timings, so
    that a swap undone before the stage ends is caught all the same."""
    dtype = activation_dtype(job.rules.dtype)
    for k, item in enumerate(plan["shapes"]):
        if (ready := prepare_shape(job, op, dev, item, send, settle)) is None:
            return
        shape, arg_sets, method, asked = ready
        eager, comp = baselines[shape.label]
        try:
            cand, cand_2 = timing.timings(fn, arg_sets, method,
                                          [_fresh(op, shape, dtype, dev, seed) for seed in item["timed_refill"]])
            # Only an events timing can miss work left on another stream or thread (a graph
            # replay cannot leave any), so only then is the host's time checked.
            events = "events" in (cand.how, cand_2.how)
            rounds = timing.host_rounds(fn, arg_sets) if events else []
        except Exception as e:
            send("gate", name=failure_gate(e, "runtime"), passed=False,
                 detail=f"{shape.label} while timing ({asked}): {describe_exception(e)}")
            return
        swapped = patched()
        if swapped:
            send("gate", name="timer_integrity", passed=False, detail=f"{shape.label}: {integrity.swapped_detail(swapped)}")
            return
        reused = cand.reused or cand_2.reused
        if reused or cand.misfit or cand_2.misfit:
            send("gate", name="timed_outputs", passed=False,
                 detail=f"{shape.label}: while captured for timing, {reused} returned the same storage — each call "
                        "must return its own output: a result the next call overwrites is lost to its caller, and "
                        "what the earlier call computed cannot be checked" if reused else
                        f"{shape.label}: while timed, {cand.misfit or cand_2.misfit}: what was timed cannot be checked")
            return
        cand_us, cand_us_2 = cand.us, cand_2.us
        if rounds:
            events_us, wall_us = min(rounds, key=lambda r: r[1] - HOST_SLACK_RATIO * r[0])
            if wall_us > HOST_SLACK_RATIO * events_us + HOST_SLACK_US:
                send("gate", name="hidden_work", passed=False,
                     detail=f"{shape.label}: device events say {events_us:.1f} us per call but calls back to "
                            f"back, synchronized device-wide, take {wall_us:.1f} us each (the closest of "
                            f"{len(rounds)} rounds of both): work on another stream or thread finishes after "
                            f"the timer stops (timings: {cand.how} {cand_us:.1f} us, {cand_2.how} {cand_us_2:.1f} us)")
                return
        send("timing", label=shape.label, dims=shape.dims, candidate_us=cand_us, candidate_us_repeat=cand_us_2,
             sets=len(arg_sets), reps=[cand.reps, cand_2.reps], steady=[cand.steady, cand_2.steady],
             method=method_label(cand, cand_2, eager, comp), graph_outputs=len(cand.outputs) + len(cand_2.outputs))
        for run, timed in ((cand.how, cand), (f"{cand_2.how}-repeat", cand_2)):  # what timed calls returned
            for c, outs in timed.outputs.items():
                send("outputs", list(outs), item=f"bench/{k}/{run}{'-refilled' if c == timed.refilled else ''}/{c}")
        if not _probe(op, fn, arg_sets, shape, item, k, dtype, dev, send):
            return
        del arg_sets, cand, cand_2  # before the next shape's sets are drawn


def method_label(cand: timing.Timed, repeat: timing.Timed, eager: timing.Timed, comp: timing.Timed | None) -> str:
    """How each was timed: one word when all agree, else e.g. "graph; eager: events (not
    capturable: …)" — a system that could not be captured in a CUDA graph was timed with events."""
    others = [("repeat", repeat), ("eager", eager), *([("compile", comp)] if comp else [])]
    label = cand.how + (f" (not capturable: {cand.fallback})" if cand.fallback else "")
    for name, t in others:
        if t.how != cand.how:
            label += f"; {name}: {t.how}" + (f" (not capturable: {t.fallback})" if t.fallback else "")
    return label


def _fresh(op, shape: Shape, dtype, dev: str, seed: int) -> tuple:
    """An input set drawn from `seed`, None in place of what the op declares persistent: the new
    values a timed run puts in place of one of its sets between two calls (timing.Refill)."""
    fresh = op.inputs(shape, dtype, dev, generator(dev, seed), "normal")
    return tuple(None if op.is_persistent(i) or not isinstance(a, torch.Tensor) else a for i, a in enumerate(fresh))


def probed_sets(n: int) -> list[int]:
    """The input sets, of `n`, that the probes call the candidate on: the first and the last."""
    return sorted({0, n - 1})


def refill_seed(item: dict, j: int) -> int:
    """The seed of probed set `j`'s new values in a planned shape (ValueError: a set the probes
    do not refill)."""
    return item["refill"][probed_sets(len(item["sets"])).index(j)]


def _probe(op, fn, arg_sets, shape: Shape, item, k, dtype, dev, send: Send) -> bool:
    """Outputs of the timed function on what it was timed on, then after every input the op
    does not declare persistent (`Op.persistent`: weights, constant tables) was refilled in place
    with new values (same storage, pointers and shapes). A cache derived from a persistent
    argument is an honest optimization and survives; one keyed on anything else goes stale. Only
    the probed sets (the first and the last) are drawn anew and refilled: no other is called."""
    probed = probed_sets(len(arg_sets))
    for phase in ("timed", "refill"):
        if phase == "refill":
            for j in probed:
                args = arg_sets[j]
                fresh = op.inputs(shape, dtype, dev, generator(dev, refill_seed(item, j)), "normal")
                for i, (a, b) in enumerate(zip(args, fresh)):
                    if isinstance(a, torch.Tensor) and not op.is_persistent(i):
                        a.copy_(b)
        for j in probed:
            result = run_call(op, fn, arg_sets[j], dtype, dev, poison=False)  # as it was timed
            if not result.ok:
                send("gate", name=result.gate, passed=False, detail=f"{item['shape']} ({phase} set {j}): {result.detail}")
                return False
            send("outputs", result.outputs, item=f"bench/{k}/{phase}/{j}")
    return True
