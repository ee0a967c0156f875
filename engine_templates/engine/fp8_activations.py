"""Activations to e4m3 for the scaled matmuls in one Triton kernel on a GPU: per token (row-wise)
or per token and 128 columns (block-wise), each group's largest magnitude mapped to 448, and the
scales written straight in the layout the matmul asks for (column-major for block-wise:
fp8.blockwise_scales). The arithmetic of fp8.quantize_rows, which a CPU runs instead — and which
this replaces at decode, where its eight small kernels per matmul would cost more than the bytes
FP8 saves (a CUDA graph replays kernels, not their launch cost). The division rounds as torch's
does (div_rn), and the GPU's conversion to e4m3 rounds to nearest even, as torch's: equal bits.
(Triton's interpreter converts to e4m3 otherwise, so the values are checked on a GPU.)"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_templates.ops.fp8 import FP8, FP8_MAX


@triton.jit
def _quantize_groups(x, q, scale, cols, stride_x, stride_st, stride_sg, fp8_max, GROUP: tl.constexpr,
                     BLOCK: tl.constexpr):
    token = tl.program_id(0)
    group = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    col = group * GROUP + offs
    mask = (offs < GROUP) & (col < cols)
    v = tl.load(x + token * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12) / fp8_max
    y = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -fp8_max), fp8_max)
    tl.store(q + token * cols + col, y.to(q.dtype.element_ty), mask=mask)
    tl.store(scale + token * stride_st + group * stride_sg, s)


def quantize_groups(x: torch.Tensor, group: int, column_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, cols] (cols a multiple of `group`) to (e4m3 [tokens, cols], float32 scales
    [tokens, cols / group]), the scales row-major or column-major (strides (1, tokens))."""
    tokens, cols = x.shape
    assert cols % group == 0, (x.shape, group)
    if x.stride(1) != 1:
        x = x.contiguous()
    groups = cols // group
    q = torch.empty((tokens, cols), dtype=FP8, device=x.device)
    scale = torch.empty_strided((tokens, groups), (1, tokens) if column_major else (groups, 1), dtype=torch.float32,
                                device=x.device)
    block = triton.next_power_of_2(group)
    _quantize_groups[(tokens, groups)](x, q, scale, cols, x.stride(0), scale.stride(0), scale.stride(1), FP8_MAX,
                                       GROUP=group, BLOCK=block, num_warps=max(1, min(16, block // 1024)))
    return q, scale
