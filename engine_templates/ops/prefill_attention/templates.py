"""Triton flash attention for prefill over a paged cache, causal, variable lengths.

Grid (batch, cdiv(total_q, BLOCK_M), q_heads): the host does not know each sequence's length
without a sync, so every sequence gets as many query blocks as the whole batch has tokens and
the programs past its own length return at once. Each program holds BLOCK_M query rows of one
head and runs an online softmax over cache tiles of BLOCK_N positions up to its last row's
position, reading the cache through one block-table lookup per position (any block size).
With a sliding window (prefill_attention_swa: `window` > 0, a constexpr switch WINDOWED) the
position p attends p - window < j <= p only, and a program's tiles start at its first row's
window.
As in decode_attention, Triton's CPU interpreter multiplies bf16 dot operands as raw bits, so
under TRITON_INTERPRET the operands are upcast to float32 (UPCAST).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
UPCAST = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _flash_prefill(Q, K, V, CU_Q, SEQ_LENS, BLOCK_TABLE, O, scale_log2e, window,
                   stride_qt, stride_qh, stride_kb, stride_kp, stride_kh,
                   stride_vb, stride_vp, stride_vh, stride_bt, stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, WINDOWED: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(2)
    q_start = tl.load(CU_Q + seq)
    q_len = tl.load(CU_Q + seq + 1) - q_start
    first = tl.program_id(1) * BLOCK_M
    if first >= q_len:
        return
    seq_len = tl.load(SEQ_LENS + seq)
    prefix = seq_len - q_len
    kv_head = head // GROUP
    m = first + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    q_pos = prefix + m  # rows past q_len see every key: finite, and never stored
    d = tl.arange(0, DIM_PAD)
    d_mask = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    end = tl.minimum(prefix + first + BLOCK_M, seq_len)  # causal: no key past the last row
    start = 0
    if WINDOWED:  # no key before the first row's window
        start = tl.maximum(prefix + first - window + 1, 0)
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        p_mask = pos < end
        block = tl.load(BLOCK_TABLE + seq.to(tl.int64) * stride_bt + pos // PAGE_SIZE,
                        mask=p_mask, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(K + (block * stride_kb + slot * stride_kp)[:, None] + kv_head * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        s = tl.where(p_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        if WINDOWED:
            s = tl.where(pos[None, :] > q_pos[:, None] - window, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: position 0 is in every row's first tile
        if WINDOWED:  # but a later row's window may start past this tile: then subtract 0, not -inf
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + (block * stride_vb + slot * stride_vp)[:, None] + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if WINDOWED:
        l_i = tl.where(l_i > 0, l_i, 1.0)  # rows past q_len may see no key; they are not stored
    out = acc / l_i[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


def build(block_m: int, block_n: int, num_warps: int, num_stages: int):
    def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                          block_table: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
        """window > 0: each position attends its last `window` positions (itself included)."""
        total_q, q_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        batch = seq_lens.shape[0]
        assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
        assert q_heads % kv_heads == 0, "q heads must be a multiple of kv heads"
        assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (batch + 1,)
        assert seq_lens.dtype == torch.int32 and block_table.dtype == torch.int32
        assert block_table.stride(1) == 1
        out = torch.empty((total_q, q_heads, head_dim), dtype=q.dtype, device=q.device)
        precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16/fp16
        _flash_prefill[(batch, triton.cdiv(total_q, block_m), q_heads)](
            q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, out, scale * LOG2E, window,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
            out.stride(0), out.stride(1),
            GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=k_cache.shape[1], PRECISION=precision,
            UPCAST=UPCAST, WINDOWED=window > 0, num_warps=num_warps, num_stages=num_stages)
        return out

    return prefill_attention
