"""silu_mul at decode shapes, where the flat template trailed torch.compile (qwen3-30b-a3b batch
32: every candidate 2.12-2.16 us against 1.84, docs/BENCHMARKS.md): the template
(64-bit offsets, always masked) against a variant (even32: 32-bit offsets, no mask when the block
divides the tensor) over blocks and warps, with eager and torch.compile in the same run.

torch.compile here is one compiled object called at every shape in turn, as a user would: the
first shape compiles with static sizes, and the recompile at the second marks the sizes dynamic
(torch's automatic dynamic shapes). The harness instead compiles with dynamic=False, so that each
shape has a kernel specialised to its sizes; the probe times that too ("static"), prints the
Triton source inductor wrote for it (--code), and for the best flat candidate and both compiles
gives the kernels' own device time from the profiler (CUPTI), so that a gap between two timings
can be told apart as kernel time or launch time.

Timed as the harness times candidates (harness.timing.median_us) and back to back ("ahead",
see decode_attention_probe.py). Every line's output is checked against the op's reference.

Usage (a GPU host, repo root): python3 bench/silu_mul_probe.py [--preset qwen3-30b-a3b]
    [--batches 1,8,32,128] [--code]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl
from decode_attention_probe import ahead_us
from points_probe import kernel_us
from torch._inductor.utils import run_and_get_code

from engine_templates.models import PRESETS
from engine_templates.ops.base import generator
from engine_templates.ops.silu_mul import FLAT_TEMPLATE, OP
from harness.checks import rel_error
from harness.stages import compile_baseline
from harness.timing import Method, median_us, rotation_count


@triton.jit
def _even32(G, U, Y, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        g = tl.load(G + offs).to(tl.float32)
        u = tl.load(U + offs).to(tl.float32)
        tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty))
    else:
        g = tl.load(G + offs, mask=offs < n, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=offs < n)


def even32(block: int, num_warps: int):
    def silu_mul(gate, up):
        n = gate.numel()
        assert n + block < 2**31, "32-bit offsets"
        y = torch.empty_like(gate)
        _even32[(triton.cdiv(n, block),)](gate, up, y, n, BLOCK=block, EVEN=n % block == 0,
                                          num_warps=num_warps)
        return y
    return silu_mul


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--code", action="store_true", help="print the static compile's kernel source")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("silu_mul_probe: needs a CUDA GPU")
    dev, l2 = "cuda", torch.cuda.get_device_properties(0).L2_cache_size
    method = Method(dev, warmup_ms=25.0, rep_ms=200.0, graph=True)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    shapes = OP.shapes(PRESETS[a.preset], [int(b) for b in a.batches.split(",")], [], [])
    static = compile_baseline(OP, len(shapes) + 2)  # the harness's; room for the dynamic one's two
    compiled = torch.compile(OP.eager)
    for shape in shapes:
        sets = rotation_count(OP.bytes(shape, torch.bfloat16), l2)
        arg_sets = [OP.inputs(shape, torch.bfloat16, dev, generator(dev, s), "normal") for s in range(sets)]
        want = OP.reference(*arg_sets[-1])
        print(f"\n## {a.preset} {shape.label} {shape.dims}: {sets} input sets rotated")

        def show(name, fn):
            t = median_us(fn, arg_sets, method)
            got = t.outputs[len(arg_sets) - 1][0] if t.outputs else fn(*arg_sets[-1])
            e = rel_error(got, want)
            print(f"{name:44s} {t.us:7.2f} us   ahead {ahead_us(fn, arg_sets):7.2f} us  rel.err {e:.1e}"
                  + ("  WRONG" if e > 1e-2 else ""), flush=True)
            return t.us

        if a.code:
            _, sources = run_and_get_code(static, *arg_sets[0])
            print("\n".join(f"    | {line}" for src in sources for line in src.splitlines()))
        show("eager", OP.eager)
        show("torch.compile(eager)", compiled)
        show("torch.compile(eager, dynamic=False)", static)
        best = (float("inf"), None, "")
        for block, warps in itertools.product([256, 512, 1024, 2048], [1, 2, 4, 8]):
            fn = FLAT_TEMPLATE.build({"block": block, "num_warps": warps, "num_stages": 1})
            us = show(f"flat block={block},num_warps={warps}", fn)
            if us < best[0]:
                best = (us, fn, f"flat block={block},num_warps={warps}")
            show(f"even32 block={block},num_warps={warps}", even32(block, warps))
        for name, fn in [(best[2], best[1]), ("torch.compile(eager)", compiled),
                         ("torch.compile(eager, dynamic=False)", static)]:
            print(f"kernel time {name:38s} " + ", ".join(
                f"{k} {us:.2f} us" for k, us in kernel_us(fn, arg_sets).items()), flush=True)


if __name__ == "__main__":
    main()
