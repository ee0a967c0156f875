"""Triton RoPE: one program per `tokens_per_program` tokens, every q and k head of them at once.

The angles are read once per token and applied to all heads; the rotation runs in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, Y, row, n_tokens, stride_xt, stride_xh, stride_yt, stride_yh, cos, sin,
                  N_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    c = tl.arange(0, HALF_PAD)
    # A row past the end gets an empty mask rather than a branch.
    heads = tl.where(row < n_tokens, N_HEADS, 0)
    m = (h[:, None] < heads) & (c[None, :] < HALF)
    x_at = X + row.to(tl.int64) * stride_xt + h[:, None] * stride_xh + c[None, :]
    y_at = Y + row.to(tl.int64) * stride_yt + h[:, None] * stride_yh + c[None, :]
    x1 = tl.load(x_at, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(y_at, (x1 * cos[None, :] - x2 * sin[None, :]).to(Y.dtype.element_ty), mask=m)
    tl.store(y_at + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _rope_rows(Q, K, QO, KO, CS, POS, n_tokens, stride_qt, stride_qh, stride_kt, stride_kh,
               stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
               Q_HEADS: tl.constexpr, Q_PAD: tl.constexpr, KV_HEADS: tl.constexpr,
               KV_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
               TOKENS: tl.constexpr):
    c = tl.arange(0, HALF_PAD)
    for i in tl.static_range(TOKENS):
        row = tl.program_id(0) * TOKENS + i
        pos = tl.load(POS + row, mask=row < n_tokens, other=0)
        cs_row = CS + pos.to(tl.int64) * stride_cs
        cos = tl.load(cs_row + c, mask=c < HALF, other=0.0)
        sin = tl.load(cs_row + HALF + c, mask=c < HALF, other=0.0)
        _rotate_heads(Q, QO, row, n_tokens, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                      Q_HEADS, Q_PAD, HALF, HALF_PAD)
        _rotate_heads(K, KO, row, n_tokens, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                      KV_HEADS, KV_PAD, HALF, HALF_PAD)


def build(tokens_per_program: int, num_warps: int):
    def rope(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor):
        tokens, q_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        assert k.shape[0] == tokens and k.shape[2] == head_dim and head_dim % 2 == 0
        assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin.stride(1) == 1
        assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == head_dim
        half = head_dim // 2
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        _rope_rows[(triton.cdiv(tokens, tokens_per_program),)](
            q, k, q_out, k_out, cos_sin, positions, tokens, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0),
            k_out.stride(1), cos_sin.stride(0),
            Q_HEADS=q_heads, Q_PAD=triton.next_power_of_2(q_heads), KV_HEADS=kv_heads,
            KV_PAD=triton.next_power_of_2(kv_heads), HALF=half,
            HALF_PAD=triton.next_power_of_2(half), TOKENS=tokens_per_program, num_warps=num_warps)
        return q_out, k_out

    return rope
