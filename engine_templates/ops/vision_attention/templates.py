"""Triton flash attention for the vision backbone, the 2D rotary turn of q and k fused in.

Grid (cdiv(tokens, BLOCK_M), seqs * heads): each program turns its BLOCK_M query rows of one head by
the rotary table (a pair's partner loaded at channel d ^ 1, its sign by the channel's parity), in
float32, back to the activations' dtype as transformers does, and runs an online softmax over
tiles of BLOCK_N keys, each turned the same way as it is loaded. No mask: every token of a window
or image sees every other. As in prefill_attention, Triton's CPU interpreter multiplies bf16 dot
operands as raw bits, so under TRITON_INTERPRET the operands are upcast to float32 (UPCAST); its
bf16 cast truncates rather than rounds, so there the turned q and k stay in float32 too.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
UPCAST = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _turned(base, COS, SIN, rows, mask, stride_t, d, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Rows `rows` of one head (at `base`) turned by the rotary table: x * cos + rot(x) * sin."""
    at = base + rows.to(tl.int64)[:, None] * stride_t
    x = tl.load(at + d[None, :], mask=mask, other=0.0)
    partner = tl.load(at + (d ^ 1)[None, :], mask=mask, other=0.0).to(tl.float32)
    table = rows[:, None] * HEAD_DIM + d[None, :]
    cos = tl.load(COS + table, mask=mask, other=0.0)
    sin = tl.load(SIN + table, mask=mask, other=0.0)
    sign = tl.where(d % 2 == 0, -1.0, 1.0)
    out = x.to(tl.float32) * cos + sign[None, :] * partner * sin
    if not UPCAST:  # the interpreter's bf16 cast truncates: upcasting, the turn stays in float32
        out = out.to(x.dtype)
    return out


@triton.jit
def _vision_attention(Q, K, V, COS, SIN, O, tokens, heads, scale_log2e,
                      stride_qs, stride_qt, stride_qh, stride_ks, stride_kt, stride_kh,
                      stride_vs, stride_vt, stride_vh, stride_os, stride_ot, stride_oh,
                      HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    d_mask = d < HEAD_DIM
    m_mask = m < tokens
    q = _turned(Q + seq.to(tl.int64) * stride_qs + head * stride_qh, COS, SIN, m,
                m_mask[:, None] & d_mask[None, :], stride_qt, d, HEAD_DIM, UPCAST)
    k_base = K + seq.to(tl.int64) * stride_ks + head * stride_kh
    v_base = V + seq.to(tl.int64) * stride_vs + head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    for tile in range(0, tokens, BLOCK_N):
        pos = tile + n
        p_mask = pos < tokens
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = _turned(k_base, COS, SIN, pos, kv_mask, stride_kt, d, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds a key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + pos.to(tl.int64)[:, None] * stride_vt + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + seq.to(tl.int64) * stride_os + head * stride_oh + m.to(tl.int64)[:, None] * stride_ot
             + d[None, :], out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def build(block_m: int, block_n: int, num_warps: int, num_stages: int):
    def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, scale: float) -> torch.Tensor:
        seqs, tokens, heads, head_dim = q.shape
        assert k.shape == q.shape and v.shape == q.shape and q.dtype == k.dtype == v.dtype
        assert q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1
        assert head_dim % 2 == 0, "rotary pairs need an even head_dim"
        assert cos.shape == sin.shape == (tokens, head_dim) and cos.dtype == sin.dtype == torch.float32
        assert cos.is_contiguous() and sin.is_contiguous()
        out = torch.empty((seqs, tokens, heads, head_dim), dtype=q.dtype, device=q.device)
        # tf32 is ignored for bf16/fp16 on a GPU; the interpreter, upcasting, would round to it
        precision = "ieee" if q.dtype == torch.float32 or UPCAST else "tf32"
        _vision_attention[(triton.cdiv(tokens, block_m), seqs * heads)](
            q, k, v, cos, sin, out, tokens, heads, scale * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m,
            BLOCK_N=block_n, PRECISION=precision, UPCAST=UPCAST, num_warps=num_warps, num_stages=num_stages)
        return out

    return vision_attention
