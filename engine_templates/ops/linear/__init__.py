"""Linear: y = x @ weight.T, no bias — every projection of a Qwen3 layer.

x [tokens, in] in the activation dtype; weight [out, in] (a row per output feature, as
checkpoints store it). Returns a new tensor [tokens, out] like x.

Shapes come in four classes, the matrices of a Qwen3 layer as the engine stacks them:
`qkv` (hidden -> (heads + 2 kv heads) x head_dim), `o` (heads x head_dim -> hidden), and for a
dense model `gate_up` (hidden -> 2 x intermediate) and `down` (intermediate -> hidden); a
mixture-of-experts preset's MLP is `fused_moe`. Each class at every decode batch and prefill
length: `<class>_decode_b<B>`, `<class>_prefill_<T>`. At decode the weight's bytes bound it, at
prefill its FLOPs.

The fp8 target of this op (`linear.fp8`) takes the weight as e4m3 values and 128 x 128 block
scales, judged against this op on the weight before quantization.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from contract.job import Shape
from engine_templates.models import ModelDims
from engine_templates.ops.base import Drawn, Op, Template, random_stack, unstack

TILES_TEMPLATE = Template(
    name="tiles",
    module="engine_templates.ops.linear.templates",
    space={
        "block_m": [16, 32, 64, 128],  # token rows per program (16: tl.dot's least)
        "block_n": [32, 64, 128, 256],  # output features per program
        "block_k": [32, 64, 128],  # input features per step
        "group_m": [1, 4, 8],  # row blocks walked together, so their weight tiles stay in L2
        "num_warps": [2, 4, 8],
        "num_stages": [2, 3, 4],
    },
    default={"block_m": 16, "block_n": 64, "block_k": 128, "group_m": 8, "num_warps": 4, "num_stages": 3},
)


def projections(model: ModelDims) -> dict[str, tuple[int, int]]:
    """(in, out) of each class of the model's linear layers."""
    attn = model.heads * model.head_dim
    classes = {"qkv": (model.hidden, attn + 2 * model.kv_heads * model.head_dim), "o": (attn, model.hidden)}
    if not model.is_moe:
        classes |= {"gate_up": (model.hidden, 2 * model.intermediate), "down": (model.intermediate, model.hidden)}
    return classes


class Linear(Drawn, Op):
    name = "linear"
    signature = "linear(x, weight)"
    persistent = ("weight",)
    summary = "x[tokens, in] @ weight[out, in].T (no bias) -> new tensor [tokens, out] like x"
    templates = {TILES_TEMPLATE.name: TILES_TEMPLATE}

    def shapes(self, model: ModelDims, decode_batches, prefill_tokens, contexts):
        return [Shape(f"{cls}_{phase}{n}", {"tokens": n, "in": k, "out": m})
                for cls, (k, m) in projections(model).items()
                for phase, counts in (("decode_b", decode_batches), ("prefill_", prefill_tokens)) for n in counts]

    def odd_shapes(self, model: ModelDims):
        # Past whole 128 x 128 blocks in both dimensions, at any preset (the fp8 target's scales).
        return [Shape("odd_3tokens", {"tokens": 3, "in": model.hidden, "out": model.hidden}),
                Shape("odd_sizes", {"tokens": 7, "in": model.hidden + 67, "out": 2 * model.hidden + 35})]

    def draw(self, shape, dtype, device, gens, dist):
        t, k, m = shape.dims["tokens"], shape.dims["in"], shape.dims["out"]
        x = random_stack((t, k), dtype, device, gens, dist)
        weight = random_stack((m, k), dtype, device, gens, dist, scale=k ** -0.5)
        # Each 128 x 128 block at its own magnitude (a power of two, 1/4 to 4: exact in any dtype),
        # as trained weights' are: the fp8 target's scales then differ from block to block, and a
        # kernel that applies one block's scale to another is off by up to 16x there.
        gain = 2.0 ** torch.stack([torch.randint(-2, 3, (-(-m // 128), -(-k // 128)), generator=g, device=g.device)
                                   for g in gens])
        weight *= gain.repeat_interleave(128, 1)[:, :m].repeat_interleave(128, 2)[:, :, :k].to(weight.device, dtype)
        return list(zip(unstack(x), unstack(weight)))

    def reference(self, x, weight):
        return x.double() @ weight.double().t()

    def eager(self, x, weight):
        return F.linear(x, weight)

    def bytes(self, shape, dtype):
        t, k, m = shape.dims["tokens"], shape.dims["in"], shape.dims["out"]
        return (t * k + m * k + t * m) * dtype.itemsize

    def flops(self, shape):
        return 2 * shape.dims["tokens"] * shape.dims["in"] * shape.dims["out"]


OP = Linear()
