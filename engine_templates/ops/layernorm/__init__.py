"""LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias, over the last dimension — the
norm before each attention and MLP of SAM 3's vision backbone (engine_templates/vision.py)."""
from __future__ import annotations

import torch

from contract.job import Shape
from engine_templates.ops.base import Drawn, Op, Template, random_stack, unstack
from engine_templates.vision import Sam3Dims

ROWS_TEMPLATE = Template(
    name="rows",
    module="engine_templates.ops.layernorm.templates",
    space={
        "block_n": [0, 256, 512, 1024],  # 0: the whole row in one block
        "rows_per_program": [1, 2, 4],
        "num_warps": [1, 2, 4, 8, 16],
        "num_stages": [1, 2, 3],
    },
    default={"block_n": 0, "rows_per_program": 1, "num_warps": 4, "num_stages": 1},
)
EPS = Sam3Dims("sam3").layer_norm_eps


def image_shapes(model: Sam3Dims, width: dict[str, int], images) -> list[Shape]:
    """One shape per images-per-batch count: every patch of every image a row (`tokens`)."""
    return [Shape(f"images_{n}", {"tokens": n * model.tokens_per_image, **width}) for n in images]


class LayerNorm(Drawn, Op):
    name = "layernorm"
    signature = "layernorm(x, weight, bias, eps)"
    persistent = ("weight", "bias")
    modality = "vision"
    summary = "(x[tokens, hidden] - mean) / std * weight[hidden] + bias[hidden] -> new tensor like x"
    templates = {ROWS_TEMPLATE.name: ROWS_TEMPLATE}

    def shapes(self, model: Sam3Dims, images, prefill_tokens=(), contexts=()):
        return image_shapes(model, {"hidden": model.hidden}, images)

    def odd_shapes(self, model: Sam3Dims):
        return [Shape("odd_3rows", {"tokens": 3, "hidden": model.hidden}),
                Shape("odd_cols", {"tokens": 37, "hidden": model.hidden // 2 + 13})]

    def draw(self, shape, dtype, device, gens, dist):
        t, h = shape.dims["tokens"], shape.dims["hidden"]
        x = random_stack((t, h), dtype, device, gens, dist)
        weight = random_stack((h,), dtype, device, gens, "uniform", scale=0.5) + 1.0
        bias = random_stack((h,), dtype, device, gens, "normal", scale=0.5)
        return [(*a, EPS) for a in zip(unstack(x), unstack(weight), unstack(bias))]

    def reference(self, x, weight, bias, eps):
        xd = x.double()
        centred = xd - xd.mean(-1, keepdim=True)
        return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps) * weight.double() + bias.double()

    def eager(self, x, weight, bias, eps):
        # What transformers' SAM 3 layers call (nn.LayerNorm).
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def bytes(self, shape, dtype):
        t, h = shape.dims["tokens"], shape.dims["hidden"]
        return (2 * t * h + 2 * h) * dtype.itemsize

    def flops(self, shape):
        # mean, centre, square and sum, scale, weight, bias
        return 7 * shape.dims["tokens"] * shape.dims["hidden"]


OP = LayerNorm()
