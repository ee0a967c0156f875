"""fused_moe at prefill token counts: the engine's paths for a call of more than 64 tokens, side by
side, against the matmul-FLOP bound at the matmul rate measured in the same process.

- `torch grouped`: eager's grouped_moe (two torch._grouped_mm), what the engine runs by default;
- `triton grouped`: the Triton grouped GEMMs (engine_templates/ops/fused_moe/grouped.py) at each
  --points point (`engine serve --moe-prefill triton` runs the first);
- with --fp8, the same experts in e4m3 with 128 x 128 block scales: `fp8 dequant + torch grouped`
  (what the engine does today for FP8 experts above 64 tokens: the layer's experts dequantized
  whole, then torch's grouped GEMMs) and `fp8 triton grouped` (the e4m3 experts read in the kernel).

Each line is checked first against the op's loop path in float32 (one matmul per expert; the
float64 reference would not fit at these sizes): relative error in the table. Then it is
timed with CUDA events: the median of --reps calls after three warm-up calls. Inputs are the op's
own (engine_templates/ops/fused_moe): every token's top_k experts spread evenly over the experts.

Usage (a GPU host, repo root): python3 bench/moe_prefill_probe.py [--preset qwen3-30b-a3b]
    [--tokens 128,512,2048,8192] [--fp8] [--points "64,64,64,4,3 128,128,64,8,3"] [--reps 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from contract.job import Shape
from engine_templates.ceilings import measure
from engine_templates.engine.fp8 import quantize
from engine_templates.hf_config import model_dims
from engine_templates.ops.fused_moe import OP, grouped_moe, loop_moe
from engine_templates.ops.fused_moe.grouped import DEFAULT, launch
from harness.checks import rel_error

KEYS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def probe(dims, tokens: int, points: list[dict], rate: float, fp8: bool, reps: int) -> None:
    """The table's lines at one token count."""
    shape = Shape(f"prefill_{tokens}", {"tokens": tokens, "hidden": dims.hidden, "inter": dims.intermediate,
                                        "experts": dims.experts, "top_k": dims.experts_per_token})
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, logits, w_gu, w_d, top_k, renorm = OP.inputs(shape, torch.bfloat16, "cuda", gen, "normal")
    bound_ms = OP.flops(shape) / rate * 1e3
    want = loop_moe(x.float(), logits.float(), w_gu.float(), w_d.float(), top_k, renorm)
    lines = [("torch grouped", lambda: grouped_moe(x, logits, w_gu, w_d, top_k, renorm), want)]
    for p in points:
        lines.append((f"triton grouped {','.join(str(p[k]) for k in KEYS)}",
                      lambda p=p: launch(x, logits, w_gu, None, w_d, None, top_k, renorm, **p), want))
    if fp8:
        gu, d = quantize(w_gu.float(), (128, 128)), quantize(w_d.float(), (128, 128))
        want8 = loop_moe(x.float(), logits.float(), gu.dequantize(torch.float32), d.dequantize(torch.float32), top_k,
                         renorm)
        lines.append(("fp8 dequant + torch grouped", lambda: grouped_moe(
            x, logits, gu.dequantize(torch.bfloat16), d.dequantize(torch.bfloat16), top_k, renorm), want8))
        for p in points:
            lines.append((f"fp8 triton grouped {','.join(str(p[k]) for k in KEYS)}",
                          lambda p=p: launch(x, logits, gu.q, gu.scale, d.q, d.scale, top_k, renorm, **p,
                                             gu_block=gu.block, d_block=d.block), want8))
    for name, fn, ref in lines:
        try:
            err = rel_error(fn(), ref)
            ms = median_ms(fn, reps)
        except Exception as e:  # noqa: BLE001 - a point Triton cannot build here: say so, time the rest
            print(f"| {tokens} | {name} | error: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | |")
            continue
        print(f"| {tokens} | {name} | {ms:.3f} | {bound_ms / ms:.1%} | {err:.2g} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="128,512,2048,8192")
    ap.add_argument("--points", default=",".join(str(DEFAULT[k]) for k in KEYS) + " 128,128,64,8,3 64,128,64,4,4",
                    help="block_m,block_n,block_k,num_warps,num_stages points, space-separated")
    ap.add_argument("--fp8", action="store_true", help="also the e4m3 experts' paths")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dims = model_dims(args.preset)
    if not dims.is_moe:
        sys.exit(f"moe_prefill_probe: {args.preset} is dense; name a mixture-of-experts preset")
    if not torch.cuda.is_available():
        sys.exit("moe_prefill_probe: needs a CUDA GPU")
    points = [dict(zip(KEYS, map(int, p.split(",")))) for p in args.points.split()]
    rate = measure("cuda")["matmul_flops_per_s"]
    print(f"## fused_moe prefill, {args.preset}: {torch.cuda.get_device_name()}, matmul {rate / 1e12:.0f} TFLOP/s "
          f"measured here\n")
    print("| tokens | path | ms | % of the FLOP bound | rel. error |\n|---:|---|---:|---:|---:|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        probe(dims, tokens, points, rate, args.fp8, args.reps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
