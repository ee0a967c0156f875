"""Diagnostic (docs/BENCHMARKS.md): silu_mul's template against a persistent,
grid-stride variant of its kernel at prefill_2048 of both presets: whether a grid of a few
programs per SM, each looping over blocks, removes the per-call cost that keeps the template
under 88% of copy bandwidth at qwen3-30b-a3b. Timed as the harness times (a CUDA graph over
rotated input sets); every variant is checked against the float64 reference first.

    python3 bench/diagnostics/silu_persistent.py

It refuses to run without a GPU. It has no line for a copy of the same bytes:
bench/diagnostics/fixed_cost.py measures the copy over rotated buffers, so the L2 cannot serve it.
"""
from __future__ import annotations

import sys

if len(sys.argv) > 1:
    raise SystemExit("silu_persistent: takes no arguments")
import torch

if not torch.cuda.is_available():
    raise SystemExit("silu_persistent: needs a CUDA GPU")
import triton
import triton.language as tl

from contract.job import Rules
from engine_templates.models import PRESETS
from engine_templates.ops import OPS
from engine_templates.ops.base import generator
from harness.checks import check_call
from harness.stages import compile_baseline
from harness.timing import Method, median_us, rotation_count


@triton.jit
def _persist(G, U, Y, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start.to(tl.int64) + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=m)


SMS = torch.cuda.get_device_properties(0).multi_processor_count


def persist(block: int, warps: int, per_sm: int):
    def silu_mul(gate, up):
        y = torch.empty_like(gate)
        n = gate.numel()
        _persist[(min(triton.cdiv(n, block), SMS * per_sm),)](gate, up, y, n, BLOCK=block, num_warps=warps)
        return y
    return silu_mul


def main() -> None:
    op, rules = OPS["silu_mul"], Rules()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    method = Method("cuda", rules.warmup_ms, rules.rep_ms, graph=True)
    for preset in ("qwen3-30b-a3b", "qwen3-8b"):
        shape = op.shapes(PRESETS[preset], [], [2048], [])[0]
        nbytes = op.bytes(shape, torch.bfloat16)
        sets = [op.inputs(shape, torch.bfloat16, "cuda", generator("cuda", s), "normal")
                for s in range(rotation_count(nbytes, l2))]
        fresh = op.inputs(shape, torch.bfloat16, "cuda", generator("cuda", 999), "normal")
        compiled = compile_baseline(op, 4)
        compiled(*sets[0])
        tpl = op.templates["flat"]
        fns = {"template": tpl.build(tpl.default), "compile": compiled}
        for block in (1024, 2048, 4096):
            for warps in (4, 8):
                for per_sm in (2, 4, 8, 16):
                    fns[f"persist b{block} w{warps} x{per_sm}"] = persist(block, warps, per_sm)
        print(f"## {preset} {shape.dims} {nbytes / 1e6:.1f} MB, {len(sets)} sets", flush=True)
        for name, f in fns.items():
            if name != "compile":
                r = check_call(op, f, fresh, torch.bfloat16, "cuda", rules.rtol)
                if not r.ok:
                    print(name, "FAILS", r.gate, r.detail)
                    continue
            us = median_us(f, sets, method).us
            print(f"{name:28s} {us:7.2f} us  {nbytes / us / 1e6:.2f} TB/s  {100 * nbytes / us / 4.25e6:.0f}% of 4.25",
                  flush=True)


if __name__ == "__main__":
    main()
