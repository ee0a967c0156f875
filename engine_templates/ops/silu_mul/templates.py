"""Triton SiLU-mul over the flattened tensors, `block` elements per program."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_flat(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m)


def build(block: int, num_warps: int, num_stages: int):
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        assert gate.shape == up.shape and gate.dtype == up.dtype
        assert gate.is_contiguous() and up.is_contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        _silu_mul_flat[(triton.cdiv(n, block),)](gate, up, y, n, BLOCK=block,
                                                  num_warps=num_warps, num_stages=num_stages)
        return y

    return silu_mul
