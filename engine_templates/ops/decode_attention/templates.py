"""Triton split-KV decode attention (flash-decoding), contiguous or paged cache.

Pass 1, grid (batch, kv_heads, num_splits): each program takes one sequence, one kv head and
the whole group of q heads that share it, so every K/V tile is loaded once for the group. The
sequence's tiles of BLOCK_N positions are dealt out evenly to the splits; each split runs an
online softmax over its tiles and writes (running max, sum of exponentials, unnormalized
output) to a float32 workspace. Pass 2, grid (batch, q_heads), rescales and combines the splits.
With num_splits == 1 pass 1 normalizes and writes the output itself and pass 2 is skipped;
num_splits == 0 chooses the count per call from the shapes (auto_splits): many splits for a
lone long sequence, one for a large batch, where a fixed count fits one end or the other.

With a sliding window (decode_attention_swa: `window` > 0, a constexpr switch WINDOWED) the
query attends the sequence's last `window` positions, and the splits share those tiles only.

Paged caches are read through one block-table lookup per position, so any block size works
with any BLOCK_N (a tile may cover part of a block or many blocks, SGLang's block size 1
included); the block size is a constexpr, so the // and % are shifts for powers of two.

Both products use tl.dot with the q-head group padded to 16 rows (tl.dot's minimum): the
wasted tensor-core work is free in a memory-bound kernel, whereas an elementwise product and
sum would hold GROUP x BLOCK_N x HEAD_DIM floats in registers and spill on a GPU. float32
inputs use ieee precision, since the default tf32 misses the fp32 tolerance. Triton's CPU
interpreter multiplies bf16 operands as raw uint16 bits, so under TRITON_INTERPRET the
operands are upcast to float32 first (UPCAST); on an H200 that path was measured 5-15% slower,
so the GPU keeps the native bf16/fp16 dot. Both paths were checked there at bf16, fp16, fp32.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Read at call time, so a test can flip it; see the module docstring.
UPCAST = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _split_kv_partial(Q, K, V, SEQ_LENS, BLOCK_TABLE, O, M_WS, L_WS, ACC_WS, scale_log2e, window,
                      stride_qb, stride_qh, stride_kb, stride_kp, stride_kh,
                      stride_vb, stride_vp, stride_vh, stride_bt, stride_ob, stride_oh,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                      DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr, WINDOWED: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + seq)
    # Deal whole tiles to splits, so every tile but the sequence's last is full. A split whose
    # first tile starts past seq_len runs no iteration and writes the empty state (-inf, 0, 0).
    first = 0
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first, BLOCK_N), NUM_SPLITS)
    start = first + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g
    d = tl.arange(0, DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(Q + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        p_mask = pos < end
        if PAGED:
            # One table lookup per position, so a tile may span several blocks or part of one.
            block = tl.load(BLOCK_TABLE + seq.to(tl.int64) * stride_bt + pos // PAGE_SIZE,
                            mask=p_mask, other=0).to(tl.int64)
            k_rows = block * stride_kb + (pos % PAGE_SIZE) * stride_kp
            v_rows = block * stride_vb + (pos % PAGE_SIZE) * stride_vp
        else:
            k_rows = seq.to(tl.int64) * stride_kb + pos.to(tl.int64) * stride_kp
            v_rows = seq.to(tl.int64) * stride_vb + pos.to(tl.int64) * stride_vp
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(K + k_rows[:, None] + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e  # [GROUP_PAD, BLOCK_N]
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the tile has at least one position
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + v_rows[:, None] + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        ws = (seq.to(tl.int64) * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(M_WS + ws, m_i, mask=g_mask)
        tl.store(L_WS + ws, l_i, mask=g_mask)
        tl.store(ACC_WS + ws[:, None] * DIM_PAD + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _split_kv_combine(M_WS, L_WS, ACC_WS, O, stride_ob, stride_oh,
                      HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + head
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, DIM_PAD)
    m = tl.load(M_WS + row * NUM_SPLITS + s)
    l = tl.load(L_WS + row * NUM_SPLITS + s)
    acc = tl.load(ACC_WS + (row * NUM_SPLITS + s)[:, None] * DIM_PAD + d[None, :])
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # an empty sequence: all splits empty
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(w * l, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(O + seq.to(tl.int64) * stride_ob + head * stride_oh + d, out.to(O.dtype.element_ty),
             mask=d < HEAD_DIM)


AUTO_MAX_SPLITS = 64


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the GPU (a CPU under the interpreter: 4, a token figure)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_splits(batch: int, kv_heads: int, positions: int, block_n: int, sms: int) -> int:
    """num_splits = 0: about two programs per SM over the (sequence, kv head) pairs, a power of
    two (the combine pass's tl.arange), at most one split per tile of the longest sequence the
    cache can hold, at most AUTO_MAX_SPLITS. From shapes only (no host sync: the sequence lengths
    stay on the device), so a CUDA graph captures one count per shape; splits past a shorter
    sequence's tiles run no iteration."""
    wanted = triton.next_power_of_2(-(-2 * sms // (batch * kv_heads)))
    tiles = max(1, -(-positions // block_n))
    most = 1 << (tiles.bit_length() - 1)  # the largest power of two <= tiles
    return max(1, min(wanted, most, AUTO_MAX_SPLITS))


def build(num_splits: int, block_n: int, num_warps: int, num_stages: int):
    def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         seq_lens: torch.Tensor, block_table: torch.Tensor | None,
                         scale: float, window: int = 0) -> torch.Tensor:
        """window > 0: the query attends the last `window` positions of its sequence."""
        batch, q_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
        assert q_heads % kv_heads == 0, "q heads must be a multiple of kv heads"
        assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, \
            "head_dim must be contiguous"
        assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,)
        paged = block_table is not None
        if paged:
            assert block_table.dtype == torch.int32 and block_table.shape[0] == batch
            assert block_table.stride(1) == 1
        else:
            assert k_cache.shape[0] == batch, "contiguous cache: one row of the cache per sequence"
        if num_splits:
            splits = num_splits
        else:
            positions = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
            positions = min(positions, window) if window > 0 else positions
            splits = auto_splits(batch, kv_heads, positions, block_n, _sm_count(q.device))
        group = q_heads // kv_heads
        group_pad = max(16, triton.next_power_of_2(group))
        dim_pad = max(16, triton.next_power_of_2(head_dim))
        precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is ignored for bf16/fp16
        out = torch.empty((batch, q_heads, head_dim), dtype=q.dtype, device=q.device)
        if splits == 1:
            m_ws = l_ws = acc_ws = out  # unused: pass 1 writes the output
        else:
            m_ws = torch.empty((batch, q_heads, splits), dtype=torch.float32, device=q.device)
            l_ws = torch.empty_like(m_ws)
            acc_ws = torch.empty((batch, q_heads, splits, dim_pad), dtype=torch.float32,
                                 device=q.device)
        _split_kv_partial[(batch, kv_heads, splits)](
            q, k_cache, v_cache, seq_lens, block_table if paged else seq_lens, out,
            m_ws, l_ws, acc_ws, scale * LOG2E, window,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0) if paged else 0, out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_N=block_n,
            NUM_SPLITS=splits, PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
            PRECISION=precision, UPCAST=UPCAST, WINDOWED=window > 0, num_warps=num_warps,
            num_stages=num_stages)
        if splits > 1:
            _split_kv_combine[(batch, q_heads)](m_ws, l_ws, acc_ws, out, out.stride(0), out.stride(1),
                                                HEAD_DIM=head_dim, DIM_PAD=dim_pad,
                                                NUM_SPLITS=splits, num_warps=1)
        return out

    return decode_attention
