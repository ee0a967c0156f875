"""The fp8 target of linear: y = x @ (weight * scale).T with the weight in e4m3 and one float32
scale per 128 x 128 block (engine_templates/ops/fp8.py), bf16 activations; judged against the
bf16 linear on the weight before quantization.

    linear(x, weight, weight_scale): x [tokens, in] bf16; weight [out, in] e4m3;
    weight_scale [ceil(out / 128), ceil(in / 128)] float32 -> new tensor [tokens, out] bf16

The PyTorch baseline is what the engine does without a kernel for it: the weight dequantized to
bf16, then the bf16 matmul. The fewest bytes a call moves count the weight at one byte an element.
"""
from __future__ import annotations

import torch.nn.functional as F

from engine_templates.ops.base import Template
from engine_templates.ops.fp8 import Fp8Op, dequantize
from engine_templates.ops.linear import OP as LINEAR
from engine_templates.ops.linear import TILES_TEMPLATE

TILES_FP8_TEMPLATE = Template(
    name="tiles",
    module="engine_templates.ops.linear.fp8_templates",
    # block_k up to 128: a step lies inside one block column of scales
    space={**TILES_TEMPLATE.space, "fp8_dot": [0, 1]},
    default={**TILES_TEMPLATE.default, "fp8_dot": 0},
)


class LinearFp8(Fp8Op):
    base = LINEAR
    weights = ("weight",)
    summary = ("x[tokens, in] (bf16) @ weight[out, in].T, the weight e4m3 with weight_scale[out/128, in/128] "
               "(float32, the multiplier) -> new bf16 tensor [tokens, out]")
    templates = {TILES_FP8_TEMPLATE.name: TILES_FP8_TEMPLATE}

    def eager(self, x, weight, weight_scale):
        return F.linear(x, dequantize(weight, weight_scale, x.dtype))

    def bytes(self, shape, dtype):
        t, k, m = shape.dims["tokens"], shape.dims["in"], shape.dims["out"]
        scales = -(-m // 128) * -(-k // 128)
        return (t * k + t * m) * dtype.itemsize + m * k + 4 * scales

    def flops(self, shape):
        return LINEAR.flops(shape)


OP = LinearFp8()
