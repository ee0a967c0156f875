"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, over the last dimension."""
from __future__ import annotations

import torch

from contract.job import Shape
from engine_templates.models import ModelDims
from engine_templates.ops.base import Drawn, Op, Template, random_stack, unstack

ROWS_TEMPLATE = Template(
    name="rows",
    module="engine_templates.ops.rmsnorm.templates",
    space={
        "block_n": [0, 256, 512, 1024, 2048],  # 0: the whole row in one block
        "rows_per_program": [1, 2, 4],
        "num_warps": [0, 1, 2, 4, 8, 16],  # 0: from the row width (templates.auto_warps)
        "num_stages": [1, 2, 3],
    },
    default={"block_n": 0, "rows_per_program": 1, "num_warps": 0, "num_stages": 1},
)


def token_shapes(prefix_dims: dict[str, int], decode_batches, prefill_tokens) -> list[Shape]:
    """One shape per decode batch and per prefill length; the token count is `tokens`."""
    shapes = [Shape(f"decode_b{b}", {"tokens": b, **prefix_dims}) for b in decode_batches]
    shapes += [Shape(f"prefill_{t}", {"tokens": t, **prefix_dims}) for t in prefill_tokens]
    return shapes


class RMSNorm(Drawn, Op):
    name = "rmsnorm"
    signature = "rmsnorm(x, weight, eps)"
    persistent = ("weight",)
    summary = "x[tokens, hidden] / rms(x) * weight[hidden] -> new tensor like x"
    templates = {ROWS_TEMPLATE.name: ROWS_TEMPLATE}

    def shapes(self, model: ModelDims, decode_batches, prefill_tokens, contexts):
        return token_shapes({"hidden": model.hidden}, decode_batches, prefill_tokens)

    def odd_shapes(self, model: ModelDims):
        return [Shape("odd_3rows", {"tokens": 3, "hidden": model.hidden}),
                Shape("odd_cols", {"tokens": 37, "hidden": model.hidden // 2 + 13})]

    def draw(self, shape, dtype, device, gens, dist):
        t, h = shape.dims["tokens"], shape.dims["hidden"]
        x = random_stack((t, h), dtype, device, gens, dist)
        weight = random_stack((h,), dtype, device, gens, "uniform", scale=0.5) + 1.0
        return [(a, w, 1e-6) for a, w in zip(unstack(x), unstack(weight))]

    def reference(self, x, weight, eps):
        xd = x.double()
        return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

    def eager(self, x, weight, eps):
        # What HF transformers' Qwen3RMSNorm does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def bytes(self, shape, dtype):
        t, h = shape.dims["tokens"], shape.dims["hidden"]
        return (2 * t * h + h) * dtype.itemsize

    def flops(self, shape):
        return 4 * shape.dims["tokens"] * shape.dims["hidden"]


OP = RMSNorm()
