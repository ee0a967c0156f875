"""Vision attention: the self-attention of SAM 3's backbone ViT with its 2D axial rotary position
embedding applied to q and k inside it — over each window of window_size x window_size patches
(the windowed layers) or over a whole image's grid (the global layers).

q, k, v [seqs, tokens, heads, head_dim], a sequence a window or an image, its tokens a side x side
grid in row-major order (as the q, k, v projections lay them out); cos, sin [tokens, head_dim]
float32, the layer's rotary table (built once at load):

    rot(x)[2i] = -x[2i + 1], rot(x)[2i + 1] = x[2i]         (pairs of channels, not halves)
    q' = q * cos + rot(q) * sin, k' likewise
    out[s, :, h] = softmax(scale * q'[s, :, h] . k'[s, :, h]^T) . v[s, :, h]     (no mask)

The table (transformers' Sam3ViTRotaryEmbedding): a patch at column x, row y of the grid has
positions (x, y) * window_size / side; the first head_dim / 2 channels turn with x, the rest with y,
at head_dim / 4 frequencies theta^(-4j / head_dim), each repeated for the two channels of a pair.
"""
from __future__ import annotations

import math

import torch

from contract.job import Shape
from engine_templates.ops.base import Drawn, Op, Template, copies, random_stack, unstack
from engine_templates.vision import Sam3Dims

FLASH_TEMPLATE = Template(
    name="flash",
    module="engine_templates.ops.vision_attention.templates",
    space={
        "block_m": [16, 32, 64, 128],  # query tokens per program
        "block_n": [16, 32, 64, 128],  # key tokens per tile
        "num_warps": [2, 4, 8],
        "num_stages": [1, 2, 3],
    },
    default={"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
)
# The float64 reference materializes one (heads, tokens, tokens) score matrix per sequence: at most
# this many elements at once (2 GiB), a slice of the sequences at a time.
REFERENCE_ELEMENTS = 2 ** 28


def rotary_table(side: int, window: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, ...]:
    """cos and sin [side * side, head_dim] float32, as transformers computes them in float32."""
    ys, xs = torch.meshgrid(torch.arange(side, dtype=torch.float32, device=device),
                            torch.arange(side, dtype=torch.float32, device=device), indexing="ij")
    positions = torch.stack([xs.flatten(), ys.flatten()], dim=-1) * (window / side)
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device) / quarter))
    angles = positions[..., None] * inv_freq  # [tokens, 2, head_dim / 4]
    angles = torch.cat([angles[:, 0], angles[:, 1]], dim=-1).repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


class VisionAttention(Drawn, Op):
    name = "vision_attention"
    signature = "vision_attention(q, k, v, cos, sin, scale)"
    persistent = ("cos", "sin")
    modality = "vision"
    summary = ("attention within each window or image of q, k, v[seqs, tokens, heads, head_dim] after the 2D "
               "rotary table cos, sin[tokens, head_dim] turns q and k -> new tensor like q")
    templates = {FLASH_TEMPLATE.name: FLASH_TEMPLATE}

    @staticmethod
    def _shape(label: str, model: Sam3Dims, seqs: int, side: int) -> Shape:
        return Shape(label, {"seqs": seqs, "side": side, "heads": model.heads, "head_dim": model.head_dim,
                             "window": model.window_size, "rope_theta": int(model.rope_theta)})

    def shapes(self, model: Sam3Dims, images, prefill_tokens=(), contexts=()):
        # The windowed layers' windows and the global layers' whole grids, per images-per-batch count.
        return ([self._shape(f"window_i{n}", model, n * model.windows_per_image, model.window_size)
                 for n in images]
                + [self._shape(f"global_i{n}", model, n, model.grid) for n in images])

    def odd_shapes(self, model: Sam3Dims):
        return [self._shape("odd_3windows", model, 3, model.window_size),
                self._shape("odd_side7", model, 2, 7)]

    def draw(self, shape, dtype, device, gens, dist):
        d = shape.dims
        tokens = d["side"] * d["side"]
        # The heavy draw's magnitudes are log-normal, of mean square e^2: q and k are scaled back to
        # a unit mean square, so that their scores spread as the other draws' do (a score is their
        # product: unscaled, at sam3's 5,184 tokens, transformers' own bf16 computation lands 1.2e-2
        # from the oracle, past bf16's tolerance, on a softmax saturated as no trained model's is).
        qk_scale = math.exp(-1.0) if dist == "heavy" else 1.0
        q, k, v = (unstack(random_stack((d["seqs"], tokens, d["heads"], d["head_dim"]), dtype, device, gens, dist,
                                        scale=qk_scale if i < 2 else 1.0)) for i in range(3))
        cos, sin = (copies(t, len(gens)) for t in rotary_table(d["side"], d["window"], d["head_dim"],
                                                                float(d["rope_theta"]), device))
        return [(*a, d["head_dim"] ** -0.5) for a in zip(q, k, v, cos, sin)]

    def _attend(self, q, k, v, cos, sin, scale, dtype):
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
        step = max(1, REFERENCE_ELEMENTS // (q.shape[2] * q.shape[1] ** 2))
        turn = torch.float64 if dtype == torch.float64 else torch.float32
        cos, sin = cos.to(turn), sin.to(turn)
        for s in range(0, q.shape[0], step):
            part = slice(s, s + step)
            qr, kr = ((x * cos + rotate_pairs(x) * sin).to(dtype)
                      for x in (q[part].to(turn).transpose(1, 2), k[part].to(turn).transpose(1, 2)))
            o = torch.nn.functional.scaled_dot_product_attention(qr, kr, v[part].to(dtype).transpose(1, 2),
                                                                 scale=scale)
            out[part] = o.transpose(1, 2)
        return out

    def reference(self, q, k, v, cos, sin, scale):
        return self._attend(q, k, v, cos, sin, scale, torch.float64)

    def eager(self, q, k, v, cos, sin, scale):
        # What transformers' Sam3ViTRoPEAttention does: rotate in float32, back to the activations'
        # dtype, then SDPA.
        return self._attend(q, k, v, cos, sin, scale, q.dtype)

    def bytes(self, shape, dtype):
        d = shape.dims
        tokens = d["side"] * d["side"]
        return 4 * d["seqs"] * tokens * d["heads"] * d["head_dim"] * dtype.itemsize + 2 * tokens * d["head_dim"] * 4

    def flops(self, shape):
        d = shape.dims
        tokens = d["side"] * d["side"]
        # q.k and p.v: 2 flops per channel each, every query against every key; the rotation of q
        # and k: 3 flops per channel each
        return d["seqs"] * d["heads"] * d["head_dim"] * (4 * tokens * tokens + 6 * tokens)


OP = VisionAttention()
