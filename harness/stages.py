"""The three stages a candidate goes through on a worker: compile, check, bench.

Each stage is one process (see __main__) and returns one Verdict; the controller merges
them. A later stage repeats the cheap parts of an earlier one it depends on (loading),
never trusts it.
"""
from __future__ import annotations

import itertools
import random
import time
import traceback
from pathlib import Path

import torch

from engine_templates.ops import get_op
from engine_templates.ops.base import DISTRIBUTIONS, DTYPES, generator
from harness import ceilings, device as devices, timing
from harness.checks import check_call
from harness.job import Job
from harness.load import Rejected, load
from harness.verdict import ShapeTiming, Verdict

_fresh_seeds = random.SystemRandom()


def run(job: Job, workdir: Path) -> Verdict:
    t0 = time.perf_counter()
    op = get_op(job.candidate.op)
    v = Verdict(op=op.name, candidate_id=job.candidate.id, stages=[job.stage])
    dev = devices.pick(job.device)
    v.device = devices.describe(dev)
    try:
        fn = load(job.candidate, op, workdir)
    except Rejected as e:
        v.gate(e.gate, False, e.detail)
        return v
    {"compile": _compile, "check": _check, "bench": _bench}[job.stage](job, op, fn, dev, v)
    v.wall_s = time.perf_counter() - t0
    return v


def _describe_exception(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames)
                  if "candidate" in f.filename or "templates" in f.filename), "")
    return f"{type(e).__name__}: {e}".strip() + (f" (at {where})" if where else "")


def _compile(job: Job, op, fn, dev: str, v: Verdict) -> None:
    """Call once on every shape: JIT compilation and autotuning happen here, not in timing."""
    dtype = DTYPES[job.rules.dtype]
    t = time.perf_counter()
    for shape in [*job.shapes, *job.odd_shapes]:
        args = op.inputs(shape, dtype, dev, generator(dev, 0), "normal")
        try:
            fn(*args)
            devices.synchronize(dev)
        except Exception as e:
            v.gate("compile", False, f"{shape.label}: {_describe_exception(e)}")
            return
    v.gate("compile", True, f"warmed {len(job.shapes) + len(job.odd_shapes)} shapes "
                            f"in {time.perf_counter() - t:.1f} s")


def _check(job: Job, op, fn, dev: str, v: Verdict) -> None:
    """Fresh inputs per shape and seed, distributions cycled; stop at the first failure."""
    dtype = DTYPES[job.rules.dtype]
    dists = itertools.cycle(DISTRIBUTIONS)
    worst, calls = 0.0, 0
    for shape in [*job.shapes, *job.odd_shapes]:
        for seed in range(job.rules.seeds):
            dist = next(dists)
            draw = _fresh_seeds.getrandbits(62)  # unpredictable, and printed on failure to reproduce
            args = op.inputs(shape, dtype, dev, generator(dev, draw), dist)
            try:
                result = check_call(op, fn, args, dtype, dev, job.rules.rtol)
            except Exception as e:
                v.gate("runtime", False, f"{shape.label} ({dist} inputs, seed {draw}): {_describe_exception(e)}")
                return
            calls += 1
            worst = max(worst, result.rel_error)
            v.max_rel_error = worst
            if not result.ok:
                v.gate(result.gate, False, f"{shape.label} ({dist} inputs, seed {draw}): {result.detail}")
                return
    v.gate("correctness", True, f"{calls} calls over {len(job.shapes) + len(job.odd_shapes)} shapes; "
                                f"worst relative error {worst:.3g} <= {job.rules.rtol:g}")


def _bench(job: Job, op, fn, dev: str, v: Verdict) -> None:
    dtype = DTYPES[job.rules.dtype]
    ceil = ceilings.ceilings(dev, v.device)
    v.device["ceilings"] = ceil
    compiled = None
    if dev == "cuda" and job.rules.compile_baseline:
        compiled = torch.compile(op.eager, dynamic=False)
    l2 = v.device.get("l2_bytes", 0) if dev == "cuda" else 0
    for shape in job.shapes:
        nbytes, flops = op.bytes(shape, dtype), op.flops(shape)
        n_sets = timing.rotation_count(nbytes, l2) if dev == "cuda" else 2
        gen = generator(dev, 1234)
        arg_sets = [op.inputs(shape, dtype, dev, gen, "normal") for _ in range(n_sets)]
        roofline_us = max(nbytes / ceil["copy_bytes_per_s"], flops / ceil["matmul_flops_per_s"]) * 1e6
        # Where launch overhead rivals the work, every contender is timed by CUDA-graph replay.
        graph = dev == "cuda" and roofline_us < job.rules.launch_bound_us
        method = timing.Method(dev, job.rules.warmup_ms, job.rules.rep_ms, graph=graph)
        how = "graph" if graph else "events" if dev == "cuda" else "wall"
        try:  # the baselines failing is the platform's fault, not the candidate's
            eager_us = timing.median_us(op.eager, arg_sets, method)
            compile_us = timing.median_us(compiled, arg_sets, method) if compiled else None
        except Exception as e:
            v.crash("baseline", f"{shape.label}: timing the baselines ({how}) failed: {_describe_exception(e)}")
            return
        try:
            cand_us = timing.median_us(fn, arg_sets, method)
            cand_us_2 = timing.median_us(fn, arg_sets, method)
        except Exception as e:
            v.gate("runtime", False, f"{shape.label} while timing ({how}): {_describe_exception(e)}")
            return
        v.timings.append(ShapeTiming(shape.label, shape.dims, cand_us, cand_us_2, eager_us, compile_us,
                                     roofline_us, nbytes, flops, how))
        # The timed function must still be right on what it was timed on.
        result = check_call(op, fn, arg_sets[-1], dtype, dev, job.rules.rtol)
        if not result.ok:
            v.gate("timed_outputs", False, f"{shape.label}: {result.detail}")
            return
    _speed_of_light(job, v)


def _speed_of_light(job: Job, v: Verdict) -> None:
    if not v.gpu_timing:
        v.gate("speed_of_light", True, "no GPU timing (CPU / interpreter): not applicable")
        return
    for t in v.timings:
        if t.best_us < t.roofline_us / job.rules.sol_margin:
            v.gate("speed_of_light", False,
                   f"{t.label}: {t.best_us:.2f} us is faster than the measured roofline "
                   f"{t.roofline_us:.2f} us allows ({100 * t.roofline_us / t.best_us:.0f}% of roofline)")
            return
    v.gate("speed_of_light", True, f"every shape within {job.rules.sol_margin:g}x of the measured roofline")
