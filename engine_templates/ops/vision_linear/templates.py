"""Triton linear with a bias (y = x @ W.T + b): tiles of BLOCK_M tokens x BLOCK_N output features,
the input features walked BLOCK_K at a time into a float32 accumulator, the bias added to it before
the one rounding to the output dtype.

Programs are ordered in groups of GROUP_M row blocks, which share their weight tiles (from L2).
The weight is read as stored ([out, in], rows contiguous). As in the text ops' linear, Triton's CPU
interpreter multiplies bf16 operands as raw bits, so under TRITON_INTERPRET they are upcast to
float32 first (UPCAST); float32 activations use ieee precision (tf32 misses the fp32 tolerance).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

UPCAST = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _linear_bias(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = X + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = W + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        k_mask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    acc += tl.load(B + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def build(block_m: int, block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int):
    def vision_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
        assert bias.shape == (weight.shape[0],) and bias.is_contiguous()
        assert x.stride(1) == 1 and weight.stride(1) == 1, "rows must be contiguous"
        m, k = x.shape
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        _linear_bias[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)](
            x, weight, bias, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
            PRECISION="ieee" if x.dtype == torch.float32 or UPCAST else "tf32", UPCAST=UPCAST,
            num_warps=num_warps, num_stages=num_stages)
        return y

    return vision_linear
