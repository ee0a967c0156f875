"""Vision linear: y = x @ weight.T + bias — every projection of SAM 3's backbone, which a profile
of the reference shows to take most of an image's time (the GEMMs of the attention and the MLP;
docs/targets.md#vision-targets).

x [tokens, in] in the activation dtype; weight [out, in] (a row per output feature, as checkpoints
store it); bias [out]. Returns a new tensor [tokens, out] like x. Shapes come in four classes, the
matrices of a backbone layer as an engine stacks them: `qkv` (hidden -> 3 x hidden), `o` (hidden
-> hidden), `fc1` (hidden -> MLP width) and `fc2` (MLP width -> hidden), each at every count N of
images per batch (`<class>_images_<N>`, N x grid² tokens).
"""
from __future__ import annotations

import torch.nn.functional as F

from contract.job import Shape
from engine_templates.ops.base import Drawn, Op, Template, random_stack, unstack
from engine_templates.vision import Sam3Dims

TILES_TEMPLATE = Template(
    name="tiles",
    module="engine_templates.ops.vision_linear.templates",
    space={
        "block_m": [32, 64, 128],  # token rows per program
        "block_n": [32, 64, 128, 256],  # output features per program
        "block_k": [32, 64, 128],  # input features per step
        "group_m": [1, 4, 8],  # row blocks walked together, so their weight tiles stay in L2
        "num_warps": [4, 8],
        "num_stages": [2, 3, 4],
    },
    default={"block_m": 64, "block_n": 128, "block_k": 64, "group_m": 8, "num_warps": 4, "num_stages": 3},
)


def projections(model: Sam3Dims) -> dict[str, tuple[int, int]]:
    """(in, out) of each class of a backbone layer's linear layers."""
    h, inter = model.hidden, model.intermediate
    return {"qkv": (h, 3 * h), "o": (h, h), "fc1": (h, inter), "fc2": (inter, h)}


class VisionLinear(Drawn, Op):
    name = "vision_linear"
    signature = "vision_linear(x, weight, bias)"
    persistent = ("weight", "bias")
    modality = "vision"
    summary = "x[tokens, in] @ weight[out, in].T + bias[out] -> new tensor [tokens, out] like x"
    templates = {TILES_TEMPLATE.name: TILES_TEMPLATE}

    def shapes(self, model: Sam3Dims, images, prefill_tokens=(), contexts=()):
        return [Shape(f"{cls}_images_{n}", {"tokens": n * model.tokens_per_image, "in": k, "out": m})
                for cls, (k, m) in projections(model).items() for n in images]

    def odd_shapes(self, model: Sam3Dims):
        return [Shape("odd_3tokens", {"tokens": 3, "in": model.hidden, "out": model.hidden}),
                Shape("odd_sizes", {"tokens": 37, "in": model.hidden + 13, "out": model.intermediate + 7})]

    def draw(self, shape, dtype, device, gens, dist):
        t, k, m = shape.dims["tokens"], shape.dims["in"], shape.dims["out"]
        x = random_stack((t, k), dtype, device, gens, dist)
        weight = random_stack((m, k), dtype, device, gens, dist, scale=k ** -0.5)
        bias = random_stack((m,), dtype, device, gens, "normal")
        return list(zip(unstack(x), unstack(weight), unstack(bias)))

    def reference(self, x, weight, bias):
        return x.double() @ weight.double().t() + bias.double()

    def eager(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def bytes(self, shape, dtype):
        t, k, m = shape.dims["tokens"], shape.dims["in"], shape.dims["out"]
        return (t * k + m * k + m + t * m) * dtype.itemsize

    def flops(self, shape):
        t, k, m = shape.dims["tokens"], shape.dims["in"], shape.dims["out"]
        return 2 * t * k * m + t * m


OP = VisionLinear()
