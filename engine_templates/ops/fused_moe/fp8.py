"""The fp8 target of fused_moe: the experts in e4m3 with one float32 scale per 128 x 128 block of
each expert's matrix (engine_templates/ops/fp8.py), bf16 activations; judged against the bf16
fused_moe on the experts before quantization.

    fused_moe(x, router_logits, w_gate_up, w_gate_up_scale, w_down, w_down_scale, top_k, renormalize):
    w_gate_up [experts, 2 * inter, hidden] e4m3, w_gate_up_scale [experts, ceil(2 * inter / 128),
    ceil(hidden / 128)] float32; w_down [experts, hidden, inter] e4m3, w_down_scale [experts,
    ceil(hidden / 128), ceil(inter / 128)] float32; the rest as fused_moe's -> new bf16 tensor like x

The gate and up rows are quantized as the one stacked matrix the engine keeps (at every Qwen3
size the intermediate width is a whole number of blocks, so no block mixes gate and up rows).

The PyTorch baseline is what the engine does without a kernel for it (engine/fp8.py
fused_moe_fp8): with few tokens (tokens * top_k <= experts) the routed experts alone gathered,
dequantized and multiplied in one batch; with more, every expert dequantized and fused_moe's own
eager. The fewest bytes a call moves count the experts it reads at one byte a weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_templates.ops.base import Template
from engine_templates.ops.fp8 import Fp8Op, dequantize
from engine_templates.ops.fused_moe import GEMV_TEMPLATE, route
from engine_templates.ops.fused_moe import OP as FUSED_MOE

GEMV_FP8_TEMPLATE = Template(
    name="gemv",
    module="engine_templates.ops.fused_moe.fp8_templates",
    # tiles of the hidden (pass 1) and intermediate (pass 2) columns inside one block column of scales
    space={**GEMV_TEMPLATE.space, "block_h": [32, 64, 128], "block_k": [32, 64, 128]},
    default={**GEMV_TEMPLATE.default, "block_h": 128, "block_k": 128},
)


class FusedMoEFp8(Fp8Op):
    base = FUSED_MOE
    weights = ("w_gate_up", "w_down")
    summary = ("fused_moe with e4m3 experts: w_gate_up and w_down each followed by its float32 scales "
               "[experts, rows/128, cols/128] (the multiplier) -> new bf16 tensor like x")
    templates = {GEMV_FP8_TEMPLATE.name: GEMV_FP8_TEMPLATE}

    def eager(self, x, router_logits, w_gate_up, w_gate_up_scale, w_down, w_down_scale, top_k, renormalize):
        if x.shape[0] * top_k > w_gate_up.shape[0]:
            return FUSED_MOE.eager(x, router_logits, dequantize(w_gate_up, w_gate_up_scale, x.dtype),
                                   dequantize(w_down, w_down_scale, x.dtype), top_k, renormalize)
        weights, experts = route(router_logits, top_k, renormalize)
        flat = experts.flatten()
        inter = w_down.shape[2]
        gu = torch.bmm(dequantize(w_gate_up[flat], w_gate_up_scale[flat], x.dtype),
                       x.repeat_interleave(top_k, dim=0)[:, :, None]).squeeze(2)
        act = F.silu(gu[:, :inter]) * gu[:, inter:]
        out = torch.bmm(dequantize(w_down[flat], w_down_scale[flat], x.dtype), act[:, :, None]).squeeze(2)
        return (out.view(-1, top_k, out.shape[-1]) * weights.to(out.dtype)[..., None]).sum(dim=1)

    def bytes(self, shape, dtype):
        d = shape.dims
        t, h, n, e = d["tokens"], d["hidden"], d["inter"], d["experts"]
        used = min(e, t * d["top_k"])  # exact for the generated routing (fused_moe's docstring)
        scales = -(-2 * n // 128) * -(-h // 128) + -(-h // 128) * -(-n // 128)
        return used * (3 * n * h + 4 * scales) + (2 * t * h + t * e) * dtype.itemsize

    def flops(self, shape):
        return FUSED_MOE.flops(shape)


OP = FusedMoEFp8()
