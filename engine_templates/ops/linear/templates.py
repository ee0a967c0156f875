"""Triton linear (y = x @ W.T): tiles of BLOCK_M tokens x BLOCK_N output features, the input
features walked BLOCK_K at a time into a float32 accumulator.

Programs are ordered in groups of GROUP_M row blocks: the programs of one group share their
weight tiles, which then come from L2 at prefill; at decode there is one row block and the order
does not matter. The weight is read as stored ([out, in], rows contiguous), so no transposed copy
is made.

Scaled weights (the fp8 target, `fp8_templates.py`): the weight is e4m3 with one float32 scale
per 128 x 128 block. A K step lies inside one block column (BLOCK_K divides 128), so each step's
product is multiplied by its blocks' scales, one per output feature, before it is added: the
scales are applied in the kernel and the weight is read at one byte an element. With FP8_DOT the
step's activations are quantized to e4m3 too (one scale per token and step, from its largest
magnitude) and the product runs on FP8 tensor cores, at twice the rate of bf16; that rounds the
activations as well, a numerics change the target's tolerance judges.

Triton's CPU interpreter multiplies bf16 operands as raw uint16 bits (its tl.dot hands numpy the
storage of bf16, which numpy has no type for), so under TRITON_INTERPRET the operands are upcast
to float32 first (UPCAST), as decode attention does; e4m3 operands it converts itself, but its cast
to e4m3 drops the carry of a mantissa rounded up (31.4 becomes 16), so under UPCAST FP8_DOT rounds
the activations to e4m3 values in float32 arithmetic (`_round_e4m3`) and multiplies those. float32
activations use ieee precision: tf32 misses the fp32 tolerance.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Read at call time, so a test can flip it; see the module docstring.
UPCAST = os.environ.get("TRITON_INTERPRET") == "1"
SCALE_BLOCK = 128  # weight rows and columns per scale (engine_templates/ops/fp8.py BLOCK)


@triton.jit
def _round_e4m3(v):
    """float32 `v` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in float32
    arithmetic: under the interpreter only, whose cast to e4m3 does not carry a mantissa rounded
    up into the exponent (31.4 becomes 16, not 32)."""
    a = tl.abs(v)
    e = tl.floor(tl.log2(tl.maximum(a, 1e-30)))
    e = tl.maximum(tl.where(tl.exp2(e) > a, e - 1.0, e), -6.0)  # below 2^-6: subnormal steps of 2^-9
    step = tl.exp2(e - 3.0)
    r = a / step
    f = tl.floor(r)
    d = r - f
    q = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + (f - 2.0 * tl.floor(f * 0.5))))
    return tl.where(v < 0, -q * step, q * step)


@triton.jit
def _linear(X, W, S, Y, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
            SCALED: tl.constexpr, SCALE_BLOCK: tl.constexpr, FP8_DOT: tl.constexpr,
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
        if SCALED:
            s = tl.load(S + (rn // SCALE_BLOCK) * stride_sn + k // SCALE_BLOCK, mask=n_mask, other=0.0)
            if FP8_DOT:
                xf = x.to(tl.float32)
                sx = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-12) / 448.0
                if UPCAST:
                    part = tl.dot(_round_e4m3(xf / sx[:, None]), w.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot((xf / sx[:, None]).to(w.dtype), w)
                acc += part * sx[:, None] * s[None, :]
            else:
                if UPCAST:
                    part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
                else:
                    part = tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
                acc += part * s[None, :]
        else:
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    y = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block_m: int, block_n: int,
           block_k: int, group_m: int, num_warps: int, num_stages: int, fp8_dot: bool = False) -> torch.Tensor:
    """y = x @ dequantized(weight).T; `scale`: the weight's 128 x 128 block scales, or None."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.stride(1) == 1, "rows must be contiguous"
    m, k = x.shape
    n = weight.shape[0]
    if scale is not None:
        assert SCALE_BLOCK % block_k == 0, "a K step must lie inside one block column of scales"
        assert scale.shape == (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK)) and scale.stride(1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _linear[grid](x, weight, scale if scale is not None else weight, y, m, n, k, x.stride(0), weight.stride(0),
                  scale.stride(0) if scale is not None else 0, y.stride(0),
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, SCALED=scale is not None,
                  SCALE_BLOCK=SCALE_BLOCK, FP8_DOT=fp8_dot,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=UPCAST,
                  num_warps=num_warps, num_stages=num_stages)
    return y


def build(block_m: int, block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int):
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return launch(x, weight, None, block_m, block_n, block_k, group_m, num_warps, num_stages)

    return linear
