"""Fused residual add + RMSNorm: r = x + residual; y = r / rms(r) * weight; returns (y, r)."""
from __future__ import annotations

import torch

from engine_templates.ops.base import Template, random_stack, unstack
from engine_templates.ops.rmsnorm import ROWS_TEMPLATE as RMSNORM_ROWS
from engine_templates.ops.rmsnorm import RMSNorm

# The same row kernel family as RMSNorm, so the same search space.
ROWS_TEMPLATE = Template(name="rows", module="engine_templates.ops.fused_add_rmsnorm.templates",
                         space=RMSNORM_ROWS.space, default=RMSNORM_ROWS.default)


class FusedAddRMSNorm(RMSNorm):
    """RMSNorm's shapes and odd shapes; its own inputs, oracle, baseline and counts."""

    name = "fused_add_rmsnorm"
    signature = "fused_add_rmsnorm(x, residual, weight, eps)"
    persistent = ("weight",)
    summary = ("r = x[tokens, hidden] + residual[tokens, hidden]; "
               "(r / rms(r) * weight[hidden], r) -> two new tensors like x")
    n_outputs = 2
    templates = {ROWS_TEMPLATE.name: ROWS_TEMPLATE}

    def draw(self, shape, dtype, device, gens, dist):
        t, h = shape.dims["tokens"], shape.dims["hidden"]
        x = random_stack((t, h), dtype, device, gens, dist)
        residual = random_stack((t, h), dtype, device, gens, dist, scale=4.0)  # the stream is larger
        weight = random_stack((h,), dtype, device, gens, "uniform", scale=0.5) + 1.0
        return [(*a, 1e-6) for a in zip(unstack(x), unstack(residual), unstack(weight))]

    def reference(self, x, residual, weight, eps):
        # The new residual is specified as the dtype-rounded sum, because that is what the engine
        # stores and what the next layer reads. Rounding it is exact bookkeeping, not low-precision
        # arithmetic: the float32 sum of two bf16/fp16 numbers is exact, so rounding the float64 sum
        # gives the correctly rounded value every honest kernel produces (error 0 on this output).
        # The norm is then taken of that stored value in float64, so the tolerance on `normed`
        # measures only the kernel's reduction and output rounding (~1e-3 at bf16 against 1e-2).
        # A kernel that normalizes its unrounded float32 sum instead differs by one rounding of the
        # sum (~1e-3 at bf16, ~3e-4 at fp16) and still passes; with the unrounded sum as the
        # reference, output 1 would carry that rounding error for every kernel, eager included.
        r = (x.double() + residual.double()).to(x.dtype).double()
        normed = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
        return normed, r

    def eager(self, x, residual, weight, eps):
        # The residual add in the op dtype, then what HF transformers' Qwen3RMSNorm does.
        residual = x + residual
        h = residual.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype), residual

    def bytes(self, shape, dtype):
        t, h = shape.dims["tokens"], shape.dims["hidden"]
        # read x, residual, weight; write normed and the new residual
        return (4 * t * h + h) * dtype.itemsize

    def flops(self, shape):
        # add, square, accumulate, scale by rstd, scale by weight
        return 5 * shape.dims["tokens"] * shape.dims["hidden"]


OP = FusedAddRMSNorm()
