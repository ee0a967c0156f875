"""Triton fused MoE for few tokens (decode): four kernels, no torch op between them.

Routing, grid (tokens,): one program per token ranks the router logits and writes the token's
top_k expert ids and float32 weights. An expert's rank is how many experts beat it: a larger
logit, or an equal one at a lower index. That is a strict order, so the ranks are a permutation
and every slot gets exactly one expert with no top-k loop; slot r holds the expert of rank r.
Ranking the logits rather than float32 probabilities keeps the order exact (two distinct logits
can round to one probability). A tie is broken towards the lower expert index, run to run and on
any device; torch.topk promises no order for ties, and the op's inputs have none (see the op's
docstring), so the check never depends on it. A NaN logit ranks as +inf, so even then every slot
holds an expert in range. Weights are softmax(logits)[expert], divided by the sum over the
token's top_k when `renormalize`.
Pass 1, grid (tokens * top_k, inter / BLOCK_I): one (token, slot) pair and a block of the
expert's intermediate channels; its gate and up rows are reduced against the token's hidden
vector tile by tile, and silu(gate) * up goes to a float32 workspace.
Pass 2, grid (tokens * top_k, hidden / BLOCK_O): one (token, slot) pair and a block of output
channels; the expert's down rows, in tiles of BLOCK_K intermediate channels, reduced against
the pair's activation, times its routing weight, to a float32 workspace. (One program per token
and block, walking its slots, left most of the GPU idle at decode: 16 programs for a 2048-wide
hidden at batch 1.)
Slot sum, grid (tokens, hidden / 1024): adds a token's top_k rows of pass 2's workspace in slot
order and casts to x's dtype, one small memory-bound kernel where torch ran two (sum, cast).
Folding the sum into pass 2 itself would mean walking the slots (the idle GPU above) or float32
atomic adds into a zeroed output: as many launches here (the zeroing, the cast to x's dtype),
and a result that depends on the order the slots land. A fixed order gives the same bits every
run.

FP8 experts (the fp8 target, `fp8_templates.py`, and the engine's FP8 MoE): e4m3 weights with
one float32 scale per block of SCALE_R x SCALE_C elements (128 x 128 in the fp8 target; the
engine's stacks may keep one scale row per weight row, or one scale column for a whole row); a
tile of BLOCK_H (pass 1) or BLOCK_K (pass 2) columns lies inside one block column, so each row's
partial sum is multiplied by its block's scale before it is added, and the experts are read at
one byte a weight.

Every expert matrix is streamed once per (token, slot): right for decode batches, where few
tokens share an expert; a grouped GEMM over tokens sorted by expert is the prefill shape and is
not this template. MAX_TOKENS declares the calls it is meant for: the engine runs a call with
more tokens through the op's eager instead, where eager's grouped path takes it
(engine/kernels.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_templates.ops.fp8 import BLOCK, tile_fits

MAX_TOKENS = 64  # decode-shaped: EngineConfig's largest CUDA graph batch size
RANK_CHUNK = 32  # rival experts compared at once: a [experts, 32] tile stays in registers
SUM_BLOCK = 1024  # slot-sum columns per program: 2 programs a token at hidden 2048


@triton.jit
def _route(LOGITS, WEIGHTS, EXPERTS, n_experts, stride_lt, TOP_K: tl.constexpr,
           RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    row = LOGITS + tl.program_id(0).to(tl.int64) * stride_lt
    e = tl.arange(0, BLOCK_E)
    e_mask = e < n_experts
    logits = tl.load(row + e, mask=e_mask, other=float("-inf")).to(tl.float32)
    key = tl.where(logits != logits, float("inf"), logits)  # NaN ranks first, not nowhere
    rank = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, n_experts, CHUNK):
        o = start + tl.arange(0, CHUNK)
        rival = tl.load(row + o, mask=o < n_experts, other=float("-inf")).to(tl.float32)
        rival = tl.where(rival != rival, float("inf"), rival)
        beats = ((rival[None, :] > key[:, None])
                 | ((rival[None, :] == key[:, None]) & (o[None, :] < e[:, None])))
        rank += tl.sum(beats.to(tl.int32), axis=1)  # a masked rival (-inf, above every index) beats none
    p = tl.exp(logits - tl.max(logits, axis=0))  # 0 on the masked lanes
    chosen = e_mask & (rank < TOP_K)
    if RENORMALIZE:
        p = p / tl.sum(tl.where(chosen, p, 0.0), axis=0)
    else:
        p = p / tl.sum(p, axis=0)
    slot = tl.program_id(0).to(tl.int64) * TOP_K + rank
    tl.store(EXPERTS + slot, e, mask=chosen)
    tl.store(WEIGHTS + slot, p, mask=chosen)


@triton.jit
def _gate_up_act(X, W_GU, S_GU, EXPERTS, ACT, hidden, inter, stride_xt, stride_we, stride_wo, stride_se, stride_so,
                 TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, SCALED: tl.constexpr,
                 SCALE_R: tl.constexpr, SCALE_C: tl.constexpr):
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(EXPERTS + pair).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = i < inter
    gate = tl.zeros([BLOCK_I], dtype=tl.float32)
    up = tl.zeros([BLOCK_I], dtype=tl.float32)
    w_rows = W_GU + expert * stride_we + i[:, None] * stride_wo
    for start in range(0, hidden, BLOCK_H):
        h = start + tl.arange(0, BLOCK_H)
        h_mask = h < hidden
        x = tl.load(X + token.to(tl.int64) * stride_xt + h, mask=h_mask, other=0.0).to(tl.float32)
        m = i_mask[:, None] & h_mask[None, :]
        wg = tl.load(w_rows + h[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(w_rows + inter * stride_wo + h[None, :], mask=m, other=0.0).to(tl.float32)
        if SCALED:  # the tile lies in one block column: one scale per row
            s_rows = S_GU + expert * stride_se + start // SCALE_C
            sg = tl.load(s_rows + (i // SCALE_R) * stride_so, mask=i_mask, other=0.0)
            su = tl.load(s_rows + ((inter + i) // SCALE_R) * stride_so, mask=i_mask, other=0.0)
            gate += tl.sum(wg * x[None, :], axis=1) * sg
            up += tl.sum(wu * x[None, :], axis=1) * su
        else:
            gate += tl.sum(wg * x[None, :], axis=1)
            up += tl.sum(wu * x[None, :], axis=1)
    act = gate * tl.sigmoid(gate) * up
    tl.store(ACT + pair.to(tl.int64) * inter + i, act, mask=i_mask)


@triton.jit
def _down(ACT, W_D, S_D, EXPERTS, WEIGHTS, PART, hidden, inter, stride_we, stride_wh, stride_se, stride_sh,
          BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr, SCALED: tl.constexpr, SCALE_R: tl.constexpr,
          SCALE_C: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    h_mask = h < hidden
    expert = tl.load(EXPERTS + pair).to(tl.int64)
    acc = tl.zeros([BLOCK_O], dtype=tl.float32)
    for start in range(0, inter, BLOCK_K):
        i = start + tl.arange(0, BLOCK_K)
        i_mask = i < inter
        a = tl.load(ACT + pair * inter + i, mask=i_mask, other=0.0)
        w = tl.load(W_D + expert * stride_we + h[:, None] * stride_wh + i[None, :],
                    mask=h_mask[:, None] & i_mask[None, :], other=0.0).to(tl.float32)
        if SCALED:  # the tile lies in one block column: one scale per row
            s = tl.load(S_D + expert * stride_se + (h // SCALE_R) * stride_sh + start // SCALE_C,
                        mask=h_mask, other=0.0)
            acc += tl.sum(w * a[None, :], axis=1) * s
        else:
            acc += tl.sum(w * a[None, :], axis=1)
    tl.store(PART + pair * hidden + h, tl.load(WEIGHTS + pair) * acc, mask=h_mask)


@triton.jit
def _sum_slots(PART, OUT, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h_mask = h < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # a fixed order: the same bits every run
        acc += tl.load(PART + (token * TOP_K + slot) * hidden + h, mask=h_mask, other=0.0)
    tl.store(OUT + token * hidden + h, acc.to(OUT.dtype.element_ty), mask=h_mask)


def triton_route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """(weights [tokens, top_k] float32, experts [tokens, top_k] int32), slots in rank order."""
    tokens, n_experts = router_logits.shape
    assert router_logits.stride(1) == 1 and 0 < top_k <= n_experts
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    experts = torch.empty((tokens, top_k), dtype=torch.int32, device=router_logits.device)
    block_e = triton.next_power_of_2(n_experts)
    _route[(tokens,)](router_logits, weights, experts, n_experts, router_logits.stride(0),
                      TOP_K=top_k, RENORMALIZE=bool(renormalize), BLOCK_E=block_e,
                      CHUNK=min(block_e, RANK_CHUNK), num_warps=4)
    return weights, experts


def launch(x, router_logits, w_gate_up, gu_scale, w_down, d_scale, top_k: int, renormalize: bool, block_i: int,
           block_h: int, block_o: int, block_k: int, num_warps: int, gu_block: tuple[int, int] = BLOCK,
           d_block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The four kernels; `gu_scale` and `d_scale`: the experts' block scales (FP8 experts), one
    per `gu_block` / `d_block` (rows, columns) of each expert's matrix, or None."""
    tokens, hidden = x.shape
    n_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    assert w_gate_up.shape[2] == hidden and w_down.shape == (n_experts, hidden, inter)
    assert router_logits.shape == (tokens, n_experts)
    assert x.stride(1) == 1 and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1
    scaled = gu_scale is not None
    if scaled:
        assert tile_fits(gu_scale, gu_block, block_h) and tile_fits(d_scale, d_block, block_k), \
            "a tile must lie in one block column"
        assert gu_scale.shape == (n_experts, -(-two_inter // gu_block[0]), -(-hidden // gu_block[1]))
        assert d_scale.shape == (n_experts, -(-hidden // d_block[0]), -(-inter // d_block[1]))
        assert gu_scale.stride(2) == 1 and d_scale.stride(2) == 1
    gs, ds = (gu_scale, d_scale) if scaled else (w_gate_up, w_down)  # unread when not scaled
    weights, experts = triton_route(router_logits, top_k, renormalize)
    act = torch.empty((tokens * top_k, inter), dtype=torch.float32, device=x.device)
    part = torch.empty((tokens, top_k, hidden), dtype=torch.float32, device=x.device)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    _gate_up_act[(tokens * top_k, triton.cdiv(inter, block_i))](
        x, w_gate_up, gs, experts, act, hidden, inter, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        gs.stride(0) if scaled else 0, gs.stride(1) if scaled else 0,
        TOP_K=top_k, BLOCK_I=block_i, BLOCK_H=block_h, SCALED=scaled, SCALE_R=gu_block[0], SCALE_C=gu_block[1],
        num_warps=num_warps)
    _down[(tokens * top_k, triton.cdiv(hidden, block_o))](
        act, w_down, ds, experts, weights, part, hidden, inter, w_down.stride(0), w_down.stride(1),
        ds.stride(0) if scaled else 0, ds.stride(1) if scaled else 0,
        BLOCK_K=block_k, BLOCK_O=block_o, SCALED=scaled, SCALE_R=d_block[0], SCALE_C=d_block[1],
        num_warps=num_warps)
    block = min(triton.next_power_of_2(hidden), SUM_BLOCK)
    _sum_slots[(tokens, triton.cdiv(hidden, block))](part, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out


def build(block_i: int, block_h: int, block_o: int, block_k: int, num_warps: int):
    def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        return launch(x, router_logits, w_gate_up, None, w_down, None, top_k, renormalize, block_i, block_h,
                      block_o, block_k, num_warps)

    return fused_moe
