"""Triton q/k RMSNorm + RoPE: one program per block of `tokens_per_program` tokens and
`heads_per_program` heads, the whole [tokens, heads, head_dim / 2] tile at once.

q's and k's heads are numbered together (q's first, as in qkv's row), so a block may hold heads
of both: each head picks its weight and its output tensor by its number. A head is read as its
two halves, which are both the norm's input and rope's x1 and x2, so nothing is read twice; each
token's angles are read once per program, and the whole computation runs in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_tile(QKV, QW, KW, CS, POS, QO, KO, n_tokens, stride_t, stride_cs,
                       stride_qot, stride_qoh, stride_kot, stride_koh, eps,
                       Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, TOKENS: tl.constexpr,
                       HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    c = tl.arange(0, HALF_PAD)
    t3 = t.to(tl.int64)[:, None, None]
    h3 = h[None, :, None]
    c3 = c[None, None, :]
    m = (t3 < n_tokens) & (h3 < Q_HEADS + KV_HEADS) & (c3 < HALF)
    at = QKV + t3 * stride_t + h3 * (2 * HALF) + c3
    x1 = tl.load(at, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / (2 * HALF) + eps)

    is_q = h3 < Q_HEADS
    w_at = tl.where(is_q, QW, KW) + c3  # each head's own weight: q_norm or k_norm
    wm = (h3 < Q_HEADS + KV_HEADS) & (c3 < HALF)
    x1 = x1 * rstd[:, :, None] * tl.load(w_at, mask=wm, other=0.0).to(tl.float32)
    x2 = x2 * rstd[:, :, None] * tl.load(w_at + HALF, mask=wm, other=0.0).to(tl.float32)

    pos = tl.load(POS + t, mask=t < n_tokens, other=0)
    cs_at = CS + pos.to(tl.int64)[:, None, None] * stride_cs + c3
    cm = (t3 < n_tokens) & (c3 < HALF)
    cos = tl.load(cs_at, mask=cm, other=0.0)
    sin = tl.load(cs_at + HALF, mask=cm, other=0.0)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin

    # Each head is stored once: into q's output when it is one of q's heads, else into k's.
    q_at = QO + t3 * stride_qot + h3 * stride_qoh + c3
    k_at = KO + t3 * stride_kot + (h3 - Q_HEADS) * stride_koh + c3
    qm = m & is_q
    km = m & ~is_q
    tl.store(q_at, y1.to(QO.dtype.element_ty), mask=qm)
    tl.store(q_at + HALF, y2.to(QO.dtype.element_ty), mask=qm)
    tl.store(k_at, y1.to(KO.dtype.element_ty), mask=km)
    tl.store(k_at + HALF, y2.to(KO.dtype.element_ty), mask=km)


def build(tokens_per_program: int, heads_per_program: int, num_warps: int):
    def qk_norm_rope(qkv: torch.Tensor, q_heads: int, kv_heads: int, q_norm: torch.Tensor,
                     k_norm: torch.Tensor, eps: float, cos_sin: torch.Tensor, positions: torch.Tensor):
        tokens, width = qkv.shape
        head_dim = q_norm.shape[0]
        assert width == (q_heads + 2 * kv_heads) * head_dim and head_dim % 2 == 0
        assert qkv.stride(1) == 1 and q_norm.is_contiguous() and k_norm.is_contiguous()
        assert q_norm.dtype == k_norm.dtype, "one kernel picks either weight: q_norm and k_norm in one dtype"
        assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == head_dim and cos_sin.stride(1) == 1
        q = torch.empty((tokens, q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty((tokens, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        heads = heads_per_program or triton.next_power_of_2(q_heads + kv_heads)
        grid = (triton.cdiv(tokens, tokens_per_program), triton.cdiv(q_heads + kv_heads, heads))
        _qk_norm_rope_tile[grid](qkv, q_norm, k_norm, cos_sin, positions, q, k, tokens, qkv.stride(0),
                                 cos_sin.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                 eps, Q_HEADS=q_heads, KV_HEADS=kv_heads, TOKENS=tokens_per_program,
                                 HEADS=heads, HALF=head_dim // 2,
                                 HALF_PAD=triton.next_power_of_2(head_dim // 2), num_warps=num_warps)
        return q, k

    return qk_norm_rope
