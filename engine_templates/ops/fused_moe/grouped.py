"""Triton grouped GEMMs for fused_moe over many tokens (prefill): each expert's weights read once
per tile of its tokens, where the decode-shaped `gemv` template (templates.py) reads them once per
(token, slot) pair. The engine's alternative to eager's `grouped_moe` (torch._grouped_mm) and to
dequantizing FP8 experts whole for it (engine/moe_prefill.py); not a template of the op.

Routing: templates.triton_route (one program per token). Then, with torch's ops and no host sync,
the (token, slot) pairs sorted by expert (stably), each expert's end row in that order
(searchsorted), and a tile map: each expert's rows cut into tiles of BLOCK_M, tile t belonging
to expert tile_expert[t] and starting at row tile_row[t]. The grid is the bound on the tiles,
cdiv(pairs, BLOCK_M) + min(experts, pairs) (each expert with pairs adds at most one partial
tile), times the column tiles; a program past the last tile returns at once.

Pass 1, grid (tiles, cdiv(inter, BLOCK_N)): a tile of an expert's rows (each the token's hidden
vector, gathered by index) against the expert's gate and up rows of BLOCK_N intermediate
channels, K = hidden walked BLOCK_K at a time into two float32 accumulators (tl.dot), then
silu(gate) * up in float32, stored in x's dtype in sorted order.
Pass 2, grid (tiles, cdiv(hidden, BLOCK_N)): the tile's activations against the expert's down
rows, K = inter, times each pair's routing weight, stored in x's dtype at the pair's own row.
Slot sum: templates._sum_slots, each token's top_k rows added in slot order in float32 (the same
bits every run: no atomics).

FP8 experts: e4m3 weights with one float32 scale per block of SCALE_R x SCALE_C (the engine's
stacks: 128 x 128, one scale row per weight row, or one scale column for a whole row); a K step
lies inside one block column (BLOCK_K divides SCALE_C, or the scales have one column), so each
step's product is multiplied by its rows' scales before it is added. The weights are read at one
byte each and turned into the activations' dtype in registers; the product runs in that dtype.

Triton's CPU interpreter multiplies bf16 dot operands as raw bits (see linear/templates.py), so
under TRITON_INTERPRET the operands are upcast to float32 first (UPCAST). float32 activations use
ieee precision: tf32 misses the fp32 tolerance.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine_templates.ops.fp8 import tile_fits
from engine_templates.ops.fused_moe.templates import SUM_BLOCK, _sum_slots, triton_route

UPCAST = os.environ.get("TRITON_INTERPRET") == "1"
# A prefill point: 64-row tiles of an expert's tokens (qwen3-30b-a3b at 2048 tokens: 128 pairs an
# expert on average, so two), 64 channels, K steps of 64 (inside a 128-wide scale block).
DEFAULT = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}


@triton.jit
def _gate_up_grouped(X, W, S, TOKEN, TILE_EXPERT, TILE_ROW, EXPERT_END, ACT, hidden, inter, n_experts,
                     stride_xt, stride_we, stride_wn, stride_se, stride_sn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                     SCALE_R: tl.constexpr, SCALE_C: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile)
    if expert >= n_experts:  # past the last tile of the bound
        return
    row0 = tl.load(TILE_ROW + tile)
    end = tl.load(EXPERT_END + expert)
    rows = row0 + tl.arange(0, BLOCK_M)
    r_mask = rows < end
    token = tl.load(TOKEN + rows, mask=r_mask, other=0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < inter
    x_rows = X + token[:, None] * stride_xt
    w_gate = W + expert.to(tl.int64) * stride_we + n.to(tl.int64)[None, :] * stride_wn
    w_up = w_gate + inter * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_mask = k < hidden
        x = tl.load(x_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        wm = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(w_gate + k[:, None], mask=wm, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_up + k[:, None], mask=wm, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        wg = wg.to(x.dtype)
        wu = wu.to(x.dtype)
        if SCALED:  # the step lies in one block column: one scale per weight row
            s_rows = S + expert.to(tl.int64) * stride_se + start // SCALE_C
            sg = tl.load(s_rows + (n // SCALE_R) * stride_sn, mask=n_mask, other=0.0)
            su = tl.load(s_rows + ((inter + n) // SCALE_R) * stride_sn, mask=n_mask, other=0.0)
            gate += tl.dot(x, wg, input_precision=PRECISION) * sg[None, :]
            up += tl.dot(x, wu, input_precision=PRECISION) * su[None, :]
        else:
            gate = tl.dot(x, wg, gate, input_precision=PRECISION)
            up = tl.dot(x, wu, up, input_precision=PRECISION)
    act = gate * tl.sigmoid(gate) * up
    out = ACT + rows.to(tl.int64)[:, None] * inter + n[None, :]
    tl.store(out, act.to(ACT.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_grouped(ACT, W, S, PAIR, WEIGHTS, TILE_EXPERT, TILE_ROW, EXPERT_END, PART, hidden, inter, n_experts,
                  stride_we, stride_wh, stride_se, stride_sh,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                  SCALE_R: tl.constexpr, SCALE_C: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile)
    if expert >= n_experts:
        return
    row0 = tl.load(TILE_ROW + tile)
    end = tl.load(EXPERT_END + expert)
    rows = row0 + tl.arange(0, BLOCK_M)
    r_mask = rows < end
    pair = tl.load(PAIR + rows, mask=r_mask, other=0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h_mask = h < hidden
    a_rows = ACT + rows.to(tl.int64)[:, None] * inter
    w_cols = W + expert.to(tl.int64) * stride_we + h.to(tl.int64)[None, :] * stride_wh
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, inter, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_mask = k < inter
        a = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & h_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
        w = w.to(a.dtype)
        if SCALED:
            s = tl.load(S + expert.to(tl.int64) * stride_se + (h // SCALE_R) * stride_sh + start // SCALE_C,
                        mask=h_mask, other=0.0)
            acc += tl.dot(a, w, input_precision=PRECISION) * s[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    acc = acc * tl.load(WEIGHTS + pair, mask=r_mask, other=0.0)[:, None]
    out = PART + pair[:, None] * hidden + h[None, :]
    tl.store(out, acc.to(PART.dtype.element_ty), mask=r_mask[:, None] & h_mask[None, :])


def tile_map(experts: torch.Tensor, n_experts: int, block_m: int):
    """From the routed experts [tokens, top_k]: (order: each sorted row's pair index, int32;
    ends: each expert's end row in that order, int32 [n_experts]; tile_expert and tile_row, int32
    over the grid's bound of tiles: a tile's expert, n_experts past the last tile, and its first
    row). Torch's ops on the device, no host sync."""
    flat = experts.flatten()
    pairs = flat.numel()
    ids, order = flat.sort(stable=True)
    ids = ids.to(torch.int32)
    ends = torch.searchsorted(ids, torch.arange(n_experts, device=ids.device, dtype=ids.dtype), right=True,
                              out_int32=True)
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    tiles = (ends - starts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0).to(torch.int32)
    bound = triton.cdiv(pairs, block_m) + min(n_experts, pairs)
    t = torch.arange(bound, device=ids.device, dtype=torch.int32)
    tile_expert = torch.searchsorted(tile_end, t, right=True, out_int32=True)  # n_experts past the last
    e = tile_expert.clamp(max=n_experts - 1).long()
    tile_row = (starts[e] + (t - (tile_end[e] - tiles[e])) * block_m).to(torch.int32)
    return order.to(torch.int32), ends, tile_expert, tile_row


def usable(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, gu_scale, d_scale,
           gu_block: tuple[int, int] | None, d_block: tuple[int, int] | None, block_k: int) -> str | None:
    """Why `launch` cannot take these arguments, or None where it can: rows contiguous, the
    activations floating point, and with scales a K step inside one column of scale blocks."""
    if not x.is_floating_point() or x.element_size() < 2:
        return f"activations of {x.dtype}"
    if x.stride(1) != 1 or w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        return "rows that are not contiguous"
    if (gu_scale is None) != (d_scale is None):
        return "scales for one of the two stacks only"
    if gu_scale is not None and not (tile_fits(gu_scale, gu_block, block_k) and tile_fits(d_scale, d_block, block_k)):
        return f"scale blocks {gu_block}, {d_block}: a K step of {block_k} does not lie in one block column"
    return None


def launch(x, router_logits, w_gate_up, gu_scale, w_down, d_scale, top_k: int, renormalize: bool, block_m: int,
           block_n: int, block_k: int, num_warps: int, num_stages: int, gu_block: tuple[int, int] | None = None,
           d_block: tuple[int, int] | None = None) -> torch.Tensor:
    """fused_moe by the two grouped passes; `gu_scale` and `d_scale`: FP8 experts' block scales,
    one per `gu_block` / `d_block` (rows, columns) of each expert's matrix, or None (experts in
    any floating dtype the activations' dot takes)."""
    tokens, hidden = x.shape
    n_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    assert w_gate_up.shape[2] == hidden and w_down.shape == (n_experts, hidden, inter)
    assert router_logits.shape == (tokens, n_experts)
    why = usable(x, w_gate_up, w_down, gu_scale, d_scale, gu_block, d_block, block_k)
    assert why is None, why
    scaled = gu_scale is not None
    if scaled:
        assert gu_scale.shape == (n_experts, -(-two_inter // gu_block[0]), -(-hidden // gu_block[1]))
        assert d_scale.shape == (n_experts, -(-hidden // d_block[0]), -(-inter // d_block[1]))
        assert gu_scale.stride(2) == 1 and d_scale.stride(2) == 1
    gs, ds = (gu_scale, d_scale) if scaled else (w_gate_up, w_down)  # unread when not scaled
    gb, db = (gu_block, d_block) if scaled else ((1, 1), (1, 1))
    weights, experts = triton_route(router_logits, top_k, renormalize)
    order, ends, tile_expert, tile_row = tile_map(experts, n_experts, block_m)
    token = order // top_k
    act = torch.empty((tokens * top_k, inter), dtype=x.dtype, device=x.device)
    part = torch.empty((tokens, top_k, hidden), dtype=x.dtype, device=x.device)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    tiles = tile_expert.numel()
    _gate_up_grouped[(tiles, triton.cdiv(inter, block_n))](
        x, w_gate_up, gs, token, tile_expert, tile_row, ends, act, hidden, inter, n_experts,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), gs.stride(0) if scaled else 0,
        gs.stride(1) if scaled else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SCALED=scaled, SCALE_R=gb[0], SCALE_C=gb[1],
        PRECISION=precision, UPCAST=UPCAST, num_warps=num_warps, num_stages=num_stages)
    _down_grouped[(tiles, triton.cdiv(hidden, block_n))](
        act, w_down, ds, order, weights, tile_expert, tile_row, ends, part, hidden, inter, n_experts,
        w_down.stride(0), w_down.stride(1), ds.stride(0) if scaled else 0, ds.stride(1) if scaled else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SCALED=scaled, SCALE_R=db[0], SCALE_C=db[1],
        PRECISION=precision, UPCAST=UPCAST, num_warps=num_warps, num_stages=num_stages)
    block = min(triton.next_power_of_2(hidden), SUM_BLOCK)
    _sum_slots[(tokens, triton.cdiv(hidden, block))](part, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out


def build(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int):
    """fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize) over experts in x's dtype."""
    def fused_moe(x, router_logits, w_gate_up, w_down, top_k: int, renormalize: bool) -> torch.Tensor:
        return launch(x, router_logits, w_gate_up, None, w_down, None, top_k, renormalize, block_m, block_n,
                      block_k, num_warps, num_stages)

    return fused_moe
