"""Triton fused MoE for few tokens (decode): routing in torch, then two GEMV-style kernels.

Pass 1, grid (tokens * top_k, inter / BLOCK_I): one (token, slot) pair and a block of the
expert's intermediate channels; its gate and up rows are reduced against the token's hidden
vector tile by tile, and silu(gate) * up goes to a float32 workspace.
Pass 2, grid (tokens * top_k, hidden / BLOCK_O): one (token, slot) pair and a block of output
channels; the expert's down rows, in tiles of BLOCK_K intermediate channels, reduced against
the pair's activation, times its routing weight, to a float32 workspace; the sum over each
token's slots is torch's. (One program per token and block, walking its slots, left most of
the GPU idle at decode: 16 programs for a 2048-wide hidden at batch 1.)

Every expert matrix is streamed once per (token, slot): right for decode batches, where few
tokens share an expert; a grouped GEMM over tokens sorted by expert is the prefill shape and is
not this template.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_templates.ops.fused_moe import route


@triton.jit
def _gate_up_act(X, W_GU, EXPERTS, ACT, hidden, inter, stride_xt, stride_we, stride_wo,
                 TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
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
        gate += tl.sum(wg * x[None, :], axis=1)
        up += tl.sum(wu * x[None, :], axis=1)
    act = gate * tl.sigmoid(gate) * up
    tl.store(ACT + pair.to(tl.int64) * inter + i, act, mask=i_mask)


@triton.jit
def _down(ACT, W_D, EXPERTS, WEIGHTS, PART, hidden, inter, stride_we, stride_wh,
          BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr):
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
        acc += tl.sum(w * a[None, :], axis=1)
    tl.store(PART + pair * hidden + h, tl.load(WEIGHTS + pair) * acc, mask=h_mask)


def build(block_i: int, block_h: int, block_o: int, block_k: int, num_warps: int):
    def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        tokens, hidden = x.shape
        n_experts, two_inter, _ = w_gate_up.shape
        inter = two_inter // 2
        assert w_gate_up.shape[2] == hidden and w_down.shape == (n_experts, hidden, inter)
        assert x.stride(1) == 1 and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1
        weights, experts = route(router_logits, top_k, renormalize)
        experts = experts.contiguous()
        weights = weights.contiguous()
        act = torch.empty((tokens * top_k, inter), dtype=torch.float32, device=x.device)
        part = torch.empty((tokens, top_k, hidden), dtype=torch.float32, device=x.device)
        _gate_up_act[(tokens * top_k, triton.cdiv(inter, block_i))](
            x, w_gate_up, experts, act, hidden, inter, x.stride(0), w_gate_up.stride(0),
            w_gate_up.stride(1), TOP_K=top_k, BLOCK_I=block_i, BLOCK_H=block_h, num_warps=num_warps)
        _down[(tokens * top_k, triton.cdiv(hidden, block_o))](
            act, w_down, experts, weights, part, hidden, inter, w_down.stride(0), w_down.stride(1),
            BLOCK_K=block_k, BLOCK_O=block_o, num_warps=num_warps)
        return part.sum(dim=1).to(x.dtype)

    return fused_moe
