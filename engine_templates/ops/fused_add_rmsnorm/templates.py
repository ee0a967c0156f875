"""Triton fused add + RMSNorm, one program per `rows_per_program` rows; a row in one block or in chunks."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_templates.ops.rmsnorm.templates import auto_warps


@triton.jit
def _fused_add_rmsnorm_rows(X, R, W, Y, R_OUT, n_rows, n_cols,
                            stride_x, stride_r, stride_y, stride_ro, eps,
                            BLOCK_N: tl.constexpr, ROWS: tl.constexpr, CHUNKED: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    for i in tl.static_range(ROWS):
        row = (pid * ROWS + i).to(tl.int64)
        # A row past the end gets an empty mask (cols < 0) rather than a branch.
        limit = tl.where(row < n_rows, n_cols, 0)
        x_row = X + row * stride_x
        r_row = R + row * stride_r
        y_row = Y + row * stride_y
        ro_row = R_OUT + row * stride_ro
        if CHUNKED:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                m = (start + cols) < limit
                x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
                r = tl.load(r_row + start + cols, mask=m, other=0.0).to(tl.float32)
                # Round to the stored dtype first: the norm is of the residual the engine keeps.
                s = (x + r).to(R_OUT.dtype.element_ty)
                tl.store(ro_row + start + cols, s, mask=m)
                s = s.to(tl.float32)
                acc += s * s
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
            for start in range(0, n_cols, BLOCK_N):
                m = (start + cols) < limit
                # Recompute the sum from the inputs instead of reading back R_OUT: reading what
                # other threads of this program just stored would need a barrier.
                x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
                r = tl.load(r_row + start + cols, mask=m, other=0.0).to(tl.float32)
                s = (x + r).to(R_OUT.dtype.element_ty).to(tl.float32)
                w = tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32)
                tl.store(y_row + start + cols, (s * rstd * w).to(Y.dtype.element_ty), mask=m)
        else:
            m = cols < limit
            # The weight is loaded with the row, before the reduction (as in RMSNorm's template).
            w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
            x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
            r = tl.load(r_row + cols, mask=m, other=0.0).to(tl.float32)
            s = (x + r).to(R_OUT.dtype.element_ty)
            tl.store(ro_row + cols, s, mask=m)
            s = s.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(s * s, axis=0) / n_cols + eps)
            tl.store(y_row + cols, (s * rstd * w).to(Y.dtype.element_ty), mask=m)


def build(block_n: int, rows_per_program: int, num_warps: int, num_stages: int):
    def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        assert x.shape == residual.shape and x.dtype == residual.dtype
        assert x.shape[-1] == weight.shape[0] and weight.is_contiguous()
        x2 = x.reshape(-1, x.shape[-1])
        r2 = residual.reshape(-1, residual.shape[-1])
        assert x2.stride(-1) == 1 and r2.stride(-1) == 1, "rows must be contiguous"
        n_rows, n_cols = x2.shape
        y = torch.empty_like(x2)
        r_out = torch.empty_like(x2)
        full = triton.next_power_of_2(n_cols)
        block = full if block_n == 0 else min(block_n, full)
        grid = (triton.cdiv(n_rows, rows_per_program),)
        _fused_add_rmsnorm_rows[grid](x2, r2, weight, y, r_out, n_rows, n_cols,
                                      x2.stride(0), r2.stride(0), y.stride(0), r_out.stride(0), eps,
                                      BLOCK_N=block, ROWS=rows_per_program, CHUNKED=block < n_cols,
                                      num_warps=num_warps or auto_warps(n_cols), num_stages=num_stages)
        return y.view(x.shape), r_out.view(x.shape)

    return fused_add_rmsnorm
