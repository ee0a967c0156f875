"""GELU, the activation of SAM 3's vision MLP (transformers' "gelu"): the exact one,
x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2))), not the tanh approximation."""
from __future__ import annotations

import math

import torch

from contract.job import Shape
from engine_templates.ops.base import Drawn, Op, Template, random_stack, unstack
from engine_templates.ops.layernorm import image_shapes
from engine_templates.vision import Sam3Dims

FLAT_TEMPLATE = Template(
    name="flat",
    module="engine_templates.ops.gelu.templates",
    space={
        "block": [256, 512, 1024, 2048, 4096, 8192],
        "num_warps": [1, 2, 4, 8, 16],
        "num_stages": [1, 2, 3],
    },
    default={"block": 1024, "num_warps": 4, "num_stages": 1},
)


class Gelu(Drawn, Op):
    name = "gelu"
    signature = "gelu(x)"
    modality = "vision"
    summary = "exact (erf) gelu of x[tokens, inter], the vision MLP's activation -> new tensor like x"
    templates = {FLAT_TEMPLATE.name: FLAT_TEMPLATE}

    def shapes(self, model: Sam3Dims, images, prefill_tokens=(), contexts=()):
        return image_shapes(model, {"inter": model.intermediate}, images)

    def odd_shapes(self, model: Sam3Dims):
        return [Shape("odd_3rows", {"tokens": 3, "inter": model.intermediate}),
                Shape("odd_cols", {"tokens": 19, "inter": model.intermediate // 3 + 5})]

    def draw(self, shape, dtype, device, gens, dist):
        return [(x,) for x in unstack(random_stack((shape.dims["tokens"], shape.dims["inter"]), dtype, device,
                                                   gens, dist))]

    def reference(self, x):
        xd = x.double()
        return 0.5 * xd * (1.0 + torch.erf(xd / math.sqrt(2.0)))

    def eager(self, x):
        return torch.nn.functional.gelu(x)

    def bytes(self, shape, dtype):
        return 2 * shape.dims["tokens"] * shape.dims["inter"] * dtype.itemsize

    def flops(self, shape):
        # scale, erf (counted as one), add, two products
        return 5 * shape.dims["tokens"] * shape.dims["inter"]


OP = Gelu()
