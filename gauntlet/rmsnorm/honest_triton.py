# expect: pass — a Triton kernel written as a free module: one program per row, float32 inside.
import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_row(x_ptr, w_ptr, y_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * n_cols + cols, (x * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x, weight, eps):
    assert x.is_contiguous() and weight.is_contiguous()
    y = torch.empty_like(x)
    n_rows, n_cols = x.shape
    _rmsnorm_row[(n_rows,)](x, weight, y, n_cols, eps, BLOCK=triton.next_power_of_2(n_cols))
    return y
