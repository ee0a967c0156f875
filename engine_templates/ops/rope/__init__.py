"""Rotary position embedding (rotate-half / NeoX layout, as Qwen3 uses) of queries and keys.

    cos, sin = cos_sin[positions, :half], cos_sin[positions, half:]
    x1, x2 = x[..., :half], x[..., half:]
    rope(x) = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)

q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim] (each head's channels contiguous;
tokens and heads may be strided: the engine passes views of its fused qkv rows) are rotated with
the same angles; cos_sin [max_positions, head_dim] float32 is the table the engine builds once from the
model's rope_theta; positions int64 [tokens]. Returns (q_rotated, k_rotated), new tensors.
"""
from __future__ import annotations

import math

import torch

from contract.job import Shape
from engine_templates.models import ModelDims
from engine_templates.ops.base import Drawn, Op, Template, copies, random_stack, unstack
from engine_templates.ops.rmsnorm import token_shapes

ROWS_TEMPLATE = Template(
    name="rows",
    module="engine_templates.ops.rope.templates",
    space={
        "tokens_per_program": [1, 2, 4, 8],
        "num_warps": [1, 2, 4, 8],
    },
    default={"tokens_per_program": 1, "num_warps": 4},
)

MAX_POSITIONS = 4096  # table rows in the generated inputs: positions land anywhere in it


def cos_sin_table(head_dim: int, max_positions: int, theta: float, device="cpu", llama3=None) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of the angles in the first half, sin in the second;
    `llama3` (models.Llama3Rope): the frequencies rescaled as Llama 3.1's rope_scaling says.

    Built as HF transformers builds it (float32 inverse frequencies, float32 outer product), so
    the engine's angles are bit-equal to the oracle's."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if llama3 is not None:
        inv_freq = _llama3_frequencies(inv_freq, llama3)
    freqs = torch.outer(torch.arange(max_positions, device=device).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _llama3_frequencies(inv_freq: torch.Tensor, r) -> torch.Tensor:
    """Wavelengths past the original context's over low_freq_factor slowed by `factor`, those under
    it over high_freq_factor kept, a linear blend in 1/wavelength between."""
    old = r.original_max_positions
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old / r.low_freq_factor, inv_freq / r.factor, inv_freq)
    smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    blended = (1 - smooth) * slowed / r.factor + smooth * slowed
    medium = ~(wavelen < old / r.high_freq_factor) * ~(wavelen > old / r.low_freq_factor)
    return torch.where(medium, blended, slowed)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def positions_for(tokens: int, gen: torch.Generator, device) -> torch.Tensor:
    """Each token's position, drawn from the generator's own stream (one draw per input set)."""
    return torch.randint(0, MAX_POSITIONS, (tokens,), generator=gen, device=gen.device).to(device)


class HeadShapes:
    """Shapes of an op over q and k heads per token (rope, qk_norm_rope): the model's head counts,
    the workload's decode batches and prefill lengths as token counts, and two odd ones."""

    @staticmethod
    def _dims(model: ModelDims) -> dict[str, int]:
        return {"q_heads": model.heads, "kv_heads": model.kv_heads, "head_dim": model.head_dim}

    def shapes(self, model: ModelDims, decode_batches, prefill_tokens, contexts):
        return token_shapes(self._dims(model), decode_batches, prefill_tokens)

    def odd_shapes(self, model: ModelDims):
        return [Shape("odd_3tokens", {"tokens": 3, **self._dims(model)}),
                Shape("odd_heads", {"tokens": 11, "q_heads": 6, "kv_heads": 3, "head_dim": 24})]


class Rope(Drawn, HeadShapes, Op):
    name = "rope"
    signature = "rope(q, k, cos_sin, positions)"
    persistent = ("cos_sin",)  # built once from rope_theta
    summary = ("q[tokens, q_heads, head_dim], k[tokens, kv_heads, head_dim] rotated by "
               "cos_sin[positions] -> two new tensors like q and k")
    n_outputs = 2
    templates = {ROWS_TEMPLATE.name: ROWS_TEMPLATE}

    def odd_shapes(self, model: ModelDims):
        # As the engine calls it (Llama, Mistral, Qwen2, Mixtral): q and k views of the fused qkv
        # projection's rows, heads strided by the row, not packed
        return [*super().odd_shapes(model),
                Shape("odd_qkv_views", {"tokens": 5, **self._dims(model), "qkv_views": 1})]

    def draw(self, shape, dtype, device, gens, dist):
        d = shape.dims
        t, hd = d["tokens"], d["head_dim"]
        if d.get("qkv_views"):
            qk = []
            for qkv in unstack(random_stack((t, (d["q_heads"] + 2 * d["kv_heads"]) * hd), dtype, device, gens, dist)):
                q, k, _ = qkv.split((d["q_heads"] * hd, d["kv_heads"] * hd, d["kv_heads"] * hd), dim=-1)
                qk.append((q.view(t, d["q_heads"], hd), k.view(t, d["kv_heads"], hd)))
        else:
            qk = list(zip(unstack(random_stack((t, d["q_heads"], hd), dtype, device, gens, dist)),
                          unstack(random_stack((t, d["kv_heads"], hd), dtype, device, gens, dist))))
        tables = copies(cos_sin_table(hd, MAX_POSITIONS, 1e6).to(device), len(gens))
        return [(q, k, cos_sin, positions_for(t, g, device)) for (q, k), cos_sin, g in zip(qk, tables, gens)]

    def reference(self, q, k, cos_sin, positions):
        half = q.shape[-1] // 2
        cs = cos_sin[positions].double()
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        return _rotate(q.double(), cos, sin), _rotate(k.double(), cos, sin)

    def eager(self, q, k, cos_sin, positions):
        half = q.shape[-1] // 2
        cs = cos_sin[positions]
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        return (_rotate(q.float(), cos, sin).to(q.dtype), _rotate(k.float(), cos, sin).to(k.dtype))

    def bytes(self, shape, dtype):
        d = shape.dims
        qk = d["tokens"] * (d["q_heads"] + d["kv_heads"]) * d["head_dim"]
        return 2 * qk * dtype.itemsize + d["tokens"] * (d["head_dim"] * 4 + 8)  # + table rows, positions

    def flops(self, shape):
        d = shape.dims
        return 3 * d["tokens"] * (d["q_heads"] + d["kv_heads"]) * d["head_dim"]


OP = Rope()
