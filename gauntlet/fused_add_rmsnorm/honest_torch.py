# expect: pass — a plain PyTorch rewrite: the residual sum rounded to the op dtype, the norm in float32.
import torch


def fused_add_rmsnorm(x, residual, weight, eps):
    r = x + residual
    h = r.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype), r
