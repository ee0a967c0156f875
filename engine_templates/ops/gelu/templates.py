"""Triton exact GELU over the flattened tensor, `block` elements per program, in float32."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

RSQRT2 = 0.7071067811865476


@triton.jit
def _gelu_flat(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
    y = 0.5 * x * (1.0 + tl.math.erf(x * RSQRT2))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)


def build(block: int, num_warps: int, num_stages: int):
    def gelu(x: torch.Tensor) -> torch.Tensor:
        assert x.is_contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        _gelu_flat[(triton.cdiv(n, block),)](x, y, n, BLOCK=block, num_warps=num_warps, num_stages=num_stages)
        return y

    return gelu
