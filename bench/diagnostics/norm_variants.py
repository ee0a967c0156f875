"""Diagnostic (docs/BENCHMARKS.md): the norm templates' whole-row kernel against
variants of itself and against torch.compile, timed as the harness times (CUDA graph over rotated
sets) and by CUPTI kernel time.

    python3 bench/diagnostics/norm_variants.py decode        # both presets, both norms, decode batches
    python3 bench/diagnostics/norm_variants.py prefill [N]   # rmsnorm qwen3-8b prefill_16384, N rounds,
                                                             # each by CUDA graph and by events
    python3 bench/diagnostics/norm_variants.py modes         # fused_add_rmsnorm qwen3-8b decode_b8:
                                                             # torch.compile's modes, one process each time

The variants: `base` is the template's kernel as first committed (the weight loaded
after the row's reduction); `hoist` loads the weight with the row, before the reduction, so its
latency overlaps the row's; `evict` is `hoist` with the row's loads marked evict_first and the
weight's evict_last. Each is run at the automatic warp count and, for `hoist`, at 4, 8 and 16.
Every variant is checked against the float64 reference before it is timed.
"""
from __future__ import annotations

import os
import sys
import time

WHAT = sys.argv[1] if len(sys.argv) > 1 else ""
ROUNDS = sys.argv[2] if len(sys.argv) > 2 else "6"
if WHAT not in ("decode", "prefill", "modes"):
    raise SystemExit("norm_variants: say decode, prefill [rounds] or modes")
if WHAT == "prefill" and not (ROUNDS.isdigit() and int(ROUNDS) >= 1):
    raise SystemExit(f"norm_variants: prefill takes a count of rounds (1 or more), not {ROUNDS!r}")

sys.path.insert(0, "bench")
import torch

if not torch.cuda.is_available():
    raise SystemExit("norm_variants: needs a CUDA GPU")
import triton
import triton.language as tl
from points_probe import kernel_us

from contract.job import Rules
from engine_templates.models import PRESETS
from engine_templates.ops import OPS
from engine_templates.ops.base import generator
from engine_templates.ops.rmsnorm.templates import auto_warps
from harness.checks import check_call
from harness.stages import compile_baseline
from harness.timing import Method, median_us, rotation_count


@triton.jit
def _row(X, R, W, Y, R_OUT, n_cols, stride, eps, BLOCK_N: tl.constexpr, ADD: tl.constexpr,
         HOIST: tl.constexpr, EVICT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    m = cols < n_cols
    if HOIST:
        if EVICT:
            w = tl.load(W + cols, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
        else:
            w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    if EVICT:
        x = tl.load(X + row * stride + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(X + row * stride + cols, mask=m, other=0.0).to(tl.float32)
    if ADD:
        if EVICT:
            r = tl.load(R + row * stride + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            r = tl.load(R + row * stride + cols, mask=m, other=0.0).to(tl.float32)
        s = (x + r).to(R_OUT.dtype.element_ty)
        tl.store(R_OUT + row * stride + cols, s, mask=m)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if not HOIST:
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * stride + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=m)


def variant(add: bool, hoist: bool, evict: bool, warps: int):
    def run(x, *rest):
        if add:
            residual, weight, eps = rest
        else:
            (weight, eps), residual = rest, x
        x2 = x.reshape(-1, x.shape[-1])
        n_rows, n_cols = x2.shape
        y = torch.empty_like(x2)
        r_out = torch.empty_like(x2) if add else y
        _row[(n_rows,)](x2, residual.reshape(-1, n_cols), weight, y, r_out, n_cols, x2.stride(0), eps,
                        BLOCK_N=triton.next_power_of_2(n_cols), ADD=add, HOIST=hoist, EVICT=evict,
                        num_warps=warps or auto_warps(n_cols), num_stages=1)
        return (y.view(x.shape), r_out.view(x.shape)) if add else y.view(x.shape)
    return run


def variants(add: bool) -> dict:
    v = {"base": variant(add, False, False, 0), "evict": variant(add, True, True, 0)}
    for w in (0, 4, 8, 16):
        v[f"hoist/{w or 'auto'}"] = variant(add, True, False, w)
    return v


L2 = torch.cuda.get_device_properties(0).L2_cache_size
METHOD = Method("cuda", Rules().warmup_ms, Rules().rep_ms, graph=True)


def sets_for(op, shape):
    n = rotation_count(op.bytes(shape, torch.bfloat16), L2)
    return [op.inputs(shape, torch.bfloat16, "cuda", generator("cuda", i), "normal") for i in range(n)]


def checked(op, shape, name, fn):
    args = op.inputs(shape, torch.bfloat16, "cuda", generator("cuda", 999), "normal")
    result = check_call(op, fn, args, torch.bfloat16, "cuda", Rules().rtol)
    if not result.ok:
        raise SystemExit(f"norm_variants: {name} fails the check at {shape.label}: {result.gate}: {result.detail}")


def compiled(op, **kw):
    # Room for every shape of every op and preset this script compiles in one process.
    return compile_baseline(op, 63, **kw)


def decode() -> None:
    for preset in ("qwen3-8b", "qwen3-30b-a3b"):
        for name in ("fused_add_rmsnorm", "rmsnorm"):
            op = OPS[name]
            comp = compiled(op)
            for shape in op.shapes(PRESETS[preset], [1, 8, 32, 128], [], []):
                sets = sets_for(op, shape)
                comp(*sets[0])
                fns = {"compile": comp, **variants(name == "fused_add_rmsnorm")}
                for n, f in fns.items():
                    if n != "compile":
                        checked(op, shape, n, f)
                us = {n: median_us(f, sets, METHOD).us for n, f in fns.items()}
                ker = {n: sum(kernel_us(fns[n], sets).values()) for n in ("compile", "base", "hoist/auto", "evict")}
                print(preset, name, shape.label, " ".join(f"{n} {v:.2f}" for n, v in us.items()),
                      "| kernel", " ".join(f"{n} {v:.2f}" for n, v in ker.items()), flush=True)


def prefill(rounds: int) -> None:
    op = OPS["rmsnorm"]
    shape = op.shapes(PRESETS["qwen3-8b"], [], [16384], [])[0]
    sets = sets_for(op, shape)
    comp = compiled(op)
    comp(*sets[0])
    nbytes = op.bytes(shape, torch.bfloat16)
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
    copy_sets = [(src, torch.empty_like(src)) for _ in sets]
    fns = {"copy": lambda a, b: b.copy_(a), "compile": comp, "base": variant(False, False, False, 0),
           "hoist": variant(False, True, False, 0), "evict": variant(False, True, True, 0)}
    print("prefill_16384 sets", len(sets), "bytes", nbytes, flush=True)
    # The harness times a shape this large with events (not launch-bound): both ways here.
    events = Method("cuda", METHOD.warmup_ms, METHOD.rep_ms, graph=False)
    for k in range(rounds):
        for how, method in (("graph", METHOD), ("events", events)):
            us = {n: median_us(f, copy_sets if n == "copy" else sets, method).us for n, f in fns.items()}
            print(f"round {k} {how} t={time.time():.1f}", " ".join(f"{n} {v:.1f}" for n, v in us.items()),
                  " ".join(f"{n} {100 * us['copy'] / v:.0f}%" for n, v in us.items() if n != "copy"), flush=True)


def modes() -> None:
    op = OPS["fused_add_rmsnorm"]
    shape = op.shapes(PRESETS["qwen3-8b"], [8], [], [])[0]
    sets = sets_for(op, shape)
    mode = os.environ.get("MODE", "default")
    kw = {"options": {"coordinate_descent_tuning": True}} if mode == "cd" else \
         {"mode": "max-autotune-no-cudagraphs"} if mode == "max" else {}
    t0 = time.time()
    comp = compiled(op, **kw)
    comp(*sets[0])
    build_s = time.time() - t0
    hoist = variant(True, True, False, 0)
    us = {n: median_us(f, sets, METHOD).us for n, f in (("compile", comp), ("hoist", hoist))}
    ker = {n: sum(kernel_us(f, sets).values()) for n, f in (("compile", comp), ("hoist", hoist))}
    print(mode, f"build {build_s:.1f}s", " ".join(f"{n} {v:.2f}" for n, v in us.items()),
          "| kernel", " ".join(f"{n} {v:.2f}" for n, v in ker.items()), flush=True)


if __name__ == "__main__":
    {"decode": decode, "prefill": lambda: prefill(int(ROUNDS)), "modes": modes}[WHAT]()
