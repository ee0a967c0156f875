"""Diagnostic (docs/BENCHMARKS.md): what a call's time is made of at the prefill
shapes where a norm misses 88% of copy bandwidth, beside a device copy of the same bytes.

    python3 bench/diagnostics/fixed_cost.py

For each shape, four functions move the same bytes: `memcpy` (torch's clone of a bf16 buffer of
half the op's bytes: a copy node in the graph), `triton copy` (the same copy as a Triton kernel),
the op's template default and torch.compile of its eager form. Each is timed four ways:
- `harness`: harness.timing.median_us, as the flow times it (a CUDA graph of one call per input
  set, the sets rotated past twice the L2; the median replay divided by the set count);
- `replays`: the same graph, R replays back to back between one pair of events (R x sets >= 32);
- `passes`: a graph of R passes over the sets, timed by median_us: the graph's launch shared by
  R times as many calls. The harness does not do this: a pass calls the function again on
  storage it has seen, which the caching gate forbids (../shared/GAUNTLET.md);
- `kernel`: CUPTI device time of the kernels alone, measured after every other timing of the run
  (the profiler stays attached once started, and its callbacks would cost the later launches).
From these: launch/replay = (harness - passes) x sets, the graph launch's cost to one replay;
boundary = passes - kernel, what one call costs beyond its own kernel inside a graph.
Percentages are of the copy bandwidth engine_templates.ceilings.measure reports in the same process.
"""
from __future__ import annotations

import math
import statistics
import sys

if len(sys.argv) > 1:
    raise SystemExit("fixed_cost: takes no arguments (the shapes are fixed; see its docstring)")

sys.path.insert(0, "bench")
import torch

if not torch.cuda.is_available():
    raise SystemExit("fixed_cost: needs a CUDA GPU")
import triton
import triton.language as tl
from points_probe import kernel_us

from contract.job import Rules
from engine_templates.ceilings import measure
from engine_templates.models import PRESETS
from engine_templates.ops import OPS
from engine_templates.ops.base import generator
from harness.stages import compile_baseline
from harness.timing import Method, median_us, rotation_count

SHAPES = [("rmsnorm", "qwen3-8b", 2048), ("fused_add_rmsnorm", "qwen3-8b", 2048),
          ("silu_mul", "qwen3-30b-a3b", 2048), ("silu_mul", "qwen3-8b", 2048), ("rmsnorm", "qwen3-8b", 16384)]
CALLS = 32  # calls a sample of `replays` and `passes` covers at least


@triton.jit
def _copy(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=m), mask=m)


def triton_copy(a):
    y = torch.empty_like(a)
    _copy[(triton.cdiv(a.numel(), 2048),)](a, y, a.numel(), BLOCK=2048, num_warps=8)
    return y


def replays_us(fn, arg_sets, r: int, method: Method, samples: int = 60) -> float:
    """One call per set captured in a graph, as the harness does; a sample is r replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kept = [fn(*args) for args in arg_sets]  # noqa: F841 - the outputs live as long as the graph
    graph.replay()
    torch.cuda.synchronize()
    end = torch.cuda.Event(enable_timing=True)
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    for _ in range(max(1, int(method.warmup_ms / max(start.elapsed_time(end), 1e-3)))):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    torch.cuda.synchronize()
    for s, e in zip(starts, ends):
        s.record()
        for _ in range(r):
            graph.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3 / (r * len(arg_sets))


def main() -> None:
    rules, dtype = Rules(), torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    method = Method("cuda", rules.warmup_ms, rules.rep_ms, graph=True)
    ceiling = measure("cuda")["copy_bytes_per_s"]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy ceiling {ceiling / 1e12:.3f} TB/s (engine_templates.ceilings.measure); L2 {l2 / 1e6:.1f} MB", flush=True)
    cases = []
    for opname, preset, tokens in SHAPES:
        op = OPS[opname]
        shape = op.shapes(PRESETS[preset], [], [tokens], [])[0]
        nbytes = op.bytes(shape, dtype)
        n = rotation_count(nbytes, l2)
        r = math.ceil(CALLS / n)
        sets = [op.inputs(shape, dtype, "cuda", generator("cuda", s), "normal") for s in range(n)]
        halves = [(torch.randn(nbytes // 4, device="cuda", generator=generator("cuda", 100 + s)).to(dtype),)
                  for s in range(n)]
        compiled = compile_baseline(op, 1)
        compiled(*sets[0])
        tpl = next(iter(op.templates.values()))
        fns = {"memcpy": (lambda a: a.clone(), halves), "triton copy": (triton_copy, halves),
               "template": (tpl.build(tpl.default), sets), "torch.compile": (compiled, sets)}
        times = {name: (median_us(f, s, method).us, replays_us(f, s, r, method), median_us(f, s * r, method).us)
                 for name, (f, s) in fns.items()}
        cases.append((f"{opname} {preset} prefill_{tokens}", nbytes, n, r, fns, times))
        print(f"timed {cases[-1][0]}", flush=True)
    for label, nbytes, n, r, fns, times in cases:
        pct = lambda us: 100 * nbytes / (us * 1e-6) / ceiling  # noqa: E731
        print(f"\n## {label}: {nbytes / 1e6:.2f} MB a call, {n} input sets, R = {r}")
        print(f"{'':14s} {'harness':>15s} {'replays':>15s} {'passes':>15s} {'kernel':>15s} "
              f"{'launch/replay':>14s} {'boundary':>9s}")
        for name, (f, s) in fns.items():
            h, rep, passes = times[name]
            k = sum(kernel_us(f, s).values())
            cols = " ".join(f"{us:7.2f} ({pct(us):3.0f}%)" for us in (h, rep, passes, k))
            print(f"{name:14s} {cols} {(h - passes) * n:11.2f} us {passes - k:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
