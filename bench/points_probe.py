"""Chosen points of an op's template against eager and torch.compile, shape by shape, timed as
the harness times candidates: what a flow's search would find there, without a flow's cost
(a flow spends ~50 s a candidate on process start, compile and checks; a point here is timed in
about a second).

For each shape of the op at the preset: eager; torch.compile of eager with dynamic=False (as the
harness compiles its baseline: a kernel specialised to each shape); then every point of the
grid, the template's default for the parameters the grid leaves out. Each line is checked first
(harness.checks.check_call on a fresh input: output form, inputs left alone, relative error to
the float64 reference within the harness's bf16 tolerance; the baselines are not checked, as
in the harness) and then timed with
harness.timing.median_us (a CUDA graph of one call per input set, the sets rotated past twice
the L2, the median of the replays), the harness's default warm-up and repetition times. After
the grid, the fastest point and torch.compile are run under the profiler: the kernels' own
device time (CUPTI), without the gaps between launches, tells a kernel slower than another from
a launch that is.

Usage (a GPU host, repo root):
    python3 bench/points_probe.py --op rmsnorm --preset qwen3-8b --batches 1,8,32,128
        [--prefill 2048,16384] [--contexts 4096] [--template rows]
        [--grid "num_warps=2,4,8,16 block_n=0,1024"] [--copy-tbps 4.25]
Prints per shape one line per variant: µs, % of the roofline bytes at --copy-tbps (default the
an H200 measured 4.25 TB/s), and the ratio torch.compile / it (>1: faster).
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch
import triton

from contract.job import Rules
from engine_templates.models import PRESETS
from engine_templates.ops import OPS
from engine_templates.ops.base import generator
from harness.checks import check_call
from harness.stages import compile_baseline
from harness.timing import Method, median_us, rotation_count


def parse_grid(text: str, space: dict) -> dict[str, list]:
    """ "num_warps=4,8 block_n=0" -> {"num_warps": [4, 8], "block_n": [0]}, each value one of
    the template's."""
    grid = {}
    for part in text.split():
        key, _, values = part.partition("=")
        if key not in space:
            raise SystemExit(f"points_probe: {key!r} is not a parameter of the template "
                             f"(its space: {', '.join(space)})")
        allowed = {str(v): v for v in space[key]}
        picked = []
        for v in values.split(","):
            if v not in allowed:
                raise SystemExit(f"points_probe: {key}={v} is outside the template's space "
                                 f"({', '.join(allowed)})")
            picked.append(allowed[v])
        grid[key] = picked
    return grid


def kernel_us(fn, arg_sets, rounds: int = 5) -> dict[str, float]:
    """Mean device time of each kernel fn launches (CUPTI, through torch.profiler), over
    `rounds` passes over the input sets; launch gaps between kernels are not in it."""
    for args in arg_sets:
        fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            for args in arg_sets:
                fn(*args)
        torch.cuda.synchronize()
    return {e.key[:40]: e.device_time_total / e.count for e in prof.key_averages()
            if e.device_time_total > 0 and e.count >= rounds * len(arg_sets) // 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", required=True, help=f"one of {', '.join(OPS)}")
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--batches", default="1,8,32,128", help="decode batches ('' for none)")
    ap.add_argument("--prefill", default="", help="prefill token counts, e.g. 2048,16384")
    ap.add_argument("--contexts", default="", help="attention context lengths, e.g. 4096")
    ap.add_argument("--template", default="", help="default: the op's first")
    ap.add_argument("--grid", default="", help='e.g. "num_warps=4,8 block_n=0,1024"; default: the template default alone')
    ap.add_argument("--copy-tbps", type=float, default=4.25)
    a = ap.parse_args()
    if a.op not in OPS:
        raise SystemExit(f"points_probe: no op {a.op!r}; the ops are {', '.join(OPS)}")
    if a.preset not in PRESETS:
        raise SystemExit(f"points_probe: no preset {a.preset!r}; the presets are {', '.join(PRESETS)}")
    op = OPS[a.op]
    template = op.templates[a.template or next(iter(op.templates))]
    grid = parse_grid(a.grid, template.space)
    points = [dict(template.default, **dict(zip(grid, values))) for values in itertools.product(*grid.values())]
    if torch.cuda.is_available():
        dev, l2, gpu = "cuda", torch.cuda.get_device_properties(0).L2_cache_size, torch.cuda.get_device_name()
    elif os.environ.get("TRITON_INTERPRET") == "1":  # a smoke run of the probe itself; times mean nothing
        dev, l2, gpu = "cpu", 1 << 20, "CPU (Triton interpreter: wall-clock times, not a GPU's)"
    else:
        raise SystemExit("points_probe: needs a CUDA GPU (or TRITON_INTERPRET=1 for a CPU smoke run)")

    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    dtype, rules = torch.bfloat16, Rules()
    method = Method(dev, rules.warmup_ms, rules.rep_ms, graph=True)
    print(f"# {gpu}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{a.op} template {template.name!r} at {a.preset}; roofline at {a.copy_tbps} TB/s")
    shapes = op.shapes(PRESETS[a.preset], ints(a.batches), ints(a.prefill), ints(a.contexts))
    # The harness's baseline; on a CPU smoke run Dynamo without Inductor (no C++ toolchain needed).
    compiled = compile_baseline(op, len(shapes), backend="inductor" if dev == "cuda" else "eager")
    for shape in shapes:
        nbytes = op.bytes(shape, dtype)
        sets = rotation_count(nbytes, l2)
        arg_sets = [op.inputs(shape, dtype, dev, generator(dev, s), "normal") for s in range(sets)]
        fresh = op.inputs(shape, dtype, dev, generator(dev, 10_000), "normal")
        warm = op.inputs(shape, dtype, dev, generator(dev, 10_001), "normal")
        ideal_us = nbytes / (a.copy_tbps * 1e12) * 1e6
        print(f"\n## {shape.label} {shape.dims}: {nbytes / 1e6:.2f} MB a call, {sets} input sets "
              f"({sets * nbytes / l2:.1f}x L2)", flush=True)
        timed: dict[str, float] = {}

        def show(name, fn, check=True):
            fn(*warm)  # compiles
            checked = check_call(op, fn, fresh, dtype, dev, rules.rtol) if check else None
            if checked and not checked.ok:
                print(f"{name:64s} fails the check: {checked.gate}: {checked.detail}", flush=True)
                return
            us = timed[name] = median_us(fn, arg_sets, method).us
            vs = f"   {timed['torch.compile'] / us:5.2f}x compile" if "torch.compile" in timed else ""
            print(f"{name:64s} {us:8.2f} us ({100 * ideal_us / us:3.0f}%){vs}", flush=True)

        # The baselines are not checked, as in the harness: the check's poisoned allocations
        # would cost torch.compile a recompile a shape, and Inductor's worker threads, started
        # by the first compile, would read as hidden work.
        show("eager", op.eager, check=False)
        show("torch.compile", compiled, check=False)
        fns = {}
        for point in points:
            name = f"{template.name}[{','.join(f'{k}={v}' for k, v in sorted(point.items()))}]"
            fns[name] = template.build(point)
            show(name, fns[name])
        best = min((n for n in timed if n in fns), key=timed.get, default=None)
        if best is None or dev != "cuda":
            continue
        vs = f", {timed['torch.compile'] / timed[best]:.2f}x torch.compile" if "torch.compile" in timed else ""
        print(f"best {best} {timed[best]:.2f} us{vs}", flush=True)
        for name, fn in [(best, fns[best]), ("torch.compile", compiled)]:
            print(f"kernel time {name:44s} " + ", ".join(
                f"{k} {us:.2f} us" for k, us in kernel_us(fn, arg_sets).items()), flush=True)


if __name__ == "__main__":
    main()
