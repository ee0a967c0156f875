"""Triton RMSNorm, one program per `rows_per_program` rows; a row in one block or in chunks."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_rows(X, W, Y, n_rows, n_cols, stride_x, stride_y, eps,
                  BLOCK_N: tl.constexpr, ROWS: tl.constexpr, CHUNKED: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    for r in tl.static_range(ROWS):
        row = pid * ROWS + r
        # A row past the end gets an empty mask (cols < 0) rather than a branch.
        limit = tl.where(row < n_rows, n_cols, 0)
        x_row = X + row.to(tl.int64) * stride_x
        y_row = Y + row.to(tl.int64) * stride_y
        if CHUNKED:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                m = (start + cols) < limit
                x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
                acc += x * x
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
            for start in range(0, n_cols, BLOCK_N):
                m = (start + cols) < limit
                x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
                w = tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32)
                tl.store(y_row + start + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=m)
        else:
            m = cols < limit
            # The weight is loaded with the row, before the reduction, so that its latency
            # overlaps the row's instead of following the sum (5-11% of the kernel's time at
            # decode on an H200, docs/BENCHMARKS.md).
            w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
            x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
            tl.store(y_row + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=m)


def auto_warps(n_cols: int) -> int:
    """Warps for a row of n_cols: 16 elements of the power-of-two row a thread, 4 to 16 warps.
    Measured on an H200 (docs/BENCHMARKS.md, 2026-12-04, bench/points_probe.py): the fastest
    whole-row warp count at every decode batch of both presets; 8 for qwen3-8b's 4,096 (rmsnorm
    1.16-1.25x torch.compile, where 4 warps, the old default, trailed it at 0.94-0.97x) and 4 for
    qwen3-30b-a3b's 2,048; at prefill within 3% of the best point of the grid."""
    return min(16, max(4, triton.next_power_of_2(n_cols) // 512))


def build(block_n: int, rows_per_program: int, num_warps: int, num_stages: int):
    def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        assert x.shape[-1] == weight.shape[0] and weight.is_contiguous()
        x2 = x.reshape(-1, x.shape[-1])
        assert x2.stride(-1) == 1, "rows must be contiguous"
        n_rows, n_cols = x2.shape
        y = torch.empty_like(x2)
        full = triton.next_power_of_2(n_cols)
        block = full if block_n == 0 else min(block_n, full)
        grid = (triton.cdiv(n_rows, rows_per_program),)
        _rmsnorm_rows[grid](x2, weight, y, n_rows, n_cols, x2.stride(0), y.stride(0), eps,
                            BLOCK_N=block, ROWS=rows_per_program, CHUNKED=block < n_cols,
                            num_warps=num_warps or auto_warps(n_cols), num_stages=num_stages)
        return y.view(x.shape)

    return rmsnorm
