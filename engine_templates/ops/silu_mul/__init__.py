"""SiLU-and-multiply, the gated MLP's activation: silu(gate) * up."""
from __future__ import annotations

import torch

from contract.job import Shape
from engine_templates.models import ModelDims
from engine_templates.ops.base import Drawn, Op, Template, random_stack, unstack
from engine_templates.ops.rmsnorm import token_shapes

FLAT_TEMPLATE = Template(
    name="flat",
    module="engine_templates.ops.silu_mul.templates",
    space={
        "block": [256, 512, 1024, 2048, 4096, 8192],
        "num_warps": [1, 2, 4, 8, 16],
        "num_stages": [1, 2, 3],
    },
    default={"block": 1024, "num_warps": 4, "num_stages": 1},
)


class SiluMul(Drawn, Op):
    name = "silu_mul"
    signature = "silu_mul(gate, up)"
    summary = "silu(gate[tokens, inter]) * up[tokens, inter] -> new tensor like gate"
    templates = {FLAT_TEMPLATE.name: FLAT_TEMPLATE}

    @staticmethod
    def width(model: ModelDims) -> int:
        # For MoE models every token runs experts_per_token experts of this width.
        return model.intermediate * max(1, model.experts_per_token)

    def shapes(self, model, decode_batches, prefill_tokens, contexts):
        return token_shapes({"inter": self.width(model)}, decode_batches, prefill_tokens)

    def odd_shapes(self, model):
        return [Shape("odd_3rows", {"tokens": 3, "inter": self.width(model)}),
                Shape("odd_cols", {"tokens": 19, "inter": self.width(model) // 3 + 5})]

    def draw(self, shape, dtype, device, gens, dist):
        t, n = shape.dims["tokens"], shape.dims["inter"]
        gate = random_stack((t, n), dtype, device, gens, dist)
        up = random_stack((t, n), dtype, device, gens, dist)
        return list(zip(unstack(gate), unstack(up)))

    def reference(self, gate, up):
        g = gate.double()
        return g * torch.sigmoid(g) * up.double()

    def eager(self, gate, up):
        return torch.nn.functional.silu(gate) * up

    def bytes(self, shape, dtype):
        return 3 * shape.dims["tokens"] * shape.dims["inter"] * dtype.itemsize

    def flops(self, shape):
        return 5 * shape.dims["tokens"] * shape.dims["inter"]


OP = SiluMul()
