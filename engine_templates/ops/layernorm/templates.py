"""Triton LayerNorm, one program per `rows_per_program` rows; a row in one block (read once) or in
chunks (three passes: the mean, the variance about it, the output)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _layernorm_rows(X, W, B, Y, n_rows, n_cols, stride_x, stride_y, eps,
                    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, CHUNKED: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    for r in tl.static_range(ROWS):
        row = pid * ROWS + r
        limit = tl.where(row < n_rows, n_cols, 0)  # a row past the end: an empty mask
        x_row = X + row.to(tl.int64) * stride_x
        y_row = Y + row.to(tl.int64) * stride_y
        if CHUNKED:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                acc += tl.load(x_row + start + cols, mask=(start + cols) < limit, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=0) / n_cols
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                m = (start + cols) < limit
                x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
                acc += tl.where(m, (x - mean) * (x - mean), 0.0)
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
            for start in range(0, n_cols, BLOCK_N):
                m = (start + cols) < limit
                x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
                w = tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32)
                b = tl.load(B + start + cols, mask=m, other=0.0).to(tl.float32)
                tl.store(y_row + start + cols, ((x - mean) * rstd * w + b).to(Y.dtype.element_ty), mask=m)
        else:
            m = cols < limit
            w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
            b = tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
            x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=0) / n_cols
            centred = tl.where(m, x - mean, 0.0)
            rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
            tl.store(y_row + cols, (centred * rstd * w + b).to(Y.dtype.element_ty), mask=m)


def build(block_n: int, rows_per_program: int, num_warps: int, num_stages: int):
    def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        assert x.shape[-1] == weight.shape[0] == bias.shape[0]
        assert weight.is_contiguous() and bias.is_contiguous()
        x2 = x.reshape(-1, x.shape[-1])
        assert x2.stride(-1) == 1, "rows must be contiguous"
        n_rows, n_cols = x2.shape
        y = torch.empty_like(x2)
        full = triton.next_power_of_2(n_cols)
        block = full if block_n == 0 else min(block_n, full)
        _layernorm_rows[(triton.cdiv(n_rows, rows_per_program),)](
            x2, weight, bias, y, n_rows, n_cols, x2.stride(0), y.stride(0), eps,
            BLOCK_N=block, ROWS=rows_per_program, CHUNKED=block < n_cols,
            num_warps=num_warps, num_stages=num_stages)
        return y.view(x.shape)

    return layernorm
