"""Qwen3's per-head q/k RMSNorm and RoPE in one op, straight from the fused qkv projection.

    qkv [tokens, (q_heads + 2 * kv_heads) * head_dim]: q's heads, then k's, then v's
    q = rope(rmsnorm(qkv's q heads, q_norm, eps)), k = rope(rmsnorm(qkv's k heads, k_norm, eps))

each head normalized over its own head_dim with the [head_dim] weight, then rotated (rotate-half,
as ops/rope) by cos_sin[positions]. v is not touched: the engine takes it as a view of qkv.
Returns (q [tokens, q_heads, head_dim], k [tokens, kv_heads, head_dim]), new tensors in qkv's dtype.
The head counts are arguments because qkv's width alone does not tell q's heads from kv's.
"""
from __future__ import annotations

import torch

from engine_templates.ops.base import Drawn, Op, Template, copies, random_stack, unstack
from engine_templates.ops.rope import MAX_POSITIONS, HeadShapes, _rotate, cos_sin_table, positions_for

HEADS_TEMPLATE = Template(
    name="heads",
    module="engine_templates.ops.qk_norm_rope.templates",
    space={
        "tokens_per_program": [1, 2, 4, 8],
        "heads_per_program": [1, 2, 4, 8, 16, 0],  # 0: every q and k head of a token in one program
        "num_warps": [1, 2, 4, 8],
    },
    # qwen3-8b: 40 heads in 5 blocks; 4 tokens x 8 heads x 128 is 8 KiB of bf16 read per program
    default={"tokens_per_program": 4, "heads_per_program": 8, "num_warps": 4},
)


def split_heads(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int):
    """q [tokens, q_heads, head_dim], k and v [tokens, kv_heads, head_dim]: views of qkv."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split((q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    return (q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim),
            v.view(tokens, kv_heads, head_dim))


class QKNormRope(Drawn, HeadShapes, Op):
    name = "qk_norm_rope"
    signature = "qk_norm_rope(qkv, q_heads, kv_heads, q_norm, k_norm, eps, cos_sin, positions)"
    persistent = ("q_norm", "k_norm", "cos_sin")  # weights and the table, built once at load
    summary = ("qkv[tokens, (q_heads + 2 kv_heads) * head_dim]: q and k heads RMS-normalized by "
               "q_norm/k_norm[head_dim], rotated by cos_sin[positions] -> q, k (two new tensors)")
    n_outputs = 2
    templates = {HEADS_TEMPLATE.name: HEADS_TEMPLATE}

    def draw(self, shape, dtype, device, gens, dist):
        d = shape.dims
        t, qh, kvh, hd = d["tokens"], d["q_heads"], d["kv_heads"], d["head_dim"]
        qkv = random_stack((t, (qh + 2 * kvh) * hd), dtype, device, gens, dist)
        q_norm = random_stack((hd,), dtype, device, gens, "uniform", scale=0.5) + 1.0
        k_norm = random_stack((hd,), dtype, device, gens, "uniform", scale=0.5) + 1.0
        tables = copies(cos_sin_table(hd, MAX_POSITIONS, 1e6).to(device), len(gens))
        return [(a, qh, kvh, qn, kn, 1e-6, cos_sin, positions_for(t, g, device))
                for a, qn, kn, cos_sin, g in zip(unstack(qkv), unstack(q_norm), unstack(k_norm), tables, gens)]

    def reference(self, qkv, q_heads, kv_heads, q_norm, k_norm, eps, cos_sin, positions):
        hd = q_norm.shape[0]
        q, k, _ = split_heads(qkv.double(), q_heads, kv_heads, hd)
        cs = cos_sin[positions].double()
        cos, sin = cs[:, None, :hd // 2], cs[:, None, hd // 2:]

        def norm(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()

        return _rotate(norm(q, q_norm), cos, sin), _rotate(norm(k, k_norm), cos, sin)

    def eager(self, qkv, q_heads, kv_heads, q_norm, k_norm, eps, cos_sin, positions):
        # The engine's composition before this op, step for step: HF transformers' Qwen3RMSNorm
        # per head (the weight applied in the op dtype), then rope's float32 rotation.
        hd = q_norm.shape[0]
        q, k, _ = split_heads(qkv, q_heads, kv_heads, hd)
        cs = cos_sin[positions]
        cos, sin = cs[:, None, :hd // 2], cs[:, None, hd // 2:]

        def norm_rope(x, weight):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return _rotate((weight * h.to(x.dtype)).float(), cos, sin).to(x.dtype)

        return norm_rope(q, q_norm), norm_rope(k, k_norm)

    def bytes(self, shape, dtype):
        d = shape.dims
        qk = d["tokens"] * (d["q_heads"] + d["kv_heads"]) * d["head_dim"]
        # q and k read from qkv (v is not) and written once; both weights; table rows and positions
        return (2 * qk + 2 * d["head_dim"]) * dtype.itemsize + d["tokens"] * (d["head_dim"] * 4 + 8)

    def flops(self, shape):
        d = shape.dims
        # rmsnorm's 4 per element (square, accumulate, scale by rstd, by weight), rope's 3
        return 7 * d["tokens"] * (d["q_heads"] + d["kv_heads"]) * d["head_dim"]


OP = QKNormRope()
